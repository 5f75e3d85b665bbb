"""`patch` through the real server (engine/patches.py, activations/patching.py), on the
activations build in deterministic mode: a sequence patched with its own rows is unchanged,
every position of a layer patched with another prompt's rows gives that prompt's next-token
distribution, a sequence without a patch beside patched ones is its run alone, bit for bit;
bad patches are refused naming the field."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from clickpaca.activations import capture as C
from clickpaca.wire.client import ServerError
from conftest import spawn_server

pytestmark = [pytest.mark.model, pytest.mark.activations]

A = "The Eiffel Tower is located in the city of"
B = "The Colosseum is located in the city of"  # as many tokens as A
PLAIN = "Seven hungry ravens argued over"
LAST = "l_out-17"


@pytest.fixture(scope="module")
def det():
    c = spawn_server(nCtx=2048, nSeqMax=6, deterministic=True, build="activations",
                     cacheTypeK="f16", cacheTypeV="f16")
    yield c
    c.close()


def rows(ev: dict, node: str) -> np.ndarray:
    ref = ev["capture"]["nodes"][node]
    return np.load(ref["file"]) if "file" in ref else C.decode(ref)


def prefill_rows(c, seq_id: int, prompt: str, nodes: list[str], **kw) -> dict:
    """The prompt's rows of `nodes` at every position (a prefill's capture), then freed."""
    ev = c.request({"type": "prefill", "seq_id": seq_id, "prompt": prompt, "capture": nodes,
                    "captureTokens": "all", **kw})
    assert ev["type"] == "prefilled", ev
    c.request({"type": "free", "seq_id": seq_id})
    return ev


def run(c, seq_id: int, prompt: str, **kw) -> tuple[list, list, dict]:
    c.infer(seq_id, prompt, temperature=0, nProbs=5, **kw)
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return [t["token"] for t in toks], [(t["logprob"], t.get("top")) for t in toks], done


def entry(node: str, positions: list[int], source, mode: str = "replace") -> dict:
    return {"node": node, "positions": positions, "source": source, "mode": mode}


def test_its_own_rows_change_no_bit(det):
    """Patched at every prompt position with its own captured rows (inline l_out-6, and the
    logits from the .npy file the capture wrote): tokens and log-probabilities `==` the run
    without a patch."""
    ev = prefill_rows(det, 0, A, ["l_out-6", "result_output"])
    n = ev["tokens"]
    assert "file" in ev["capture"]["nodes"]["result_output"]  # large: written as .npy
    plain = run(det, 0, A, maxTokens=6)
    patched = run(det, 0, A, maxTokens=6, patch=[
        entry("l_out-6", list(range(n)), ev["capture"]["nodes"]["l_out-6"]),
        entry("result_output", list(range(n)), ev["capture"]["nodes"]["result_output"]["file"])])
    assert patched[0] == plain[0] and patched[1] == plain[1]


@pytest.mark.parametrize("node", [LAST, "l_out-8"])
def test_another_prompts_layer_gives_its_next_token_distribution(det, node):
    """Every position of `node` replaced by B's rows: the next token and the top 5 with their
    log-probabilities `==` B's own run (the last layer, and a middle one whose later layers
    all read the written rows); A's own differ."""
    ev = prefill_rows(det, 1, B, [node])
    n = ev["tokens"]
    b = run(det, 1, B, maxTokens=1)
    a = run(det, 0, A, maxTokens=1)
    got = run(det, 0, A, maxTokens=1, patch=[entry(node, list(range(n)), ev["capture"]["nodes"][node])])
    assert got[2]["tokens_prompt"] == n
    assert got[0] == b[0] and got[1] == b[1]
    assert a[1] != b[1]


def test_a_plain_sequence_beside_patched_ones_is_its_run_alone(det):
    """One sequence without `patch` decoded with three patched ones (noise added at l_out-4,
    the embeddings replaced, l_out-10 replaced by B's): its tokens and log-probabilities `==`
    its run alone; the patched ones moved."""
    alone = run(det, 4, PLAIN, maxTokens=8)
    base = run(det, 0, A, maxTokens=8)
    ev = prefill_rows(det, 1, B, ["l_out-10", "inp_scaled"])
    n = ev["tokens"]
    rng = np.random.default_rng(3)
    noise = C.encode(rng.normal(scale=50.0, size=(3, 640)).astype(np.float32), "float32")
    patches = [[entry("l_out-4", [1, 2, 3], noise, "add")],
               [entry("inp_scaled", list(range(n)), ev["capture"]["nodes"]["inp_scaled"])],
               [entry("l_out-10", list(range(n)), ev["capture"]["nodes"]["l_out-10"])]]
    for i, p in enumerate(patches):
        det.infer(i, A, temperature=0, nProbs=5, maxTokens=8, patch=p)
    det.infer(4, PLAIN, temperature=0, nProbs=5, maxTokens=8)
    out = [det.collect(i) for i in (0, 1, 2, 4)]
    for toks, done in out:
        assert done["type"] == "done", done
    plain = out[3][0]
    assert [t["token"] for t in plain] == alone[0]
    assert [(t["logprob"], t.get("top")) for t in plain] == alone[1]
    for toks, _ in out[:3]:
        assert [(t["logprob"], t.get("top")) for t in toks] != base[1]


