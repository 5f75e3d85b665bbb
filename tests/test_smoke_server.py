"""`make check`'s one real-server test: a real `clickpaca serve` process on the default
model runs three differently steered sequences in one batch (greedy, a JSON schema, a
banned token), and each ends in exactly one `done`. The whole protocol is tested in
tests/test_server*.py; this is the end-to-end path a contributor breaks first."""

from __future__ import annotations

import json

import pytest

from conftest import spawn_server

pytestmark = [pytest.mark.model, pytest.mark.smoke]

PROMPT = "The capital of France is"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}


def test_three_steered_sequences_share_one_server():
    c = spawn_server(nCtx=1024, nSeqMax=4)
    try:
        c.infer(0, PROMPT, maxTokens=8, temperature=0)
        alone, _ = c.collect(0)
        banned = alone[0]["token"]  # greedy's first choice, banned for sequence 2
        assert c.grammar("city", "%json_schema " + json.dumps(SCHEMA)) == {"type": "grammar_ready", "id": "city",
                                                                       "enforced": True, "ignored": []}
        c.infer(0, PROMPT, maxTokens=8, temperature=0)
        c.infer(1, PROMPT + " (as JSON): ", maxTokens=24, temperature=0, grammar_id="city")
        c.infer(2, PROMPT, maxTokens=8, temperature=0, logit_bias=[{"token": banned, "bias": -1e9}])
        (t0, d0), (t1, d1), (t2, d2) = (c.collect(i) for i in range(3))
        assert [d["type"] for d in (d0, d1, d2)] == ["done"] * 3, (d0, d1, d2)
        assert len(t0) == 8 and d0["stop_reason"] == "max_tokens"
        doc = json.loads("".join(t["piece"] for t in t1) + d1.get("tail", ""))
        assert set(doc) == {"city"} and isinstance(doc["city"], str)
        assert d1["stop_reason"] == "grammar"
        assert banned not in {t["token"] for t in t2} and len(t2) == 8
    finally:
        c.close()
