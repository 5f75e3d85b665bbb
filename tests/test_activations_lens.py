"""clickpaca.activations.lens: the logit lens graph on rows captured from real decodes of
both registry models (Gemma 3 and SmolLM2), held to the model's own logits bit for bit
at the last layer and to the numpy reference (lens_reference.py) at every layer."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.activations import lens as LN
from clickpaca.activations import lens_reference as R
from clickpaca.activations.capture import Capture
from clickpaca.llama import core

from conftest import TEST_BUILD

PROMPT = "The capital of France is Paris, and the capital of Germany is"


def own_head_copy(nat, src: str, dst: str) -> None:
    """A copy of the GGUF ``src`` with its own output head: `output.weight`, a copy of the
    tied `token_embd.weight` (both registry models tie theirs), written by ggml's gguf API."""
    lib, ffi = nat.lib, nat.ffi
    meta = ffi.new("struct ggml_context **")
    g = lib.gguf_init_from_file(src.encode(), ffi.new("struct gguf_init_params *", {"no_alloc": False, "ctx": meta})[0])
    out = lib.gguf_init_empty()
    lib.gguf_set_kv(out, g)
    for i in range(lib.gguf_get_n_tensors(g)):
        lib.gguf_add_tensor(out, lib.ggml_get_tensor(meta[0], lib.gguf_get_tensor_name(g, i)))
    emb = lib.ggml_get_tensor(meta[0], b"token_embd.weight")
    ctx = lib.ggml_init(ffi.new("struct ggml_init_params *", {"mem_size": lib.ggml_nbytes(emb) + 4096,
                                                              "mem_buffer": ffi.NULL, "no_alloc": False})[0])
    head = lib.ggml_dup_tensor(ctx, emb)
    lib.ggml_set_name(head, b"output.weight")
    ffi.memmove(head.data, emb.data, lib.ggml_nbytes(emb))
    lib.gguf_add_tensor(out, head)
    assert lib.gguf_write_to_file(out, dst.encode(), False)
    lib.gguf_free(out)
    lib.gguf_free(g)
    lib.ggml_free(meta[0])
    lib.ggml_free(ctx)


@pytest.fixture(scope="module", params=["gemma3-270m", "smollm2", "smollm2-own-head"])
def decoded(request, tmp_path_factory):
    """(model, lens, {layer: l_out rows of every prompt token}, the decode's logits)."""
    from clickpaca.llama.models import resolve_model
    from clickpaca.llama.native import load

    if request.param == "smollm2-own-head":
        path = tmp_path_factory.mktemp("lens") / "smollm2-own-head.gguf"
        own_head_copy(load(TEST_BUILD), str(resolve_model("smollm2")), str(path))
    else:
        path = resolve_model(request.param)
    m = core.Model(path, build=TEST_BUILD, n_gpu_layers=0)
    cap = Capture(m.nat)
    toks = m.tokenize(PROMPT)
    ctx = core.Context(m, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2,
                       eval_callback=cap.callback)
    n_layer = int(m.nat.lib.llama_model_n_layer(m.ptr))
    b = core.Batch(m.nat, 64)
    b.add(toks, 0, 0, output_all=True)
    cap.arm([f"l_out-{i}" for i in range(n_layer)], {0: list(range(len(toks)))}, b)
    assert ctx.decode(b) == 0
    got = cap.take()[0]
    logits = ctx.logits().copy()
    ctx.close()
    lens = LN.Lens(m.nat, path, n_threads=2)
    yield m, lens, {i: got[f"l_out-{i}"] for i in range(n_layer)}, logits
    lens.close()


@pytest.mark.model
def test_the_last_layer_lens_is_the_models_logits_bit_for_bit(decoded):
    m, lens, rows, logits = decoded
    last = rows[len(rows) - 1]
    assert np.array_equal(lens.logits(last), logits)
    # and what apply reports of it is the log-softmax of those logits
    got = lens.apply(last, 5)
    lp = R.log_softmax(logits.astype(np.float64))
    assert np.array_equal(got.ids[:, 0], logits.argmax(axis=1))
    assert np.abs(np.take_along_axis(lp, got.ids.astype(np.int64), 1) - got.logprobs).max() < 1e-5


@pytest.mark.model
def test_every_layer_agrees_with_the_numpy_reference(decoded):
    m, lens, rows, _ = decoded
    assert lens.tied == ("own-head" not in m.path.name)  # both registry models tie theirs; the copy has its own
    for layer, r in rows.items():
        x = r[-2:]  # the last two positions of each layer
        got = lens.apply(x, 8)
        ref, lp = R.apply(lens, x, 8)
        at = np.take_along_axis(lp, got.ids.astype(np.int64), 1)
        assert np.abs(at - got.logprobs).max() < 1e-4, layer
        assert np.abs(ref.logprobs - got.logprobs).max() < 1e-4, layer  # the same top values
        assert np.abs(ref.entropy - got.entropy).max() < 1e-4, layer


@pytest.mark.model
def test_rows_are_each_their_own_and_chunked_alike(decoded):
    _, lens, rows, _ = decoded
    x = np.concatenate(list(rows.values()))[: LN.CHUNK + 5]
    together = lens.apply(x, 4)
    alone = [lens.apply(x[i:i + 1], 4) for i in (0, LN.CHUNK, LN.CHUNK + 4)]
    for j, a in zip((0, LN.CHUNK, LN.CHUNK + 4), alone):
        assert np.array_equal(a.ids[0], together.ids[j]) and np.array_equal(a.logprobs[0], together.logprobs[j])


def test_unpack_sorts_by_value_then_id_and_forms_the_log_softmax():
    # two rows, top 3: values, ids, max logit, its probability, expected logit
    packed = np.array([[1.0, 3.0, 1.0, 7, 5, 2, 3.0, 0.5, 2.0],
                       [0.0, 0.0, 0.0, 9, 4, 6, 0.0, 0.25, 0.0]], np.float32)
    r = LN.unpack(packed, 3)
    assert r.ids.tolist() == [[5, 2, 7], [4, 6, 9]]
    lse0 = 3.0 - np.log(0.5)
    assert np.allclose(r.logprobs[0], [3 - lse0, 1 - lse0, 1 - lse0])
    assert np.allclose(r.entropy, [lse0 - 2.0, np.log(4.0)])


def test_layers_of_names_what_is_wrong():
    assert LN.layers_of("all", 3) == [0, 1, 2]
    assert LN.layers_of([2, -3], 3) == [0, 2]
    for bad, why in (([], "non-empty"), ("some", "non-empty"), ([3], "not a layer"), ([1, 1], "twice"),
                     ([True], "non-empty")):
        with pytest.raises(LN.LensError, match=why):
            LN.layers_of(bad, 3)
