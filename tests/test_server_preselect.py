"""`init` preselect on the real server and default model: the sampler chains run on the
values the decode pre-selects (llama/presample/, sampling/fastpath.py) and give what
the host path gives.

Two deterministic-mode servers, one with preselect and one without, get the same seeded
requests (every chain below, with and without nProbs, a grammar's too) in one write:
the tokens are the same, and the log-probabilities (raw and steered, the token's and the top's) within
`LOGPROB_TOL` nats (the fast path's contract: sampling/fastpath.py). Every `done` of the
preselect server says which path decided its tokens (`samplingPath`), the counts adding
up; chains the graph cannot run (DRY, trace) take the host path for that reason; a
traced token says its path. Without preselect there is no samplingPath.

That the fast path keeps deterministic mode's claim (bit for bit the same whatever the
batch, the chunking, the process) is tests/test_deterministic.py, run on both paths.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from clickpaca.sampling.fastpath import PAST_K
from clickpaca.wire.client import Client
from conftest import TEST_BUILD

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
N_GEN = 16
#: the fast path's contract: log-probabilities within this many nats of the host path's
LOGPROB_TOL = 1e-5

CHAINS = {
    "greedy": dict(temperature=0),
    "default": dict(seed=1),
    "temperature only": dict(topK=0, topP=1.0, temperature=0.9, seed=2),
    "top-p only": dict(topK=0, topP=0.9, seed=3),
    "bias and penalties": dict(penaltyRepeat=1.1, penaltyFreq=0.1, penaltyPresent=0.1, seed=5,
                               logit_bias=[{"token": 1000, "bias": 5.0}, {"token": 2, "bias": -1e9}]),
    "min-p": dict(topK=0, topP=1.0, minP=0.05, seed=6),
    # a nucleus wider than the most the graph hands back (fastpath.K_MAX): every token
    # takes the host path on its whole row, read from the graph on demand
    "wide top-p": dict(topK=0, topP=0.99999, minP=0.0, seed=4),
    # the mask is made before the decode and applied in the graph
    "grammar": dict(grammar_id="words", seed=9),
}
#: chains the graph cannot run, and the reason their tokens say
HOST_ONLY = {
    "dry": (dict(dryMultiplier=0.8, seed=7), "dry"),
    "trace": (dict(trace=True, seed=8), "trace"),
}
GRAMMAR = 'root ::= [a-z ]+ "."'


def _requests() -> dict[int, tuple[str, dict]]:
    """seq_id -> (name, infer fields): each chain without and with nProbs 5, then the
    host-only ones."""
    out, s = {}, 0
    for name, kw in CHAINS.items():
        out[s] = (name, kw)
        out[s + 1] = (f"{name}, nProbs 5", {**kw, "nProbs": 5})
        s += 2
    for name, (kw, _) in HOST_ONLY.items():
        out[s] = (name, kw)
        s += 1
    return out


REQUESTS = _requests()


def _spawn(preselect: bool, n_seq: int = 24, **init) -> Client:
    c = Client.spawn()
    c.init(nCtx=128 * n_seq, nSeqMax=n_seq, build=TEST_BUILD, deterministic=True, preselect=preselect,
           stateDir=tempfile.mkdtemp(prefix="clkp-state-"), cacheTypeK="f16", cacheTypeV="f16", **init)
    assert c.grammar("words", GRAMMAR)["type"] == "grammar_ready"
    return c


def _run(c: Client) -> dict[int, tuple[list[dict], dict]]:
    """Every request in one write (they share the ticks); each one's tokens and done."""
    c.send_raw(b"".join(json.dumps({"type": "infer", "seq_id": s, "prompt": PROMPT, "maxTokens": N_GEN,
                                    **kw}).encode() + b"\n" for s, (_, kw) in REQUESTS.items()))
    out = {}
    for s in REQUESTS:
        toks, done = c.collect(s)
        assert done["type"] == "done", (REQUESTS[s][0], done)
        out[s] = (toks, done)
    return out


@pytest.fixture(scope="module")
def runs():
    """{preselect: (ready, runs)}: each server's ready event and its runs."""
    out = {}
    for pre in (False, True):
        c = _spawn(pre)
        try:
            out[pre] = (c.ready, _run(c))
        finally:
            c.close()
    return out


def test_ready_says_whether_the_decode_preselects(runs):
    assert runs[True][0]["preselect"] is True
    assert runs[False][0]["preselect"] is False


def _close(a, b, what: str, worst: dict) -> None:
    assert abs(a - b) <= LOGPROB_TOL, (what, a, b)
    worst["max"] = max(worst["max"], abs(a - b))


@pytest.mark.parametrize("seq", list(REQUESTS), ids=[n for n, _ in REQUESTS.values()])
def test_the_same_tokens_and_logprobs_on_both_paths(runs, seq):
    (host_toks, host_done), (fast_toks, fast_done) = runs[False][1][seq], runs[True][1][seq]
    assert [t["token"] for t in fast_toks] == [t["token"] for t in host_toks]
    assert fast_done["stop_reason"] == host_done["stop_reason"]
    assert fast_done["tokens_predicted"] == host_done["tokens_predicted"]
    worst = {"max": 0.0}
    for h, f in zip(host_toks, fast_toks):
        assert ("logprob" in h) == ("logprob" in f) == ("nProbs" in REQUESTS[seq][1])
        if "logprob" not in h:
            continue
        _close(f["logprob"], h["logprob"], "logprob", worst)
        _close(f["steered_logprob"], h["steered_logprob"], "steered_logprob", worst)
        for key in ("top", "steered_top"):
            assert [x["token"] for x in f[key]] == [x["token"] for x in h[key]], key
            for x, y in zip(f[key], h[key]):
                _close(x["logprob"], y["logprob"], key, worst)
    print(f"{REQUESTS[seq][0]}: max logprob difference {worst['max']:.3g}")


