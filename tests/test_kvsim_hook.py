"""measure/kvsim/hook.py in the real model: the identity changes no bit, a simulated type
changes the logits as much as the real one, calibration sees every layer's K and V."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.measure.kl import Variant, compare_variants
from clickpaca.measure.kvsim import hook as hk

pytestmark = pytest.mark.model

N = 96


def tokens(model) -> list[int]:
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 6
    return model.tokenize(text, add_special=True, parse_special=False)[:N]


def logits(model, toks, callback=None) -> np.ndarray:
    ctx = core.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=2, type_k="f16",
                       type_v="f16", n_threads=2, flash_attn="on", eval_callback=callback)
    b = core.Batch(model.nat, 64)
    out = []
    for s in range(0, len(toks), 64):
        b.clear()
        b.add(toks[s:s + 64], s, 0, output_last=False)
        b.logits[:len(toks[s:s + 64])] = 1
        assert ctx.decode(b) == 0
        out.append(ctx.logits().copy())
    ctx.close()
    return np.concatenate(out)


def test_identity_changes_no_bit_and_a_type_changes_the_logits(model):
    toks = tokens(model)
    base = logits(model, toks)
    ident = hk.FakeQuant(model.nat, "f16", "f16")
    assert np.array_equal(logits(model, toks, ident.callback), base) and ident.calls == 0
    q4 = hk.FakeQuant(model.nat, "q4_0", "q4_0")
    got = logits(model, toks, q4.callback)
    assert not q4.errors and q4.calls == 2 * model.n_layer * 2  # K and V, every layer, 2 decodes
    assert not np.array_equal(got, base)
    assert np.isfinite(got).all()


def test_layers_limit_the_rewrite_and_the_recorder_sees_every_layer(model):
    toks = tokens(model)
    one = hk.FakeQuant(model.nat, "q4_0", "f16", layers=frozenset({0}))
    logits(model, toks, one.callback)
    assert one.calls == 2 and not one.errors  # layer 0's K, in each of the 2 decodes
    rec = hk.Recorder(model.nat)
    logits(model, toks, rec.callback)
    cal = rec.calib()
    assert sorted(cal) == sorted((k, layer) for k in (False, True) for layer in range(model.n_layer))
    assert all(rec.n[key] == N for key in rec.n)
    assert all(c.mean.shape == c.rms.shape and (c.rms >= np.abs(c.mean) - 1e-5).all() for c in cal.values())


def test_a_simulated_q4_0_moves_the_distributions_as_the_real_q4_0_does(model, model_path):
    """The simulation writes ggml's q4_0 round trip (rotated as mainline does) into an f16
    cache; the real type also quantizes Q for its dot products and reads V in f32: the two
    are not the same bits, but their KL against f16 must be of one size."""
    toks = np.tile(np.asarray(tokens(model)), 2)
    variants = [Variant("f16"), Variant("q4_0 real", "q4_0", "q4_0"),
                Variant("q4_0 sim", hook=lambda nat: hk.FakeQuant(nat, "q4_0", "q4_0")),
                Variant("f16 sim", hook=lambda nat: hk.FakeQuant(nat, "f16", "f16"))]
    recs = compare_variants(str(model_path), variants, [0], toks, 128, threads=2)
    kl = {r["variant"]: r["vs"]["f16"]["kl_mean"] for r in recs[1:]}
    assert kl["f16 sim"] == 0.0
    assert 0.5 < kl["q4_0 sim"] / kl["q4_0 real"] < 2.0, kl
