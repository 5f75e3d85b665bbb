"""Key centering under a real cache type (measure/kvsim: hook.Center, study's `--real K+c/V`):
in an f32 or f16 cache, subtracting the calibrated mean key changes the distributions only by
rounding (exact for attention: q.(k - m) = q.k - q.m, one constant per query); under q4_0 the
real kernels quantize the centered keys, which changes them; the spec parses and runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.llama.cachetypes import UnknownCacheType
from clickpaca.measure.kl import kl_rows, log_softmax
from clickpaca.measure.kvsim import hook as hk
from clickpaca.measure.kvsim import study
from conftest import chunked_logits

N = 128


def _tokens(model) -> list[int]:
    text = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
            "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles ") * 6
    return model.tokenize(text, add_special=True, parse_special=False)


def _logp(model, toks, cache: str, callback=None, chunk: int = 64) -> np.ndarray:
    """Log-probabilities of every position, K/V `cache`, prompt chunks of `chunk`; flash
    attention off for f32 (flash attention would cast it to f16), on otherwise."""
    ctx = core.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=2, type_k=cache,
                       type_v=cache, n_threads=2, flash_attn="off" if cache == "f32" else "on",
                       eval_callback=callback)
    try:
        return log_softmax(chunked_logits(ctx, model, toks, chunk))
    finally:
        ctx.close()


def _flips(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Where the greedy token differs: the reference's log-prob gap between the two tokens."""
    a, b = ref.argmax(axis=1), got.argmax(axis=1)
    rows = np.flatnonzero(a != b)
    return ref[rows, a[rows]] - ref[rows, b[rows]]


@pytest.fixture(scope="module")
def calibrated(model):
    """K/V means from a text that is not the one scored (the study calibrates on a later window)."""
    toks = _tokens(model)
    rec = hk.Recorder(model.nat)
    _logp(model, toks[N:N + 128] if len(toks) >= N + 128 else toks[-128:], "f16", rec.callback)
    assert not rec.errors
    return rec.calib()


pytestmark = pytest.mark.model


