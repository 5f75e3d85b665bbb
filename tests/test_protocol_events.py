"""The protocol's event constructors and request table, without a model.

Every event the engine sends is built by one constructor in clickpaca.wire.protocol (the
engine's modules hold no event literal); the client's end types are the protocol's; and
every request type but init and quit (the transport's rules, server.Rules) reaches a
handler through engine.handlers.HANDLERS.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import orjson

from clickpaca.wire import client, protocol
from clickpaca.engine.handlers import HANDLERS, Handlers
from clickpaca.wire.protocol import (END_EVENTS, EVENTS, REQUESTS, done_event, encode, error_event,
                                     scored_event, token_event)

ENGINE = Path(protocol.__file__).parents[2] / "engine"  # clickpaca/engine


def test_each_event_type_has_one_constructor_that_builds_it():
    assert set(EVENTS) == {"ready", "grammar_ready", "token", "done", "error", "scored",
                           "prefilled", "forked", "saved", "loaded", "freed", "stats", "vector_ready",
                           "vector_freed"}
    examples = {
        "ready": dict(nVocab=5), "grammar_ready": dict(grammar_id="g"),
        "token": dict(seq_id=1, token=2, piece="a"), "done": dict(seq_id=1, stop_reason="eos"),
        "error": dict(message="m"), "scored": dict(seq_id=1, nll=[1.0], windows=1, per_token=False),
        "prefilled": dict(seq_id=1, tokens=3, prompt_ms=1.0),
        "forked": dict(seq_id=1, dst_seq_id=2, tokens=3),
        "saved": dict(seq_id=1, path="p", n_bytes=9, tokens=3),
        "loaded": dict(seq_id=1, tokens=3), "freed": dict(seq_id=1),
        "stats": dict(ticks=3, rssBytes=1, caches={}),
        "vector_ready": dict(vector_id="v", slot=0, layers=[1], norms={"1": 1.0}, reserves=1),
        "vector_freed": dict(vector_id="v"),
    }
    for kind, make in EVENTS.items():
        ev = make(**examples[kind])
        assert ev["type"] == kind
        assert orjson.loads(encode(ev)) == ev


def test_the_client_ends_on_the_protocols_end_events():
    assert client.END_TYPES == END_EVENTS
    assert END_EVENTS == {"done", "error", "scored", "prefilled", "forked", "saved", "loaded", "freed"}
    assert not END_EVENTS & {"token", "ready", "grammar_ready"}


def test_done_has_two_shapes():
    assert done_event(3, "cancelled", request="score") == {
        "type": "done", "seq_id": 3, "stop_reason": "cancelled", "request": "score"}
    ev = done_event(3, "stop", "\n", tokens_prompt=4, tokens_predicted=2)
    assert list(ev) == ["type", "seq_id", "tokens_prompt", "tokens_predicted", "stop_reason", "stop"]


def test_token_logprobs_only_when_asked():
    assert token_event(0, 7, "x") == {"type": "token", "seq_id": 0, "token": 7, "piece": "x"}
    lp = {"logprob": -0.5, "top": [], "steered_logprob": -0.1, "steered_top": []}
    assert token_event(0, 7, "x", lp) == {"type": "token", "seq_id": 0, "token": 7, "piece": "x", **lp}


def test_forced_only_when_forced():
    """A token fed in a jump-forward chunk says so; every other leaves the field out."""
    assert "forced" not in token_event(0, 7, "x", forced=False)
    assert token_event(0, 7, "x", forced=True) == {"type": "token", "seq_id": 0, "token": 7, "piece": "x",
                                                   "forced": True}


def test_scored_mean_and_per_token():
    ev = scored_event(2, [1.0, 3.0], 1, per_token=True)
    assert ev["nll"] == 2.0 and math.isclose(ev["ppl"], math.exp(2.0)) and ev["token_nll"] == [1.0, 3.0]
    empty = scored_event(2, [], 1, per_token=False)
    assert empty["tokens"] == 0 and math.isnan(empty["nll"]) and "token_nll" not in empty


def test_error_names_its_request():
    assert error_event("m", 4, "fork") == {"type": "error", "seq_id": 4, "message": "m", "request": "fork"}
    assert error_event("m") == {"type": "error", "seq_id": -1, "message": "m"}


def test_the_engine_builds_no_event_literal():
    literal = re.compile(r"""["']type["']\s*:""")
    paths = sorted(ENGINE.glob("*.py"))
    assert len(paths) > 10, ENGINE  # the engine's modules, not an empty glob
    for path in paths:
        assert not literal.search(path.read_text()), f"{path.name} builds an event inline"


def test_every_request_but_init_and_quit_has_a_handler():
    from clickpaca.serve.server import Rules

    assert set(HANDLERS) == set(REQUESTS) - {"init", "quit"}
    assert callable(Rules.init) and callable(Rules.quit)  # the transport's rules for those two
    for kind, handler in HANDLERS.items():
        assert handler is getattr(Handlers, kind)
