"""`capture` through the real server (engine/readout.py): the rows each request reads,
checked against the same sequence alone and against opdump's dump of the same decode,
per sequence in one batch, bit for bit where the computation is the same."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.activations import capture as C
from clickpaca.wire.client import ServerError
from clickpaca.llama.opdump import OpRecorder
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V, spawn_server

pytestmark = pytest.mark.model

A = "The old lighthouse keeper climbed the stairs"
B = "Seven hungry ravens argued over"
NODES = ["attn_norm-2", "l_out-6"]
LAST = "l_out-17"  # the last layer's output: computed only for rows with logits


def rows(ev: dict, node: str) -> np.ndarray:
    ref = ev["capture"]["nodes"][node]
    return np.load(ref["file"]) if "file" in ref else C.decode(ref)


def run(c, seq_id, prompt, **kw) -> tuple[list[dict], dict]:
    c.infer(seq_id, prompt, temperature=0, **kw)
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return toks, done


@pytest.fixture(scope="module")
def det():
    c = spawn_server(nCtx=2048, nSeqMax=4, deterministic=True, capture=True)
    yield c
    c.close()


def test_ready_says_how_capture_runs(det):
    assert det.ready["capture"] in ("live", "context")  # context: the callback given at creation


def test_rows_of_a_sequence_equal_it_alone_and_only_its_own(det):
    """Deterministic mode: two sequences decoded together each get their own rows, equal bit
    for bit to the same request alone; the other's rows differ."""
    kw = dict(maxTokens=5, capture=NODES + [LAST], captureTokens="all")
    _, alone_a = run(det, 0, A, **kw)
    _, alone_b = run(det, 1, B, **kw)
    det.infer(0, A, temperature=0, **kw)
    det.infer(1, B, temperature=0, **kw)
    _, both_a = det.collect(0)
    _, both_b = det.collect(1)
    for alone, both in ((alone_a, both_a), (alone_b, both_b)):
        assert both["capture"]["positions"] == alone["capture"]["positions"]
        n = both["tokens_prompt"] + both["tokens_predicted"] - 1  # every token fed: not the last sampled
        assert both["capture"]["positions"] == list(range(n))
        for node in NODES + [LAST]:
            got = rows(both, node)
            assert got.shape == (n, 640) and got.dtype == np.float32
            assert np.array_equal(got, rows(alone, node)), node
    assert not np.array_equal(rows(both_a, "l_out-6")[:5], rows(both_b, "l_out-6")[:5])


def test_capture_leaves_tokens_and_logprobs_bit_identical(det):
    plain, _ = run(det, 2, A, maxTokens=6, nProbs=5)
    read, done = run(det, 2, A, maxTokens=6, nProbs=5, capture=[LAST, "attn_norm-0"])
    assert [(t["token"], t["logprob"], t["top"]) for t in read] == \
        [(t["token"], t["logprob"], t["top"]) for t in plain]
    # captureTokens generated (the default): one row per sampled token, the one it was sampled from
    cap = done["capture"]
    assert cap["tokens"] == "generated" and len(cap["positions"]) == len(read) == 6
    assert cap["positions"][0] == done["tokens_prompt"] - 1


def test_score_and_prefill_capture(det):
    text = "A quiet river runs through the valley."
    plain = det.score(3, text)
    scored = det.score(3, text, capture=["l_out-6", LAST])  # all (the default), LAST asks logits rows
    assert scored["nll"] == plain["nll"] and scored["tokens"] == plain["tokens"]
    n = len(scored["capture"]["positions"])
    assert scored["capture"]["positions"] == list(range(n)) and n == plain["tokens"] + 1
    pre = det.request({"type": "prefill", "seq_id": 3, "prompt": text, "capture": ["l_out-6", LAST],
                       "captureTokens": "all"})
    assert pre["type"] == "prefilled" and pre["capture"]["positions"] == list(range(n))
    for node in ("l_out-6", LAST):  # the same tokens in one chunk: the same rows
        assert np.array_equal(rows(pre, node), rows(scored, node)), node
    det.request({"type": "free", "seq_id": 3})
    last = det.request({"type": "prefill", "seq_id": 3, "prompt": text, "capture": [LAST]})
    assert last["capture"]["tokens"] == "last" and last["capture"]["positions"] == [n - 1]
    assert np.array_equal(rows(last, LAST), rows(scored, LAST)[-1:])
    det.request({"type": "free", "seq_id": 3})


