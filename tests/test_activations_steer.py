"""clickpaca.activations.steer: a context-wide control vector through the bindings
(llama_set_adapter_cvec), on the real model in deterministic settings."""

from __future__ import annotations

import os

import numpy as np
import pytest

from clickpaca.llama import core, deterministic
from clickpaca.activations import cvec, steer
from clickpaca.activations.capture import Capture


def test_flat_is_llama_cpps_layout():
    d = {1: np.ones(4, np.float32), 3: np.full(4, 2, np.float32)}
    f = steer.flat(d, n_layer=5, n_embd=4, strength=0.5)
    assert f.shape == (16,)  # layers 1..4, layer 1 at offset 0
    assert np.array_equal(f.reshape(4, 4), [[.5] * 4, [0] * 4, [1] * 4, [0] * 4])
    with pytest.raises(steer.SteerError, match="layer 0"):
        steer.flat({0: np.ones(4)}, 5, 4)
    with pytest.raises(steer.SteerError, match=r"shape \[3\]"):
        steer.flat({2: np.ones(3)}, 5, 4)
    assert steer.layer_range(None, 18) == (1, 17)
    with pytest.raises(steer.SteerError, match="controlVectorLayers"):
        steer.layer_range((5, 18), 18)


@pytest.fixture(scope="module")
def setup(model_path, tmp_path_factory):
    before = os.environ.get(deterministic.TILED_ENV)
    deterministic.apply_process_settings()  # for this process's ggml, restored below
    m = core.Model(model_path, repack=False)
    rng = np.random.default_rng(7)
    dirs = {il: rng.normal(scale=20.0, size=m.n_embd).astype(np.float32) for il in range(3, 8)}
    path = cvec.write_gguf(tmp_path_factory.mktemp("cv") / "r.gguf", dirs, "gemma3")
    yield m, dirs, path
    m.close()
    # every server a later test spawns inherits this process's environment (a leak here
    # once turned the tiled matmul off for the default-mode tests that followed)
    if before is None:
        os.environ.pop(deterministic.TILED_ENV, None)
    else:
        os.environ[deterministic.TILED_ENV] = before


def _logits(ctx, model, prompts):
    ctx.clear()
    batch = core.Batch(model.nat, 64)
    for s, p in enumerate(prompts):
        batch.add(model.tokenize(p), 0, s)
    assert ctx.decode(batch) == 0
    return ctx.logits().copy()


@pytest.mark.model
def test_strength_zero_is_bit_identical_and_strength_s_changes_logits(setup):
    m, dirs, path = setup
    ctx = core.Context(m, n_ctx=256, n_batch=64, n_seq_max=2, flash_attn="off", kv_unified=False)
    prompts = ["The movie was", "Once upon a time"]
    plain = _logits(ctx, m, prompts)
    steer.apply(ctx, path, strength=0.0, layers=(3, 7))
    assert np.array_equal(_logits(ctx, m, prompts), plain)
    steer.apply(ctx, path, strength=2.0, layers=(3, 7))
    steered = _logits(ctx, m, prompts)
    assert not np.array_equal(steered, plain)
    assert np.abs(steered - plain).max() > 0.1  # a real change, not rounding
    steer.apply(ctx, dirs, strength=2.0, layers=(3, 7))  # the same directions as data
    assert np.array_equal(_logits(ctx, m, prompts), steered)
    steer.apply(ctx, path, strength=2.0, layers=(8, 12))  # outside the vector's layers: no effect
    assert np.array_equal(_logits(ctx, m, prompts), plain)
    steer.clear(ctx)
    assert np.array_equal(_logits(ctx, m, prompts), plain)
    ctx.close()


@pytest.mark.model
def test_the_direction_lands_in_l_out(setup):
    """llama.cpp adds layer il's direction just before the node l_out-il: the captured row
    moves by exactly strength * direction there."""
    m, dirs, _ = setup
    cap = Capture(m.nat)
    ctx = core.Context(m, n_ctx=256, n_batch=64, n_seq_max=1, flash_attn="off", eval_callback=cap.callback)
    batch = core.Batch(m.nat, 64)
    toks = m.tokenize("The movie was")
    rows = []
    for on in (False, True):
        if on:
            steer.apply(ctx, {3: dirs[3]}, strength=1.5, layers=(3, 3))
        ctx.clear()
        batch.clear()
        batch.add(toks, 0, 0)
        cap.arm(["ffn_post_norm-3", "l_out-3"], {0: [len(toks) - 1]}, batch)
        assert ctx.decode(batch) == 0
        rows.append(cap.take()[0])
    ctx.close()
    plain, on = rows
    assert np.array_equal(plain["ffn_post_norm-3"], on["ffn_post_norm-3"])  # upstream untouched
    delta = on["l_out-3"][0] - plain["l_out-3"][0]
    assert np.allclose(delta, 1.5 * dirs[3], rtol=1e-5, atol=1e-3)
