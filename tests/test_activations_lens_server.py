"""`lens` through the real server (engine/lensjob.py): an infer's token events and a
score's end event carry the logit lens per layer; the last layer's is the model's own
distribution; bad lens requests are refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import spawn_server

pytestmark = pytest.mark.model

PROMPT = "The capital of France is Paris, and the capital of Germany is"


@pytest.fixture(scope="module")
def srv():
    c = spawn_server(nCtx=1024, nSeqMax=4, capture=True)
    yield c
    c.close()


def test_infer_token_events_carry_every_layers_lens_and_the_last_is_the_models(srv):
    srv.infer(0, PROMPT, temperature=0, maxTokens=4, nProbs=5, lens={"layers": "all", "top": 5})
    toks, done = srv.collect(0)
    assert done["type"] == "done" and "capture" not in done and toks
    for t in toks:
        lens = t["lens"]
        assert lens["layers"] == list(range(18)) and len(lens["top"]) == len(lens["entropy"]) == 18
        last = lens["top"][-1]
        # greedy: the last layer's top token is the token; its top 5 are the model's own top 5
        assert last[0]["token"] == t["token"]
        assert [x["token"] for x in last] == [x["token"] for x in t["top"]]
        assert np.allclose([x["logprob"] for x in last], [x["logprob"] for x in t["top"]], atol=1e-5)
        for row in lens["top"]:
            lp = [x["logprob"] for x in row]
            assert lp == sorted(lp, reverse=True) and all(x <= 0 for x in lp)
        assert all(e >= 0 for e in lens["entropy"])


def test_lens_changes_no_token_and_reads_the_same_rows_as_capture(srv):
    srv.infer(1, PROMPT, temperature=0, maxTokens=3, nProbs=3)
    plain, _ = srv.collect(1)
    srv.infer(1, PROMPT, temperature=0, maxTokens=3, nProbs=3, lens={"layers": [3, -1], "top": 2},
              capture=["l_out-3"])
    read, done = srv.collect(1)
    assert [(t["token"], t["logprob"], t["top"]) for t in read] == \
        [(t["token"], t["logprob"], t["top"]) for t in plain]
    assert read[0]["lens"]["layers"] == [3, 17] and list(done["capture"]["nodes"]) == ["l_out-3"]


def test_score_end_event_has_the_lens_of_every_position(srv):
    text = "A quiet river runs through the valley."
    ev = srv.score(2, text, perToken=True, lens={"layers": [0, 17], "top": 1})
    assert ev["type"] == "scored", ev
    lens = ev["lens"]
    n = ev["tokens"] + 1  # every token fed: the scored ones and the first
    assert lens["layers"] == [0, 17] and lens["positions"] == list(range(n))
    assert len(lens["top"]) == len(lens["entropy"]) == n and all(len(r) == 2 for r in lens["top"])
    # the last layer's best token is at least as likely as the token that came next
    assert len(ev["token_nll"]) == n - 1
    for p in range(n - 1):
        assert lens["top"][p][1][0]["logprob"] >= -ev["token_nll"][p] - 1e-4
    assert "capture" not in ev


@pytest.mark.parametrize("lens,why", [
    ({"layers": [18]}, "lens: layers: 18 is not a layer"),
    ({"layers": []}, "layers must be"),
    ({"top": 0}, "top must be"),
    ({"layer": [1]}, "unknown field 'layer'"),
    ("all", "must be an object"),
])
def test_bad_lens_is_refused_naming_the_field(srv, lens, why):
    srv.infer(3, PROMPT, maxTokens=1, lens=lens)
    ev = srv.collect(3)[1]
    assert ev["type"] == "error" and why in ev["message"], ev


def test_lens_with_another_capture_token_choice_or_jump_forward_is_refused(srv):
    srv.infer(3, PROMPT, maxTokens=1, lens={"top": 1}, capture=["l_out-1"], captureTokens="all")
    ev = srv.collect(3)[1]
    assert ev["type"] == "error" and "lens: reads the generated tokens" in ev["message"]
    srv.infer(3, PROMPT, maxTokens=1, lens={"top": 1}, jumpForward=True)
    ev = srv.collect(3)[1]
    assert ev["type"] == "error" and "jumpForward" in ev["message"]


def test_without_init_capture_the_lens_is_refused_naming_the_build_unless_it_has_a_live_callback():
    c = spawn_server(nCtx=512, nSeqMax=2)
    try:
        c.infer(0, PROMPT, maxTokens=1, lens={"top": 1})
        ev = c.collect(0)[1]
        if c.ready["capture"] == "live":  # the activations build: the callback is set per decode
            assert ev["type"] == "done"
        else:
            assert ev["type"] == "error" and ev["message"].startswith("lens: build") and "capture: true" in ev["message"]
    finally:
        c.close()