def test_bad_requests_name_the_field(det):
    for req, words in (
            ({"type": "infer", "seq_id": 0, "prompt": "x", "capture": ["l_out-99"]},
             ["capture: unknown node 'l_out-99'", "l_out-{0..17}", "attn_norm-{0..17}", "result_norm"]),
            ({"type": "score", "seq_id": 0, "text": "x y", "capture": ["l_out-1"], "captureTokens": "generated"},
             ["captureTokens: a score generates no tokens"]),
            ({"type": "prefill", "seq_id": 0, "prompt": "x", "capture": ["l_out-1"], "captureTokens": "generated"},
             ["captureTokens: a prefill generates no tokens"]),
            ({"type": "infer", "seq_id": 0, "prompt": "x", "capture": ["l_out-1"], "captureTokens": "middle"},
             ["captureTokens: must be one of last, generated, all"]),
            ({"type": "infer", "seq_id": 0, "prompt": "x", "captureDtype": "float16"},
             ["captureDtype: only applies with capture"])):
        with pytest.raises(ServerError) as e:
            det.request(req)
        msg = e.value.event["message"]
        assert all(w in msg for w in words), msg
    toks, done = run(det, 0, A, maxTokens=2)  # the sequence slot was never taken
    assert len(toks) == 2 and "capture" not in done


def test_large_captures_go_to_an_npy_file_and_rows_follow_the_tokens(det):
    """result_output is the logits row itself (1 MiB a row): two rows go to a file; each row's
    argmax is the greedy token sampled from it and its log-softmax the token's logprob."""
    toks, done = run(det, 0, A, maxTokens=2, nProbs=1, capture=["result_output"])
    ref = done["capture"]["nodes"]["result_output"]
    assert "data" not in ref and ref["file"].endswith(".npy") and ref["shape"] == [2, 262144]
    got = np.load(ref["file"])
    assert got.dtype == np.float32 and got.shape == (2, 262144)
    assert [int(r.argmax()) for r in got] == [t["token"] for t in toks]
    for r, t in zip(got, toks):
        r = r.astype(np.float64)
        lse = r.max() + np.log(np.exp(r - r.max()).sum())
        assert abs((r[t["token"]] - lse) - t["logprob"]) < 1e-4


@pytest.fixture(scope="module")
def plain_model(model_path):
    m = core.Model(model_path, build=TEST_BUILD)  # repacked, as a default-mode server loads it
    yield m
    m.close()


def test_rows_equal_opdumps_dump_of_the_same_decode(plain_model):
    """Default mode, one prefill on a fresh server against opdump's dump of the same decode
    in this process (same settings, same cells): the same computation, bit for bit."""
    m = plain_model
    c = spawn_server(nCtx=1024, nSeqMax=2, nBatch=64, capture=True, flashAttn="off")
    try:
        pre = c.request({"type": "prefill", "seq_id": 0, "prompt": A, "capture": NODES, "captureTokens": "all",
                         "captureDtype": "float32"})
        n = pre["tokens"]
        float16 = c.request({"type": "prefill", "seq_id": 1, "prompt": A, "capture": ["l_out-6"],
                             "captureTokens": "last", "captureDtype": "float16"})
    finally:
        c.close()
    rec = OpRecorder(m.nat, keep=tuple(NODES))
    ctx = core.Context(m, n_ctx=1024, n_batch=64, n_seq_max=2, flash_attn="off", type_k=TEST_CACHE_K,
                       type_v=TEST_CACHE_V, eval_callback=rec.callback)
    try:
        batch = core.Batch(m.nat, 64)
        batch.add([m.bos], 0, 0)  # the server's warm-up decode
        assert ctx.decode(batch) == 0
        ctx.seq_rm(0, -1, -1)
        batch.clear()
        toks = m.tokenize(A)
        assert len(toks) == n
        batch.add(toks, 0, 0, output_last=False)
        rec.armed = True
        assert ctx.decode(batch) == 0
    finally:
        ctx.close()
    dump = {x.name: x.data.reshape(n, -1) for x in rec.evals[0].nodes if x.name in NODES}
    for node in NODES:
        assert np.array_equal(rows(pre, node), dump[node]), node
    half = rows(float16, "l_out-6")
    assert half.dtype == np.float16 and np.array_equal(half, dump["l_out-6"][-1:].astype(np.float16))


