"""Issue 43, "hostile clients, round three": the findings of the fuzz run over the fields
added since round two, each replayed on a real server.

(The tick's failure isolation is tests/test_tick_failures.py; two servers on one state
directory, tests/test_statedir_shared.py.)
"""

from __future__ import annotations

import random
import time

import orjson
import pytest

from clickpaca.wire.client import Client
from test_socket import start_server, stop_server

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


class Timed(Client):
    """A client that notes when each event arrived (to order two clients' events)."""

    def _decode(self, line: bytes) -> dict:
        ev = orjson.loads(line)
        ev["_t"] = time.monotonic()
        return ev


# ------------------------------------------------------------------ DRY's breakers


def test_a_dry_request_does_not_hold_up_another_client(tmp_path):
    """The issue's line (64 breakers of 40 "x", 35 s on the engine thread before) on a
    fresh server, whose first DRY request also reads and indexes the vocabulary: that
    work is done on the sender's reader thread, so a short request another client sends
    right after it is answered before the DRY request's first token; then 64 distinct
    breakers beside a running stream: both end with `done`."""
    path = tmp_path / "s.sock"
    proc = start_server(path, nCtx=2048, nSeqMax=8, nBatch=64)
    try:
        a, b = Timed.connect(path), Timed.connect(path)
        line = {"type": "infer", "seq_id": 2, "prompt": "Hello", "maxTokens": 8, "dryMultiplier": 1.0,
                "drySequenceBreakers": ["x" * 40] * 64}
        assert len(orjson.dumps(line)) > 2800
        b.send(line)
        a.infer(0, PROMPT, maxTokens=3, temperature=0)
        toks_a, done_a = a.collect(0)
        toks_b, done_b = b.collect(2)
        assert done_a["type"] == "done" and done_b["type"] == "done" and len(toks_b) == 8, done_b
        assert done_a["_t"] < toks_b[0]["_t"], "the DRY request's preparation held up the other client"

        rng = random.Random(43)
        worst = ["".join(rng.choices("etaoinshr ", k=40)) for _ in range(64)]
        a.infer(1, PROMPT, maxTokens=64, temperature=0)
        next(a.stream(1))  # streaming
        b.send({**line, "seq_id": 3, "drySequenceBreakers": worst})
        toks_a, done_a = a.collect(1)
        toks_b, done_b = b.collect(3)
        assert done_a["type"] == "done" and len(toks_a) == 63  # the first one was read above
        assert done_b["type"] == "done" and len(toks_b) == 8
        a.close()
        b.close()
    finally:
        stop_server(proc, path)