def test_score_and_prefill_take_a_patch(det):
    """A score patched with its own rows gives its NLLs `==` unpatched, and with B's l_out-8
    other ones; a prefill patched with B's l_out-8 captures B's l_out-12 (the capture reads
    the same decode's later nodes); a score over several windows is refused."""
    own = prefill_rows(det, 0, A, ["l_out-8"])
    other = prefill_rows(det, 1, B, ["l_out-8"])
    n = own["tokens"]
    every = list(range(n))
    plain = det.score(0, A, perToken=True)
    same = det.score(0, A, perToken=True, patch=[entry("l_out-8", every, own["capture"]["nodes"]["l_out-8"])])
    moved = det.score(0, A, perToken=True, patch=[entry("l_out-8", every, other["capture"]["nodes"]["l_out-8"])])
    assert same["token_nll"] == plain["token_nll"] and moved["token_nll"] != plain["token_nll"]
    b12 = prefill_rows(det, 1, B, ["l_out-12"])
    ev = prefill_rows(det, 2, A, ["l_out-12"], patch=[entry("l_out-8", every, other["capture"]["nodes"]["l_out-8"])])
    assert np.array_equal(rows(ev, "l_out-12"), rows(b12, "l_out-12"))  # layers 9-12 read B's rows
    with pytest.raises(ServerError, match="patch: the text is scored in 2 windows"):
        det.score(3, A + " Paris. " + B, window=8, patch=[entry("l_out-8", [1], C.encode(
            np.zeros((1, 640), np.float32), "float32"))])


def _refused(c, match: str, **req) -> str:
    with pytest.raises(ServerError) as e:
        c.request({"type": "infer", "seq_id": 5, "prompt": A, "maxTokens": 1, **req})
    assert match in str(e.value), str(e.value)
    return str(e.value)


def test_bad_patches_are_refused_naming_the_field(det):
    row = C.encode(np.zeros((1, 640), np.float32), "float32")
    msg = _refused(det, "patch: [0].node", patch=[entry("Qcur-3", [1], row)])
    assert "nodes that can be patched" in msg and "l_out-{0..17}" in msg
    _refused(det, "not in this model's graph", patch=[entry("l_out-99", [1], row)])
    _refused(det, "patch: [0].source: 1 rows for 2 positions", patch=[entry("l_out-3", [1, 2], row)])
    bad = C.encode(np.zeros((1, 600), np.float32), "float32")
    _refused(det, "patch: [0].source: shape [1, 600] does not match", patch=[entry("l_out-3", [1], bad)])
    _refused(det, "patch: [0].positions: [400] outside", patch=[entry("l_out-3", [400], row)])
    _refused(det, "patch: [0].positions: position -1 is negative", patch=[entry("l_out-3", [-1], row)])
    nan = np.zeros((1, 640), np.float32)
    nan[0, 7] = np.nan
    _refused(det, "patch: [0].source: values must be finite",
             patch=[entry("l_out-3", [1], {"dtype": "float32", "shape": [1, 640],
                                           "data": base64.b64encode(nan.tobytes()).decode()})])
    _refused(det, "patch: [0].mode", patch=[entry("l_out-3", [1], row, "multiply")])
    _refused(det, "not in this client's namespace", patch=[entry("l_out-3", [1], "/etc/passwd")])
    _refused(det, "no state file named", patch=[entry("l_out-3", [1], "absent.npy")])
    assert run(det, 5, A, maxTokens=1)[2]["type"] == "done"  # still serving


def test_mainline_refuses_patch_naming_the_build_that_has_it():
    c = spawn_server(nCtx=512, nSeqMax=2, build="mainline")
    try:
        row = C.encode(np.zeros((1, 640), np.float32), "float32")
        with pytest.raises(ServerError) as e:
            c.request({"type": "prefill", "seq_id": 0, "prompt": A, "patch": [entry("l_out-3", [1], row)]})
        msg = str(e.value)
        assert msg.startswith("patch: ") and "llama_set_eval_callback" in msg and "'activations'" in msg, msg
    finally:
        c.close()