def test_without_init_capture():
    """On a build without llama_set_eval_callback a server initialised without capture
    refuses it naming what to do (and pays no callback); on one with it capture works
    without init asking."""
    c = spawn_server(nCtx=512, nSeqMax=2)
    try:
        mode = c.ready["capture"]
        c.infer(0, A, maxTokens=1, temperature=0, capture=["l_out-3"])
        _, end = c.collect(0)
    finally:
        c.close()
    if mode is None:
        assert end["type"] == "error" and end["request"] == "infer"
        assert end["message"].startswith("capture: build ") and "lacks llama_set_eval_callback" in end["message"]
        assert "init capture: true" in end["message"]
    else:
        assert mode == "live" and end["type"] == "done" and len(end["capture"]["positions"]) == 1


def test_slots_out_of_order_split_the_batch_and_rows_stay_right(det):
    """Deterministic mode keeps one KV stream per sequence, where llama.cpp decodes slots
    that are not consecutive in batch order as several micro-batches (capture.micro_batches):
    each sequence still gets its own rows, bit for bit those of it alone."""
    kw = dict(capture=NODES + [LAST], captureTokens="all")
    _, alone_a = run(det, 0, A, maxTokens=16, **kw)  # long enough to overlap all of seq 1's
    _, alone_b = run(det, 1, B, maxTokens=4, **kw)
    det.request({"type": "prefill", "seq_id": 1, "prompt": "hold a slot"})  # the lowest slot
    det.infer(0, A, temperature=0, maxTokens=16, **kw)  # the next slot up
    det.request({"type": "free", "seq_id": 1})
    det.infer(1, B, temperature=0, maxTokens=4, **kw)  # the freed, lower slot: after seq 0 in every batch
    _, a = det.collect(0)
    _, b = det.collect(1)
    for alone, both in ((alone_a, a), (alone_b, b)):
        assert both["type"] == "done" and both["capture"]["positions"] == alone["capture"]["positions"]
        for node in NODES + [LAST]:
            assert np.array_equal(rows(both, node), rows(alone, node)), node


def test_a_cancelled_request_carries_what_it_read(det):
    det.infer(2, A, temperature=0, maxTokens=200, capture=["l_out-6"])
    seen = 0
    for ev in det.stream(2):
        if ev["type"] == "token":
            seen += 1
            if seen == 3:
                det.cancel(2)
        else:
            done = ev
    assert done["type"] == "done" and done["stop_reason"] == "cancelled"
    pos = done["capture"]["positions"]
    assert len(pos) >= 3 and pos == list(range(done["tokens_prompt"] - 1, done["tokens_prompt"] - 1 + len(pos)))
    assert rows(done, "l_out-6").shape == (len(pos), 640)


@pytest.mark.activations
def test_the_live_callback_reads_what_the_callback_given_at_creation_reads():
    """The activations build sets the eval callback only for capturing decodes
    (llama_set_eval_callback): in deterministic mode its rows, tokens and logprobs equal a
    mainline server's whose callback was given at context creation (init capture), bit for
    bit, for two sequences in one batch and a decode without capture between them."""
    out = {}
    for build, init in (("activations", {}), ("mainline", {"capture": True})):
        c = spawn_server(nCtx=1536, nSeqMax=3, deterministic=True, build=build,
                         cacheTypeK="f16", cacheTypeV="f16", **init)
        try:
            c.infer(2, A, maxTokens=3, temperature=0)  # no capture: the live callback stays unset
            c.collect(2)
            c.infer(0, A, maxTokens=4, temperature=0, nProbs=3, capture=NODES)
            c.infer(1, B, maxTokens=4, temperature=0, nProbs=3, capture=NODES)
            out[build] = (c.ready["capture"], c.collect(0), c.collect(1))
        finally:
            c.close()
    (live_mode, *live), (ctx_mode, *ctx) = out["activations"], out["mainline"]
    assert (live_mode, ctx_mode) == ("live", "context")
    for (lt, le), (ct, ce) in zip(live, ctx):
        assert le["type"] == ce["type"] == "done"
        assert [t["token"] for t in lt] == [t["token"] for t in ct]
        assert [t["logprob"] for t in lt] == [t["logprob"] for t in ct]
        for node in NODES:
            assert np.array_equal(rows(le, node), rows(ce, node)), node
