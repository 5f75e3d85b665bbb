"""kv-retrieval's pure parts: needles, haystack assembly, the per-needle statistics, the
plan of setups. No model (the real run is tests/test_kv_retrieval_real.py); the option
checks run the command line, which stops before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from clickpaca.measure.retrieval.command import BASE, F32_REF, NOISE, _not_run, floor_name, plan, summarize
from clickpaca.measure.retrieval.haystack import assemble, depths, make_needles
from clickpaca.measure.retrieval.stats import above_noise, exact_match, floor, kl_rows, mean_ci, paired_diff
from clickpaca.measure.retrieval.runner import run


def test_needles_are_reproducible_distinct_and_answerable():
    a, b = make_needles(9, seed=3), make_needles(9, seed=3)
    assert a == b
    assert make_needles(9, seed=4) != a
    assert len({n.subject for n in a}) == 9
    assert [n.kind for n in a[:3]] == ["passkey", "name", "number"]
    for n in a:
        assert n.answer.startswith(" ") and n.answer.strip() in n.fact
        assert n.subject in n.question and n.answer.strip() not in n.question
    with pytest.raises(ValueError, match="needles"):
        make_needles(0)


def test_depths_are_spread_inside_the_haystack():
    assert depths(4) == [0.125, 0.375, 0.625, 0.875]


def _filler(n):
    toks = np.arange(1000, 1000 + n, dtype=np.int32)
    breaks = np.zeros(n, dtype=bool)
    breaks[9::10] = True  # every tenth token ends a line
    return toks, breaks


def test_assemble_places_needles_after_line_breaks_at_their_depths():
    filler, breaks = _filler(500)
    needles = [np.full(5, -1, np.int32), np.full(3, -2, np.int32)]
    hay, starts = assemble(filler, breaks, needles, [0.7, 0.2], 200)
    assert len(hay) == 200
    for s, nd in zip(starts, needles):
        assert np.array_equal(hay[s:s + len(nd)], nd)
        assert breaks[hay[s - 1] - 1000]  # the token before the needle ends a line
    assert starts[1] < starts[0]
    assert abs(starts[1] / 200 - 0.2) < 0.06 and abs(starts[0] / 200 - 0.7) < 0.06
    rest = hay[hay >= 1000]
    assert np.array_equal(rest, filler[:192])  # the filler in order, nothing lost or repeated


def test_assemble_without_needles_is_the_same_length_control():
    filler, breaks = _filler(500)
    hay, starts = assemble(filler, breaks, [], [], 200)
    assert starts == [] and np.array_equal(hay, filler[:200])


def test_assemble_refuses_a_filler_too_short_and_bad_depths():
    filler, breaks = _filler(100)
    with pytest.raises(ValueError, match="filler"):
        assemble(filler, breaks, [], [], 200)
    with pytest.raises(ValueError, match="depth"):
        assemble(filler, breaks, [np.zeros(2, np.int32)], [1.5], 50)


def test_exact_match_needs_the_whole_answer_and_no_run_on():
    assert exact_match(" 48213.", " 48213")
    assert exact_match("48213\n", " 48213")
    assert not exact_match(" 482139", " 48213")
    assert not exact_match(" 4821", " 48213")
    assert exact_match(" Miriam Castell, who", " Miriam Castell")
    assert not exact_match(" Miriam Castellan", " Miriam Castell")


def test_kl_rows_is_zero_for_equal_rows_and_positive_otherwise():
    lp = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]], dtype=np.float32))
    assert np.allclose(kl_rows(lp, lp), 0)
    other = np.log(np.full((2, 3), 1 / 3, dtype=np.float32))
    assert (kl_rows(lp, other) > 0).all()


def test_paired_diff_cancels_needle_difficulty():
    base = np.array([-1.0, -20.0, -3.0, -15.0, -0.5, -8.0])
    d = paired_diff(base, base - 0.1)
    assert d["mean"] == pytest.approx(-0.1)
    assert d["ci"][0] == pytest.approx(-0.1) and d["ci"][1] == pytest.approx(-0.1)
    unpaired = mean_ci(base - 0.1)
    assert unpaired["ci"][1] - unpaired["ci"][0] > 1  # the spread across needles, which pairing removes


def test_above_noise_needs_kl_and_logprob_beyond_every_noise_row():
    noise = [{"kl_base": {"mean": 0.01}, "dlogp": {"mean": -0.05}, "dacc": {"mean": 0.0}},
             {"kl_base": {"mean": 0.02}, "dlogp": {"mean": 0.08}, "dacc": {"mean": -0.125}}]
    fl = floor(noise)
    assert fl == {"kl": 0.02, "dlogp": 0.08, "dacc": 0.125}
    big = {"kl_f16": {"mean": 0.5}, "dlogp": {"mean": -2.0, "ci": [-3.0, -1.0]}}
    assert above_noise(big, fl) is True
    assert above_noise({**big, "dlogp": {"mean": -0.07, "ci": [-0.1, -0.04]}}, fl) is False
    assert above_noise({**big, "dlogp": {"mean": -2.0, "ci": [-4.0, 0.5]}}, fl) is False
    assert above_noise({**big, "kl_f16": {"mean": 0.015}}, fl) is False
    assert above_noise(big, floor([])) is None


def test_plan_runs_reference_base_control_noise_then_types():
    p = plan([("q8_0", "q8_0"), ("f16", "f16"), ("turbo3", "turbo3")], "f32", True)
    assert p[0] == ("ref", F32_REF) and p[1] == ("type", BASE) and p[2] == ("control", BASE)
    assert [s for _, s in p[3:3 + len(NOISE)]] == list(NOISE)
    assert [s.name for r, s in p[3 + len(NOISE):]] == ["q8_0", "turbo3"]
    p = plan([("q4_0", "q4_0")], "f16", False)
    assert [r for r, _ in p] == ["base", "control", "type"]


def test_the_table_lists_reference_base_types_control_whatever_the_run_order():
    setups = plan([("f16", "f16"), ("q8_0", "q8_0")], "f32", False)
    recs = [r for name in (F32_REF.name, "f16", "f16, needles removed", "q8_0")
            for r in _records(name, 1024, [-4.0, -5.0])]
    rows, _ = summarize(recs, setups, [1024])
    assert [r["cache"] for r in rows if r["length"] == 1024] == [F32_REF.name, "f16", "q8_0",
                                                                  "f16, needles removed"]



def _records(setup: str, length: int, logps: list[float], kl_base: float | None = None) -> list[dict]:
    extra = {} if kl_base is None else {"kl_base": kl_base}
    return [{"setup": setup, "length": length, "needle": i, "exact": False, "answer_logp": lp,
             "kl_f16": 0.01, **extra} for i, lp in enumerate(logps)]


def test_a_stopped_study_summarizes_only_the_setups_it_ran_and_names_the_rest():
    setups = plan([("f16", "f16"), ("q8_0", "q8_0")], "f16", True)
    recs = _records("f16", 1024, [-4.0, -5.0]) + _records(NOISE[0].name, 1024, [-4.0, -5.5], kl_base=0.01)
    rows, noise = summarize(recs, setups, [1024])
    assert [r["cache"] for r in rows] == ["f16", "f16"]  # at 1024 and over all lengths
    assert [r["source"] for r in noise] == [NOISE[0].name]
    assert noise[0]["dlogp"]["mean"] == -0.25
    note = _not_run(setups, [1024, 2048], 1024, NOISE[1].name)
    for n in NOISE[1:]:
        assert f"{n.name} at 1024" in note
    assert "q8_0 at 1024" in note and "f16, needles removed at" not in note
    assert "every setup at 2048" in note and NOISE[0].name + " at" not in note


def test_noise_of_runs_the_type_then_its_own_noise_rows_before_the_other_types():
    p = plan([("f16", "f16"), ("q8_0", "q8_0"), ("turbo3", "turbo3")], "f32", True, ("turbo3", "turbo3"))
    roles = [r for r, _ in p]
    assert roles[:4] == ["ref", "type", "control", "type"] and p[3][1].name == "turbo3"
    noise = [s for r, s in p if r == "noise"]
    # a quantized V needs flash attention: that row is left out, the others vary turbo3
    assert [s.name for s in noise] == [n.name for n in NOISE if n.flash_attn != "off"]
    assert all((s.type_k, s.type_v, s.flash_attn) == ("turbo3", "turbo3", "on") for s in noise)
    assert [s.name for r, s in p[4 + len(noise):]] == ["q8_0"]
    # an unquantized V keeps the flash-attention-off row
    p = plan([("f16", "f16"), ("q8_0", "f16")], "f16", True, ("q8_0", "f16"))
    assert [s.flash_attn for r, s in p if r == "noise"] == [n.flash_attn for n in NOISE]
    # f16's own floor is the default one
    assert plan([("f16", "f16")], "f16", True, ("f16", "f16")) == plan([("f16", "f16")], "f16", True)


def test_noise_of_must_be_one_of_the_types():
    with pytest.raises(ValueError, match=r"--noise-of: turbo2 is not one of --cache \(f16, turbo3\)"):
        plan([("f16", "f16"), ("turbo3", "turbo3")], "f16", True, ("turbo2", "turbo2"))


def test_a_floor_of_another_type_is_read_against_it_and_not_applied_to_the_types():
    setups = plan([("f16", "f16"), ("turbo3", "turbo3")], "f16", True, ("turbo3", "turbo3"))
    of = floor_name(setups, ("turbo3", "turbo3"))
    assert of == "turbo3" and floor_name(setups, None) == "f16"
    recs = (_records("f16", 1024, [-4.0, -5.0]) + _records("turbo3", 1024, [-8.0, -9.0])
            + _records(NOISE[0].name, 1024, [-8.5, -9.0], kl_base=0.3))
    rows, noise = summarize(recs, setups, [1024], of)
    assert noise[0]["dlogp"]["mean"] == -0.25 and noise[0]["kl_base"]["mean"] == pytest.approx(0.3)
    t3 = next(r for r in rows if r["cache"] == "turbo3" and r["length"] == 1024)
    assert t3["dlogp"]["mean"] == -4.0 and t3["above_noise"] is None  # shown, not applied
    # the same rows read as f16's floor are applied
    rows, noise = summarize(recs, setups, [1024])
    assert noise[0]["dlogp"]["mean"] == pytest.approx(-4.25)
    assert next(r for r in rows if r["cache"] == "turbo3" and r["length"] == 1024)["above_noise"] is not None


@pytest.mark.parametrize("command", ["kv-retrieval", "ppl"])
def test_noise_of_without_noise_is_refused_naming_the_option(command, tmp_path):
    env = dict(os.environ, CLICKPACA_RESULTS=str(tmp_path / "r.sqlite3"))
    p = subprocess.run([sys.executable, "-m", "clickpaca", command, "--cache", "f16,turbo3", "--noise-of", "turbo3",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and "--noise-of: needs --noise" in p.stderr, p.stderr[-2000:]


def test_centered_pairs_run_last_and_name_their_centering():
    p = plan([("f16", "f16"), ("q4_0", "q4_0")], "f16", False, None, [("q5_0", "turbo3"), ("q4_0", "q4_0")])
    assert [(s.name, s.centered) for _, s in p[2:]] == [("q4_0", False), ("q5_0+c/turbo3", True),
                                                         ("q4_0+c/q4_0", True)]
    assert p[-2][1].flash_attn == "on"  # a quantized V needs flash attention, centered or not
    with pytest.raises(ValueError, match="needs the center"):
        run(None, p[-1][1], np.zeros(4, dtype=np.int32), [], 1)
