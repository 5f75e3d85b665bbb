"""measure/kvsim/figures.py: the series read from the commands' JSON, and the figures drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clickpaca.measure.kvsim import figures

PPL = {"rows": [{"cache": "f16", "bpv": 16, "kl_ref2": "f16", "kl_mean_ref2": 0.0},
                {"cache": "q8_0", "bpv": 8.5, "kl_ref2": "f16", "kl_mean_ref2": 0.004},
                {"cache": "q4_0", "bpv": 4.5, "kl_ref2": "f16", "kl_mean_ref2": 0.04}],
       "noise": [{"kl_mean": 0.003}, {"kl_mean": 0.0037}]}
RET = {"rows": [{"cache": "f16", "role": "type", "length": 1024},
                {"cache": "q4_0", "role": "type", "length": 1024, "dlogp": {"mean": -0.5}},
                {"cache": "q4_0", "role": "type", "length": 2048, "dlogp": {"mean": -0.7}},
                {"cache": "q4_0", "role": "type", "length": "all", "dlogp": {"mean": -0.6}},
                {"cache": "f16, needles removed", "role": "control", "length": 1024, "dlogp": {"mean": -9}}],
       "noise": [{"source": "x", "length": 1024, "dlogp": {"mean": -0.05}},
                 {"source": "y", "length": 1024, "dlogp": {"mean": 0.08}},
                 {"source": "x", "length": 2048, "dlogp": {"mean": 0.02}}]}


def test_series_come_from_the_commands_json():
    pts, floor = figures.ppl_points(PPL)
    assert pts == [("q8_0", 8.5, 0.004), ("q4_0", 4.5, 0.04)] and floor == 0.0037
    lengths, series, fl = figures.retrieval_series(RET)
    assert lengths == [1024, 2048] and series == {"q4_0": [-0.5, -0.7]} and fl == [0.08, 0.02]


def test_figures_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    gemma = json.loads(Path("docs/data/kv-gemma3-270m.json").read_text())
    sim = {"rows": [{"name": "q4_0/q4_0 (sim)", "kl_f16": 0.04, "kl_f16_ci": [0.035, 0.045]},
                    {"name": "lm4+c/lm4 (sim)", "kl_f16": 0.02, "kl_f16_ci": [0.018, 0.023]}]}
    figures.fig_ppl(gemma, PPL, tmp_path / "a.png")
    figures.fig_retrieval(gemma, RET, tmp_path / "b.png")
    figures.fig_sim({"m1": sim, "m2": sim}, tmp_path / "c.png")
    assert all((tmp_path / n).stat().st_size > 5000 for n in ("a.png", "b.png", "c.png"))