def test_every_done_says_which_path_decided_its_tokens(runs):
    fast = runs[True][1]
    for s, (name, _) in REQUESTS.items():
        toks, done = fast[s]
        n = done["tokens_predicted"]
        assert n == len(toks) > 0
        path = done["samplingPath"]
        assert set(path) == {"graph", "host", "reasons"}
        assert path["graph"] + path["host"] == n, (name, path)
        assert sum(path["reasons"].values()) == path["host"], (name, path)
        base = name.partition(",")[0]
        if base in HOST_ONLY:
            assert path == {"graph": 0, "host": n, "reasons": {HOST_ONLY[base][1]: n}}, (name, path)
        elif base == "greedy":
            assert path == {"graph": n, "host": 0, "reasons": {}}, (name, path)
        elif base == "wide top-p":  # its whole rows: the same tokens and bits as the host path's (above)
            assert path["reasons"].get(PAST_K, 0) > 0, (name, path)
        else:  # the graph decides (a truncation past the K best may send a few to the host)
            assert path["graph"] > 0, (name, path)


def test_a_traced_token_says_its_path(runs):
    s = next(s for s, (name, _) in REQUESTS.items() if name == "trace")
    for pre, path in ((True, "host: trace"), (False, None)):
        toks, _ = runs[pre][1][s]
        assert toks and all("trace" in t for t in toks)
        assert all(t["trace"].get("path") == path for t in toks), (pre, toks[0]["trace"])


def test_without_preselect_no_done_has_a_sampling_path(runs):
    for s, (toks, done) in runs[False][1].items():
        assert "samplingPath" not in done, (REQUESTS[s][0], done)


def test_on_the_fast_path_a_sequence_is_the_same_alone_chunked_and_in_a_new_process(runs):
    """Deterministic mode's claim for the seeded chains on the fast path: each request run
    alone (no other sequence in its batch) as sequence 0, its prompt in chunks of 4 tokens
    (nBatch 4), in a new process with 4 sequences, gives bit for bit the tokens,
    log-probabilities and paths it got in the batch of all of them
    (tests/test_deterministic.py holds greedy to it in more cases)."""
    together = runs[True][1]
    c = _spawn(True, n_seq=4, nBatch=4)
    try:
        for s, (name, kw) in REQUESTS.items():
            if name.partition(",")[0] in HOST_ONLY:
                continue
            c.infer(0, PROMPT, maxTokens=N_GEN, reusePrefix=False, **kw)  # the seed is in kw
            toks, done = c.collect(0)
            assert done["type"] == "done", done
            assert done["tokens_reused"] == 0
            assert [{**t, "seq_id": s} for t in toks] == together[s][0], name
            assert done["samplingPath"] == together[s][1]["samplingPath"], name
    finally:
        c.close()


def test_whole_rows_read_from_the_graph_on_one_kv_stream():
    """Outside deterministic mode (one KV stream), a tick of one token per sequence runs as
    one micro-batch, and a row whose values cannot decide is read from the graph's logits
    on demand (presample.Presampler.full_row) instead of every row being copied whole:
    the wide nucleus takes the host path on every token, and gives the host path's tokens
    and log-probabilities."""
    kw = {**CHAINS["wide top-p"], "nProbs": 5}
    got = {}
    for pre in (False, True):
        c = Client.spawn()
        try:
            c.init(nCtx=512, nSeqMax=2, build=TEST_BUILD, preselect=pre, stateDir=tempfile.mkdtemp(prefix="clkp-state-"))
            c.infer(0, PROMPT, maxTokens=N_GEN, **kw)
            got[pre] = c.collect(0)
        finally:
            c.close()
    (host_toks, host_done), (fast_toks, fast_done) = got[False], got[True]
    assert fast_done["type"] == "done", fast_done
    assert fast_done["samplingPath"]["reasons"].get(PAST_K, 0) > 0, fast_done["samplingPath"]
    assert [t["token"] for t in fast_toks] == [t["token"] for t in host_toks]
    worst = {"max": 0.0}
    for h, f in zip(host_toks, fast_toks):
        _close(f["logprob"], h["logprob"], "logprob", worst)
        for x, y in zip(f["top"], h["top"]):
            assert x["token"] == y["token"]
            _close(x["logprob"], y["logprob"], "top", worst)


def test_a_full_server_of_ordered_rows_fits_the_graph():
    """Every slot's sampler reports its share of the ops when llama.cpp sizes the graph,
    ordered or not: once only slot 0 did (the others have no order at context creation),
    and 64 sequences pre-selected in one decode with nBatch 2048 overflowed the graph's
    context (ggml's GGML_ASSERT(obj_new): the server died; `bench batch --seqs 64
    --preselect` found it; with nBatch 512 the same 64 rows fitted)."""
    n = 64
    c = Client.spawn()
    try:
        c.init(nCtx=n * 64, nSeqMax=n, nBatch=n * 32, build=TEST_BUILD, preselect=True,
               stateDir=tempfile.mkdtemp(prefix="clkp-state-"))
        c.send_raw(b"".join(json.dumps({"type": "infer", "seq_id": s, "prompt": PROMPT, "maxTokens": 3,
                                        "temperature": 0}).encode() + b"\n" for s in range(n)))
        for s in range(n):
            _, done = c.collect(s)
            assert done["type"] == "done" and done["samplingPath"]["graph"] == 3, done
    finally:
        c.close()
