"""A failure while serving one sequence ends that sequence alone.

Each stage at which a tick serves one sequence (engine/faults.py STAGES), those of the
batch-wide steps among them (the capture's arm and take, the pre-selection's orders and
reads, the masks, the sampling), is made to fail for one seq_id through the engine's
test hook (CLICKPACA_FAIL_AT), in a real server with the real model, while other
sequences run in the same ticks: the failing one ends with exactly one `error` naming
the stage, every other one with its `done`, and the others' tokens keep coming after
the failure. A stage that fails after it has done part of its work (faults.POINTS: a
token event sent, the grammar advanced, a capture file half written) ends its request
the same way, in deterministic mode, beside neighbours whose tokens are those of their
run without it, and leaves no file of it in the state directory. A tick that cannot go
on at all ends every request in it with an error. Also a capture file that cannot be
written (its directory gone) ends only its own request.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import orjson

import pytest

from clickpaca.engine.faults import ENV, POINTS, STAGES
from clickpaca.wire.client import Client
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

pytestmark = pytest.mark.model

END = {"done", "error", "scored", "prefilled"}
PROMPT = "The capital of France is"


def spawn(env: dict, state_dir: str | None = None, **init) -> Client:
    c = Client.spawn(env=env)
    c.init(**{"nCtx": 2048, "nSeqMax": 16, "nBatch": 256, "build": TEST_BUILD, "cacheTypeK": TEST_CACHE_K,
              "cacheTypeV": TEST_CACHE_V, "capture": True,
              "stateDir": state_dir or tempfile.mkdtemp(prefix="clkp-state-"), **init})
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
#: a capture or a large capture to be reached; `order` and `read` a server with preselect)
FAILING = {stage: 1 + i for i, stage in enumerate(STAGES)}
HEALTHY_IDS = [0, 14, 15]
PRESELECT_ONLY = ("order", "read")
#: (build, preselect) of the servers each test runs on: the test build with the capture's
#: callback given at creation, on both sampling paths, and the activations build, whose
#: callback is set for the capturing decodes only (engine/readout.py)
SERVERS = [pytest.param(TEST_BUILD, False, id="host"), pytest.param(TEST_BUILD, True, id="preselect"),
           pytest.param("activations", False, id="activations", marks=pytest.mark.activations)]


def request_for(stage: str, sid: int) -> dict:
    req = {"type": "infer", "seq_id": sid, "prompt": PROMPT, "maxTokens": 4, "temperature": 0}
    if stage == "mask":
        req["grammar_id"] = "yn"
    if stage in ("readout", "arm", "take"):
        req["capture"] = ["l_out-6"]
    if stage == "capture":  # two rows of logits: 2 MiB, above the inline limit: a file
        req.update(capture=["result_output"], maxTokens=2)
    if stage in ("sampling", "order", "read"):
        req.update(temperature=0.8, seed=7)
    return req


@pytest.mark.parametrize("build, preselect", SERVERS)
def test_each_stage_fails_only_its_own_sequence(build, preselect):
    failing = {stage: sid for stage, sid in FAILING.items() if preselect or stage not in PRESELECT_ONLY}
    spec = ",".join(f"{stage}:{sid}" for stage, sid in failing.items())
    c = spawn({ENV: spec}, preselect=preselect, build=build)
    try:
        c.grammar("yn", 'root ::= ("yes" | "no" | " ")+')
        lines = [
            # healthy ones beside the failing ones, in the same ticks: greedy, sampled with
            # a grammar and a capture (so the masks and readout of a tick are shared)
            {"type": "infer", "seq_id": 0, "prompt": PROMPT, "maxTokens": 24, "temperature": 0},
            {"type": "infer", "seq_id": 14, "prompt": PROMPT, "maxTokens": 24, "temperature": 0.8,
             "seed": 3, "grammar_id": "yn", "capture": ["l_out-6"]},
            {"type": "score", "seq_id": 15, "text": "Paris is the capital of France. " * 6},
        ] + [request_for(stage, sid) for stage, sid in failing.items()]
        c.send_raw(b"".join(orjson.dumps(r) + b"\n" for r in lines))
        events = wait_ends(c, HEALTHY_IDS + list(failing.values()))
        ends = ends_by_seq(events)
        for stage, sid in failing.items():
            got = ends.get(sid, [])
            assert len(got) == 1, (stage, got)
            assert got[0]["type"] == "error" and got[0]["message"].startswith(f"{stage}:"), (stage, got)
            assert got[0]["request"] == "infer", got
        for sid in HEALTHY_IDS:
            assert [e["type"] for e in ends[sid]] in (["done"], ["scored"]), ends[sid]
        assert len([t for t in events if t.get("seq_id") == 0 and t["type"] == "token"]) == 24
        # the others went on after each failure: seq 0's last token came after every error
        last_token_0 = max(i for i, e in enumerate(events) if e.get("seq_id") == 0 and e["type"] == "token")
        for sid in failing.values():
            err = next(i for i, e in enumerate(events) if e.get("seq_id") == sid and e["type"] == "error")
            assert err < last_token_0, (sid, events[err])
        # and the server serves as before: a failing seq_id's slot is free again
        c.infer(0, PROMPT, maxTokens=3, temperature=0)
        toks, done = c.collect(0)
        assert done["type"] == "done" and len(toks) == 3
    finally:
        c.close()


#: the neighbours of the partial failures: greedy, sampled under the grammar the failing
#: ones share, and with a capture (inline) and a score
NEIGHBOURS = {
    0: {"prompt": PROMPT, "maxTokens": 20, "temperature": 0},
    1: {"prompt": PROMPT, "maxTokens": 20, "temperature": 0.8, "seed": 3, "grammar_id": "yn"},
    2: {"prompt": "Once upon a time", "maxTokens": 20, "temperature": 0.8, "seed": 5, "capture": ["l_out-6"]},
}
LONG = "Paris is the capital of France. " * 70  # some 490 tokens: l_out rows above the inline limit
#: seq_id -> (CLICKPACA_FAIL_AT entry, its request, the stage its error names, the token
#: events it has sent before it)
PARTIAL = {
    4: ("accept:4:sent@1", {"prompt": PROMPT, "maxTokens": 8, "temperature": 0}, "accept", 1),
    5: ("accept:5:consumed@1", {"prompt": PROMPT, "maxTokens": 8, "temperature": 0.8, "seed": 3,
                              "grammar_id": "yn"}, "accept", 0),
    6: ("capture:6:opened", {"prompt": PROMPT, "maxTokens": 2, "temperature": 0,
                             "capture": ["result_output"]}, "capture", 2),
    # two files: the first written whole, the second fails half written; neither stays
    7: ("capture:7:opened@2", {"prompt": LONG, "maxTokens": 1, "temperature": 0, "captureTokens": "all",
                               "captureDtype": "float32", "capture": ["l_out-5", "l_out-6"]}, "capture", 1),
    # the batch-wide steps, each failing for this one sequence at its second tick (the
    # first: its prompt's, alone in deterministic mode), beside the neighbours
    8: ("arm:8@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0, "capture": ["l_out-6"]}, "arm", 1),
    9: ("take:9@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0, "capture": ["l_out-6"]}, "take", 1),
    10: ("order:10@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0.8, "seed": 7}, "order", 1),
    11: ("read:11@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0.8, "seed": 7}, "read", 1),
    12: ("mask:12@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0.8, "seed": 7, "grammar_id": "yn"},
         "mask", 1),
    13: ("sampling:13@2", {"prompt": PROMPT, "maxTokens": 4, "temperature": 0.8, "seed": 7}, "sampling", 1),
}


HELD = 3  # a prefilled sequence, held while the others come and go
#: seq_ids the last part of the partial test runs on, plain infers: as many as the slots
#: beside the held one, so every slot a failing request left is taken. Their faults no
#: longer fire: those with @n have fired, capture:6 needs a capture
REUSED = [sid for sid in range(16) if sid != HELD]


def run_infers(c: Client, reqs: dict[int, dict]) -> list[dict]:
    """Send the infers in one write; every event until each has ended."""
    with c._lock:
        c.all_events.clear()
    c.send_raw(b"".join(orjson.dumps({"type": "infer", "seq_id": sid, **r}) + b"\n" for sid, r in reqs.items()))
    return wait_ends(c, list(reqs))


def tokens_of(events: list[dict], sid: int) -> list[int]:
    return [e["token"] for e in events if e.get("seq_id") == sid and e["type"] == "token"]


def test_the_partial_points_are_the_documented_ones():
    assert set(POINTS) == {("accept", "consumed"), ("accept", "sent"), ("capture", "opened")}
    assert all(entry.split(":")[0] in STAGES for entry, _, _, _ in PARTIAL.values())


@pytest.mark.parametrize("build, preselect", SERVERS)
def test_a_stage_that_fails_part_way_ends_only_its_request(tmp_path, build, preselect):
    """Deterministic mode: the neighbours' tokens with the failing requests beside them
    are those of their run without them; each failing request ends once, with an error
    naming its stage, after the token events its stage sent before it failed; nothing of
    it stays in the state directory. Then, with a sequence held all along (so the cells
    are never cleared all at once), new requests take every slot the failing ones left,
    the grammar they advanced among them, and give what they gave alone: no failed
    sequence left tokens in cells it no longer owned."""
    partial = {sid: p for sid, p in PARTIAL.items() if preselect or p[2] not in PRESELECT_ONLY}
    state = tmp_path / "state"
    state.mkdir()
    # 1,024 cells a sequence (deterministic mode: one KV stream each) for LONG's prompt
    c = spawn({ENV: ",".join(p[0] for p in partial.values())}, str(state), deterministic=True,
              preselect=preselect, build=build, nCtx=16 * 1024)
    try:
        c.grammar("yn", 'root ::= ("yes" | "no" | " ")+')
        alone = run_infers(c, NEIGHBOURS)
        # (a prompt the others share no prefix with: a reuse would copy its cells over theirs)
        c.send({"type": "prefill", "seq_id": HELD, "prompt": "Zebras graze on the savanna"})
        events = run_infers(c, {**NEIGHBOURS, **{sid: p[1] for sid, p in partial.items()}})
        assert c.wait(HELD)["type"] == "prefilled"
        ends = ends_by_seq(events)
        for sid in NEIGHBOURS:
            assert [e["type"] for e in ends[sid]] == ["done"], ends[sid]
            assert tokens_of(events, sid) == tokens_of(alone, sid), sid
            assert tokens_of(events, sid), sid
        for sid, (entry, _, stage, n_sent) in partial.items():
            assert len(ends[sid]) == 1 and ends[sid][0]["type"] == "error", (entry, ends[sid])
            assert ends[sid][0]["message"].startswith(f"{stage}: injected failure"), (entry, ends[sid])
            assert len(tokens_of(events, sid)) == n_sent, entry
        # nothing half written, nothing of a failed request: every file is a capture of a
        # `done` that names it, whole
        named = {n["file"] for e in events if e["type"] == "done" for n in e.get("capture", {}).get("nodes", {}).values()
                 if "file" in n}
        files = [p for p in state.rglob("*") if p.is_file()]
        assert {str(p) for p in files} == named, (files, named)
        for p in files:
            np.load(p)
        # the server serves as before, on every slot the failing ones left, seq 5 under the
        # grammar it advanced
        again = run_infers(c, {sid: NEIGHBOURS[1] if sid == 5 else NEIGHBOURS[0] for sid in REUSED})
        for sid in REUSED:
            assert tokens_of(again, sid) == tokens_of(alone, 1 if sid == 5 else 0), sid
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
