"""clickpaca.engine.prepare with the real engine in-process: what a reader thread prepares for
any prompt, chat conversation or score text is what llama.cpp's tokenizer makes of it
(both with and without BOS), a conversation the template cannot format carries its
error for the engine to answer, nothing is prepared once the engine has shut down, and
a request no reader prepared gets the same answers (the engine does the same work
itself: prepare.work_for, one path). The work travels beside the request (a Prepared),
never in it.
"""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.wire.chat import format_messages
from clickpaca.engine.engine import Engine, Session
from clickpaca.engine.prepare import Prepared

from clickpaca.wire.protocol import validate
from conftest import TEST_BUILD

LONG = "The quick brown fox jumps over the lazy dog. " * 400


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(state_dir=str(tmp_path_factory.mktemp("state")))
    events: list[dict] = []
    eng.init(Session(send=events.append),
               validate({"type": "init", "nCtx": 1024, "nSeqMax": 2, "nBatch": 64, "nThreads": 1,
                         "build": TEST_BUILD}))
    assert events and events[-1]["type"] == "ready", events
    yield eng
    eng.shutdown()


def llama_tokens(eng: Engine, req) -> dict[bool, np.ndarray]:
    """llama.cpp's tokens of the request's prompt text (its messages formatted by the
    template), with BOS (fresh) and without (continuing a held sequence)."""
    model = eng.rt.model
    text = req.prompt if req.messages is None else \
        format_messages(model, req.chatTemplate, req.messages, req.addGenerationPrompt)
    return {c: model.tokenize(text, add_special=not c, parse_special=True) for c in (False, True)}


@pytest.mark.model
@pytest.mark.parametrize("fields", [
    {"prompt": LONG},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}],
     "chatTemplate": "gemma"},
], ids=["prompt", "messages"])
def test_long_prompts_and_conversations_are_tokenized_as_llama_cpp_does(engine, fields):
    req = validate({"type": "prefill", "seq_id": 0, **fields})
    pre = engine.prepare(req).prompt
    want = llama_tokens(engine, req)
    for continuing in (False, True):
        assert np.array_equal(pre.get(continuing), want[continuing]), continuing
    assert pre.fresh[0] == engine.rt.model.bos and len(pre.fresh) == len(pre.continuing) + 1
    if "messages" in fields:  # formatted with the template, not the raw contents
        assert engine.rt.model.detokenize(pre.continuing, special=True).startswith("<start_of_turn>user\n")


def run(eng: Engine, req, prepared: Prepared | None = None) -> list[dict]:
    """The events of one request applied in-process (with a reader's work, or none),
    ticked until nothing runs."""
    events: list[dict] = []
    session = Session(send=events.append)
    eng.handle(session, req, prepared)
    while eng.has_work():
        eng.tick()
    for seq in list(session.seqs.values()):
        eng.seqs.release(seq)
    return [{k: v for k, v in ev.items() if not k.endswith("_ms") and not k.endswith("_tps")} for ev in events]


@pytest.mark.model
@pytest.mark.parametrize("line", [
    {"type": "infer", "seq_id": 0, "prompt": "The capital of France is", "maxTokens": 4, "temperature": 0},
    {"type": "infer", "seq_id": 1, "maxTokens": 2, "temperature": 0, "chatTemplate": "gemma",
     "messages": [{"role": "user", "content": "Hi"}]},
    {"type": "prefill", "seq_id": 0, "prompt": LONG[:400]},
    {"type": "score", "seq_id": 0, "text": LONG[:300]},
    {"type": "grammar", "id": "g", "grammar": 'root ::= "a" | "b"'},
    {"type": "grammar", "id": "bad", "grammar": "root ::= ("},
    {"type": "infer", "seq_id": 0, "maxTokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
], ids=["infer", "messages", "prefill", "score", "grammar", "bad-grammar", "no-template"])
def test_a_request_no_reader_prepared_is_answered_the_same(engine, line):
    req = validate(line)
    prepared = engine.prepare(req)
    assert isinstance(prepared, Prepared)  # the reader did the work:
    assert [f for f in ("prompt", "text", "grammar") if getattr(prepared, f) is not None]
    assert run(engine, req) == run(engine, req, prepared)
    assert len(engine.seqs.free_slots) == 2


@pytest.mark.model
def test_short_prompts_are_prepared_and_bad_conversations_carry_their_error(engine):
    short = validate({"type": "infer", "seq_id": 0, "prompt": "Hello"})
    assert np.array_equal(engine.prepare(short).prompt.get(False), llama_tokens(engine, short)[False])
    # the base model has no template: the engine answers with the reason, naming messages
    bad = validate({"type": "infer", "seq_id": 0, "maxTokens": 1, "messages": [{"role": "user", "content": LONG}]})
    work = engine.prepare(bad)
    assert work.prompt is not None and work.prompt.error is not None
    events: list[dict] = []
    engine.handle(Session(send=events.append), bad, work)
    assert events[-1]["type"] == "error" and events[-1]["message"].startswith("messages:"), events
    assert len(engine.seqs.free_slots) == 2  # no slot kept by the refused request


@pytest.mark.model
def test_score_texts_are_tokenized_as_llama_cpp_does(engine):
    work = engine.prepare(validate({"type": "score", "seq_id": 0, "text": LONG}))
    model = engine.rt.model
    assert np.array_equal(work.text, model.tokenize(LONG, add_special=True, parse_special=False))


@pytest.mark.model
def test_grammars_are_compiled_by_the_reader_and_their_errors_answered_by_the_engine(engine):
    from clickpaca.grammar.grammars import CompiledGrammar, GrammarError

    good = validate({"type": "grammar", "id": "g", "grammar": 'root ::= "a"'})
    bad = validate({"type": "grammar", "id": "b", "grammar": "root ::= ("})
    good_work, bad_work = engine.prepare(good), engine.prepare(bad)
    assert isinstance(good_work.grammar, CompiledGrammar) and isinstance(bad_work.grammar, GrammarError)
    events: list[dict] = []
    session = Session(send=events.append)
    engine.handle(session, bad, bad_work)
    assert events[-1]["type"] == "error" and events[-1]["message"].startswith("grammar:"), events
    engine.handle(session, good, good_work)
    assert events[-1] == {"type": "grammar_ready", "id": "g"} and session.grammars["g"] is good_work.grammar


@pytest.mark.model
def test_nothing_is_prepared_after_shutdown(tmp_path):
    eng = Engine(state_dir=str(tmp_path))
    eng.init(Session(send=lambda ev: None),
               validate({"type": "init", "nCtx": 256, "nSeqMax": 1, "nBatch": 16, "nThreads": 1,
                         "build": TEST_BUILD}))
    assert eng.rt is not None
    eng.shutdown()
    assert eng.prepare(validate({"type": "prefill", "seq_id": 0, "prompt": LONG})) is None
