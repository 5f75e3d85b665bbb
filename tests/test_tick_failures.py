"""Issue 43: a failure while serving one sequence ends that sequence alone.

Each stage at which a tick serves one sequence (engine/faults.py STAGES) is made to fail
for one seq_id through the engine's test hook (CLICKPACA_FAIL_AT), in a real server
with the real model, while other sequences run in the same ticks: the failing one ends
with exactly one `error` naming the stage, every other one with its `done`, and the
others' tokens keep coming after the failure. A tick that cannot go on at all ends
every request in it with an error. Also the issue's repro: a capture file that cannot
be written (here: its directory made read-only) ends only its own request.
"""

from __future__ import annotations

import tempfile

import orjson

import pytest

from clickpaca.engine.faults import ENV, STAGES
from clickpaca.wire.client import Client
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

pytestmark = pytest.mark.model

END = {"done", "error", "scored", "prefilled"}
PROMPT = "The capital of France is"


def spawn(env: dict, state_dir: str | None = None) -> Client:
    c = Client.spawn(env=env)
    c.init(nCtx=2048, nSeqMax=16, nBatch=256, build=TEST_BUILD, cacheTypeK=TEST_CACHE_K,
           cacheTypeV=TEST_CACHE_V, capture=True, stateDir=state_dir or tempfile.mkdtemp(prefix="clkp-state-"))
    return c


def ends_by_seq(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for ev in events:
        if ev.get("type") in END:
            out.setdefault(ev["seq_id"], []).append(ev)
    return out


def wait_ends(c: Client, seq_ids: list[int]) -> list[dict]:
    """Every event until each seq_id has ended; the whole stream, in order."""
    for sid in seq_ids:
        for _ in c.stream(sid, timeout=300):
            pass
    with c._lock:
        return list(c.all_events)


#: the failing seq_id of each stage, and what its request is (a stage needs a grammar,
#: a capture or a large capture to be reached)
FAILING = {stage: 1 + i for i, stage in enumerate(STAGES)}
HEALTHY_IDS = [0, 12, 13]


def request_for(stage: str, sid: int) -> dict:
    req = {"type": "infer", "seq_id": sid, "prompt": PROMPT, "maxTokens": 4, "temperature": 0}
    if stage == "mask":
        req["grammar_id"] = "yn"
    if stage == "readout":
        req["capture"] = ["l_out-6"]
    if stage == "capture":  # two rows of logits: 2 MiB, above the inline limit: a file
        req.update(capture=["result_output"], maxTokens=2)
    if stage == "sampling":
        req.update(temperature=0.8, seed=7)
    return req


def test_each_stage_fails_only_its_own_sequence():
    spec = ",".join(f"{stage}:{sid}" for stage, sid in FAILING.items())
    c = spawn({ENV: spec})
    try:
        c.grammar("yn", 'root ::= ("yes" | "no" | " ")+')
        lines = [
            # healthy ones beside the failing ones, in the same ticks: greedy, sampled with
            # a grammar and a capture (so the masks and readout of a tick are shared)
            {"type": "infer", "seq_id": 0, "prompt": PROMPT, "maxTokens": 24, "temperature": 0},
            {"type": "infer", "seq_id": 12, "prompt": PROMPT, "maxTokens": 24, "temperature": 0.8,
             "seed": 3, "grammar_id": "yn", "capture": ["l_out-6"]},
            {"type": "score", "seq_id": 13, "text": "Paris is the capital of France. " * 6},
        ] + [request_for(stage, sid) for stage, sid in FAILING.items()]
        c.send_raw(b"".join(orjson.dumps(r) + b"\n" for r in lines))
        events = wait_ends(c, HEALTHY_IDS + list(FAILING.values()))
        ends = ends_by_seq(events)
        for stage, sid in FAILING.items():
            got = ends.get(sid, [])
            assert len(got) == 1, (stage, got)
            assert got[0]["type"] == "error" and got[0]["message"].startswith(f"{stage}:"), (stage, got)
            assert got[0]["request"] == "infer", got
        for sid in HEALTHY_IDS:
            assert [e["type"] for e in ends[sid]] in (["done"], ["scored"]), ends[sid]
        assert len([t for t in events if t.get("seq_id") == 0 and t["type"] == "token"]) == 24
        # the others went on after each failure: seq 0's last token came after every error
        last_token_0 = max(i for i, e in enumerate(events) if e.get("seq_id") == 0 and e["type"] == "token")
        for sid in FAILING.values():
            err = next(i for i, e in enumerate(events) if e.get("seq_id") == sid and e["type"] == "error")
            assert err < last_token_0, (sid, events[err])
        # and the server serves as before: a failing seq_id's slot is free again
        c.infer(14, PROMPT, maxTokens=3, temperature=0)
        toks, done = c.collect(14)
        assert done["type"] == "done" and len(toks) == 3
    finally:
        c.close()


def test_a_capture_file_that_cannot_be_written_ends_only_its_request(tmp_path):
    """The issue's repro, by a failure a request can meet: the capture's file cannot be
    created (the state directory's path is a regular file now); the infer beside it
    finishes."""
    state = tmp_path / "state"
    state.mkdir()
    c = spawn({}, str(state))
    try:
        state.rename(tmp_path / "moved")
        state.write_bytes(b"not a directory")
        c.infer(1, PROMPT, maxTokens=40, temperature=0)
        c.infer(0, PROMPT, maxTokens=2, temperature=0, capture=["result_output"])
        events = wait_ends(c, [0, 1])
        ends = ends_by_seq(events)
        assert [e["type"] for e in ends[0]] == ["error"], ends[0]
        assert ends[0][0]["message"].startswith("capture:"), ends[0]
        assert [e["type"] for e in ends[1]] == ["done"] and ends[1][0]["tokens_predicted"] == 40
    finally:
        c.close()


def test_a_tick_that_cannot_go_on_ends_every_request_in_it():
    """The decode itself raising is not any one sequence's: every request in the tick
    ends with one error, and the server goes on serving."""
    c = spawn({ENV: "decode:5"})
    try:
        c.infer(4, PROMPT, maxTokens=30, temperature=0)
        c.infer(3, PROMPT, maxTokens=30, temperature=0)
        c.infer(5, PROMPT, maxTokens=30, temperature=0)
        events = wait_ends(c, [3, 4, 5])
        ends = ends_by_seq(events)
        for sid in (3, 4, 5):
            assert len(ends[sid]) == 1, ends[sid]
        assert ends[5][0]["type"] == "error" and "internal error during a tick" in ends[5][0]["message"]
        c.infer(6, PROMPT, maxTokens=2, temperature=0)
        toks, done = c.collect(6)
        assert done["type"] == "done" and len(toks) == 2
    finally:
        c.close()
