"""Key centering in the graph (native/kvcenter, llama/kvcenter.apply) against the study's
reference, the eval callback that subtracts the same mean from `Kcur-L` in numpy
(measure/kvsim/hook.Center): the same logits bit for bit, in f32, f16, q8_0 and q4_0
caches (mainline's rotation after the subtraction) and turbo3's. That makes the study's
centered rows (docs/KV-RESEARCH.md) the native path's numbers. A zero center and a cleared
one give upstream's bits; sizes that are not the model's are refused.

In-process on the patched build, so in make test's turboquant process (two builds cannot
share one process)."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.llama import core, kvcenter
from clickpaca.llama.models import resolve_model
from clickpaca.measure.kvsim import hook as hk
from conftest import chunked_logits

pytestmark = [pytest.mark.turboquant, pytest.mark.model]

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles, "
        "and by opposing end them. To die, to sleep; no more; and by a sleep to say we end ") * 3
N = 96


@pytest.fixture(scope="module")
def model():
    m = core.Model(resolve_model(None), build="kvcenter")
    yield m
    m.close()


@pytest.fixture(scope="module")
def toks(model) -> list[int]:
    return model.tokenize(TEXT, add_special=True, parse_special=False)


def run(model, toks, cache: str, callback=None, center=None, chunk: int = 32) -> np.ndarray:
    """Every position's logits: `cache` for K and V, prompt chunks of `chunk`; flash
    attention off for f32 (it would cast to f16), on otherwise (a quantized V needs it)."""
    ctx = core.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, type_k=cache, type_v=cache,
                       n_threads=2, flash_attn="off" if cache == "f32" else "on", eval_callback=callback)
    try:
        if center is not None:
            kvcenter.apply(ctx, center)
        return chunked_logits(ctx, model, toks, chunk)
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def calib(model, toks):
    """Mean keys from the text after the scored positions (as the study calibrates)."""
    rec = hk.Recorder(model.nat)
    run(model, toks[N:N + 64], "f16", rec.callback)
    assert not rec.errors and rec.calls == 4 * model.n_layer  # K and V of every layer, two decodes
    return rec.calib()


@pytest.fixture(scope="module")
def center(model, calib):
    return kvcenter.Center.from_means({layer: c.mean for (is_k, layer), c in calib.items() if is_k},
                                      model.n_layer)


@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0", "q4_0", "turbo3"])
def test_native_centering_is_the_callbacks_bit_for_bit(model, toks, calib, center, cache):
    plain = run(model, toks[:N], cache)
    hook = hk.Center(model.nat, calib)
    ref = run(model, toks[:N], cache, callback=hook.callback)
    assert not hook.errors and hook.calls == 3 * model.n_layer  # K of every layer, 3 decodes
    got = run(model, toks[:N], cache, center=center)
    assert not np.array_equal(ref, plain)  # centering changed the numbers: the equality below is not vacuous
    assert np.array_equal(got, ref), float(np.abs(got - ref).max())


def test_a_zero_center_and_a_cleared_one_are_upstream_bits(model, toks, center):
    plain = run(model, toks[:N], "q4_0")
    zero = kvcenter.Center(tuple(np.zeros_like(a) for a in center.layers))
    assert np.array_equal(run(model, toks[:N], "q4_0", center=zero), plain)  # k - 0 == k, bit for bit
    ctx = core.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, type_k="q4_0", type_v="q4_0",
                       n_threads=2, flash_attn="on")
    try:
        kvcenter.apply(ctx, center)
        assert ctx.k_center == center.digest
        centered = chunked_logits(ctx, model, toks[:N], 32)
        assert not np.array_equal(centered, plain)
        ctx.seq_rm(0, -1, -1)
        kvcenter.apply(ctx, None)  # the graph loses the subtraction: upstream's again
        assert ctx.k_center is None
        assert np.array_equal(chunked_logits(ctx, model, toks[:N], 32), plain)
        kvcenter.apply(ctx, center)
        ctx.seq_rm(0, -1, -1)
        assert np.array_equal(chunked_logits(ctx, model, toks[:N], 32), centered)
    finally:
        ctx.close()


def test_sizes_that_are_not_the_models_are_refused(model, center):
    ctx = core.Context(model, n_ctx=256, n_batch=64, n_seq_max=1, type_k="f16", type_v="f16", n_threads=2)
    try:
        with pytest.raises(kvcenter.CenterError, match=f"the center has {model.n_layer - 1} layers, the model {model.n_layer}"):
            kvcenter.apply(ctx, kvcenter.Center(center.layers[:-1]))
        halves = kvcenter.Center(tuple(a[:, : a.shape[1] // 2] for a in center.layers))
        with pytest.raises(kvcenter.CenterError, match="llama.cpp refused the center"):
            kvcenter.apply(ctx, halves)
        assert ctx.k_center is None
    finally:
        ctx.close()