def test_centering_alone_moves_the_logits_only_by_rounding(model, calibrated):
    """The f16 floor here is the largest KL of f16 against f32 and of f16 against itself in
    prompt chunks of 16 (rounding only: the model re-quantizes activations to 8 bits for its
    quantized weights, so rounding-level changes already cost ~0.01 nats on this text).
    Rounding-level changes scatter (measured on Gemma 3 270M: 0.013-0.019 for centering in
    f32 and f16, 0.0136-0.0145 for the floor's rows), so centering must stay under twice the
    floor, in f32 and in f16, against f32 and against f16; greedy tokens part only rarely and
    only at near ties of the floor's own size. A shift that is not exact (V, below) costs 1000x."""
    toks = _tokens(model)[:N]
    f32 = _logp(model, toks, "f32")
    f16 = _logp(model, toks, "f16")
    f16_16 = _logp(model, toks, "f16", chunk=16)
    floor = max(kl_rows(f32, f16).mean(), kl_rows(f16, f16_16).mean())
    near_tie = max(_flips(f32, f16).max(initial=0), _flips(f16, f16_16).max(initial=0), 0.5)
    c = hk.Center(model.nat, calibrated)
    c32 = _logp(model, toks, "f32", c.callback)
    assert not c.errors and c.calls == 2 * model.n_layer  # K of every layer, 2 decodes, V never asked
    assert not np.array_equal(c32, f32)  # the callback did change K (else the bounds are vacuous)
    c16 = _logp(model, toks, "f16", hk.Center(model.nat, calibrated).callback)
    assert 0 < floor < 0.05, floor
    kls = {"f32 centered vs f32": kl_rows(f32, c32).mean(), "f16 centered vs f32": kl_rows(f32, c16).mean(),
           "f16 centered vs f16": kl_rows(f16, c16).mean()}
    assert all(kl < 2 * floor for kl in kls.values()), (kls, floor)
    for ref, got in ((f32, c32), (f16, c16)):
        gaps = _flips(ref, got)
        assert len(gaps) <= max(3, N // 20) and (gaps < 2 * near_tie).all(), (gaps, near_tie)


def test_a_wrong_mean_is_not_exact_for_v_so_the_bound_can_fail(model, calibrated):
    """The same shift applied to V (not exact: the output moves by the weighted mean) moves the
    distributions far beyond the floor: the bound above is one a broken centering fails."""
    toks = _tokens(model)[:N]
    f32 = _logp(model, toks, "f32")

    class CenterV(hk.Center):
        def __init__(self, nat, calib):
            super().__init__(nat, calib)
            self.mean = {layer: c.mean for (is_k, layer), c in calib.items() if not is_k}

        def wants(self, is_k, layer):
            return not is_k and layer in self.mean

    bad = CenterV(model.nat, calibrated)
    got = _logp(model, toks, "f32", bad.callback)
    assert not bad.errors and bad.calls == 2 * model.n_layer
    assert kl_rows(f32, got).mean() > 1.0  # measured: 15-18 nats, 1000x the floor


def test_real_centered_spec_parses():
    assert study.parse_real("q4_0") == ("q4_0", "q4_0", False)
    assert study.parse_real("q4_0+c/q4_0") == ("q4_0", "q4_0", True)
    assert study.parse_real("q5_0+c/turbo3") == ("q5_0", "turbo3", True)
    assert study.parse_real("q8_0/q4_0") == ("q8_0", "q4_0", False)
    assert study.real_name("q4_0", "q4_0", False) == "q4_0 (real)"
    assert study.real_name("q4_0", "q4_0", True) == "q4_0+c/q4_0 (real)"
    for bad in ("q4_0+c", "q4_0/q4_0+c", "q4_0+s/q4_0", "lm4+c/q4_0"):
        with pytest.raises(ValueError):
            study.parse_real(bad)
    with pytest.raises(UnknownCacheType):
        study.parse_real("q3_0+c/q4_0")


def test_study_runs_a_centered_real_type(model_path, tmp_path):
    rc = study.main(["--model", str(model_path), "--ctx", "128", "--chunks", "2", "--threads", "2",
                     "--real", "q4_0,q4_0+c/q4_0,q8_0+c/q4_0", "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    plain, cen, mixed = rows["q4_0 (real)"], rows["q4_0+c/q4_0 (real)"], rows["q8_0+c/q4_0 (real)"]
    assert plain["bits"] == cen["bits"] == 4.5 and mixed["bits"] == 6.5
    assert cen["centered"] and not plain["centered"]
    assert all(r["tokens"] == plain["tokens"] > 0 and np.isfinite(r["kl_f16"]) and r["kl_f16"] > 0
               for r in (plain, cen, mixed))
    # the real kernels quantized other keys: centered q4_0 is not plain q4_0
    assert cen["token_kl_f16"] != plain["token_kl_f16"]
    # read against real q4_0 over the same positions: its own ratio is 1, each interval holds its ratio
    assert plain["kl_ratio"] == 1.0
    for r in (cen, mixed):
        assert r["kl_ratio"] == pytest.approx(r["kl_f16"] / plain["kl_f16"])
        assert r["kl_ratio_ci"][0] <= r["kl_ratio"] <= r["kl_ratio_ci"][1]
        assert r["dppl_rel_ci"][0] <= r["dppl_rel"] <= r["dppl_rel_ci"][1]
    assert study.main(["--model", str(model_path), "--real", "q4_0+c/lm4"]) == 2


def test_kv_center_writes_the_studys_own_center(model_path, tmp_path):
    """`clickpaca kv-center` with a run's --ctx/--chunks is that run's calibration to every bit:
    the study with --center FILE gives its centered row exactly as with its own calibration."""
    from clickpaca.llama import kvcenter
    from clickpaca.measure.kvsim.center import make_center

    path = tmp_path / "c.npz"
    make_center(str(model_path), None, 128, 2, 2).save(path)
    args = ["--model", str(model_path), "--ctx", "128", "--chunks", "2", "--threads", "2",
            "--real", "q4_0,q4_0+c/q4_0", "--out", str(tmp_path)]
    assert study.main(args + ["--name", "own"]) == 0
    assert study.main(args + ["--name", "file", "--center", str(path)]) == 0
    own, got = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("own", "file"))
    assert got["center"] == str(path) and own["center"] is None
    rows = [{r["name"]: r for r in out["rows"]}["q4_0+c/q4_0 (real)"] for out in (own, got)]
    assert rows[0]["token_kl_f16"] == rows[1]["token_kl_f16"] and rows[0]["ppl"] == rows[1]["ppl"]
    assert kvcenter.read(path).meta["tokens"] == 128
