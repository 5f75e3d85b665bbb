"""Typed requests, without a model: each request type parses to its own frozen
dataclass, the field table `validate` walks (REQUESTS) is the classes' own declaration,
the engine's handlers take the class of their request type, and an error still names
the wire field (with the "did you mean" hint) in the event the client gets.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import MISSING
from pathlib import Path

import orjson
import pytest

from clickpaca.engine.handlers import HANDLERS
from clickpaca.wire.protocol import (REQUEST_TYPES, REQUESTS, CancelRequest, ForkRequest, sampler_fields,
                                     FreeRequest, GrammarRequest, InferRequest, InitRequest, LoadRequest,
                                     PrefillRequest, ProtocolError, QuitRequest, Request, SaveRequest,
                                     ScoreRequest, StatsRequest, VectorRequest, parse_line, request_type, wire, with_params)
from clickpaca.sampling import SamplerParams

CLASSES = {"init": InitRequest, "grammar": GrammarRequest, "vector": VectorRequest, "infer": InferRequest, "score": ScoreRequest,
           "cancel": CancelRequest, "free": FreeRequest, "prefill": PrefillRequest, "fork": ForkRequest,
           "save": SaveRequest, "load": LoadRequest, "quit": QuitRequest,
           "stats": StatsRequest}

LINES = {
    "init": b'{"type": "init"}',
    "grammar": b'{"type": "grammar", "id": 7, "grammar": "root ::= \\"a\\""}',
    "vector": b'{"type": "vector", "id": "v", "vector": {"1": [0.5, 1]}}',
    "infer": b'{"type": "infer", "seq_id": 3, "prompt": "Hi", "topK": 5}',
    "score": b'{"type": "score", "seq_id": 3, "text": "hello"}',
    "cancel": b'{"type": "cancel", "seq_id": 3}',
    "free": b'{"type": "free", "seq_id": 3}',
    "prefill": b'{"type": "prefill", "seq_id": 3, "prompt": "Hi"}',
    "fork": b'{"type": "fork", "seq_id": 3, "dst_seq_id": 4}',
    "save": b'{"type": "save", "seq_id": 3, "path": "a"}',
    "load": b'{"type": "load", "seq_id": 3, "path": "a"}',
    "quit": b'{"type": "quit"}',
    "stats": b'{"type": "stats"}',
}


def test_every_request_type_has_its_class():
    assert REQUEST_TYPES == CLASSES
    assert list(REQUESTS) == list(REQUEST_TYPES) == list(LINES)
    for kind, cls in CLASSES.items():
        assert cls.type == kind and issubclass(cls, Request)


@pytest.mark.parametrize("kind", sorted(LINES))
def test_each_kind_parses_to_its_frozen_dataclass(kind):
    out = parse_line(LINES[kind])
    assert type(out) is CLASSES[kind]
    assert out.type == kind
    assert out.reply_seq_id == (3 if "seq_id" in REQUESTS[kind] else -1)
    first = (dataclasses.fields(out) or [None])[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(out, first.name if first is not None else "now", None)


def test_parsed_values_and_defaults():
    """Attributes carry the wire names; a default is the class's own field default."""
    infer = parse_line(LINES["infer"])
    assert (infer.seq_id, infer.prompt, infer.maxTokens, infer.reusePrefix, infer.grammar_id) == (3, "Hi", 256, True, None)
    assert infer.params == SamplerParams(top_k=5)
    assert parse_line(LINES["grammar"]).id == "7"
    init = parse_line(b'{"type": "init", "nBatch": 64, "nSeqMax": 8, "cacheTypeK": "q8_0"}')
    assert (init.nBatch, init.nSeqMax, init.cacheTypeK, init.cacheTypeV, init.nCtx) == (64, 8, "q8_0", "f16", 8192)
    for f in dataclasses.fields(InitRequest):
        if f.name not in ("nBatch", "nSeqMax", "cacheTypeK", "given"):
            assert getattr(init, f.name) == f.default, f.name
    assert init.given == {"nBatch", "nSeqMax", "cacheTypeK"}  # what a shared server compares
    assert parse_line(LINES["quit"]) == QuitRequest(now=False)
    assert parse_line(b'{"type": "save", "seq_id": 1, "path": "p", "replace": true}') == \
        SaveRequest(seq_id=1, path="p", shared=False, replace=True)


@pytest.mark.parametrize("kind", sorted(LINES))
def test_the_field_table_is_the_dataclass(kind):
    """REQUESTS is derived from the classes: every wire field with its check and default,
    infer's sampler fields folded into params, init's `given`; nothing else (the
    engine's work on a request travels beside it: engine/prepare.Prepared)."""
    cls, spec = CLASSES[kind], REQUESTS[kind]
    on_the_wire = []
    for f in dataclasses.fields(cls):
        if "check" in f.metadata:
            assert spec[f.name] == (f.metadata["check"], f.default), f.name
            on_the_wire.append(f.name)
        elif "folds" in f.metadata:
            assert (kind, f.name, f.metadata["folds"]) == ("infer", "params", sampler_fields)
            assert f.default_factory is SamplerParams
            for name in sampler_fields():
                assert spec[name] == (with_params, MISSING), name
                on_the_wire.append(name)
        else:  # init's record of the fields the client wrote
            assert f.metadata.get("given"), f.name
            assert (kind, f.name, f.compare) == ("init", "given", False)
            assert f.name not in spec
    assert on_the_wire == list(spec)  # same fields, same order (the order errors are found in)
    required = {name for name, (_, default) in spec.items() if default is MISSING} - set(sampler_fields())
    assert required == {f.name for f in dataclasses.fields(cls) if f.default is MISSING
                        and f.default_factory is MISSING}


def test_a_field_declared_without_its_check_is_refused():
    with pytest.raises(TypeError, match="plain: declare it with wire"):
        @request_type("bogus")
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Bogus(Request):
            ok: int = wire(lambda name, v: v, 1)
            plain: int = 2
    with pytest.raises(TypeError, match="a request is a frozen dataclass"):
        @request_type("bogus")
        @dataclasses.dataclass(kw_only=True)
        class Mutable(Request):
            ok: int = wire(lambda name, v: v, 1)
    assert "bogus" not in REQUESTS and "bogus" not in REQUEST_TYPES


def test_each_handler_takes_its_request_class():
    assert set(HANDLERS) == set(REQUESTS) - {"init", "quit"}  # those two are the transport's rules
    for kind, handler in HANDLERS.items():
        assert handler.__annotations__["req"] == CLASSES[kind].__name__, kind


def test_the_protocol_imports_nothing_from_the_engine():
    """The wire types hold what the client sent; the engine's work on them (prompt
    tokens, compiled grammars) is the engine's type (engine/prepare.Prepared), so the
    edge names nothing of the engine: no import of it anywhere in wire/protocol/, at
    the top or inside a function."""
    import clickpaca.wire.protocol as protocol

    imported = []
    for path in sorted(Path(protocol.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                imported.append(base)
                if node.module is None:  # from . import x: x is a module
                    imported += [base + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                imported += [a.name for a in node.names]
    assert imported and "...sampling" in imported  # the walk sees the modules' imports
    engine = [m for m in imported if m.split(".")[-1] == "engine" or ".engine." in m + "."]
    assert not engine, engine


@pytest.mark.parametrize("line,message", [
    (b'{"type": "init", "nBatch": 0}', "nBatch: must be >= 1, got 0"),
    (b'{"type": "init", "nBatch": 8, "nSeqMax": 9}',
     "nBatch: must be >= nSeqMax (9) so every sequence gets a token each tick, got 8"),
    (b'{"type": "init", "nBatch": 64, "nUbatch": 65}', "nUbatch: must be <= nBatch (64), got 65"),
    (b'{"type": "init", "nUbatch": 0}', "nUbatch: must be >= 1, got 0"),
    (b'{"type": "infer", "seq_id": 2, "maxTokens": "many"}', 'maxTokens: must be an integer, got "many"'),
    (b'{"type": "infer", "seq_id": 2, "topP": 2}', "topP: must be in [0, 1], got 2.0"),
    (b'{"type": "score", "seq_id": 2, "text": "x", "perToken": 1}', "perToken: must be true or false, got 1"),
    (b'{"type": "infer", "seq_id": 2, "top_k": 5}', "top_k: unknown field for infer (did you mean topK?)"),
    (b'{"type": "infer", "seq_id": 2, "maxtokens": 5}',
     "maxtokens: unknown field for infer (did you mean maxTokens?)"),
    (b'{"type": "init", "nbatch": 5}', "nbatch: unknown field for init (did you mean nBatch?)"),
    (b'{"type": "prefill", "seq_id": 2}', "prompt: missing (required for prefill)"),
])
def test_the_error_event_names_the_wire_field(line, message):
    with pytest.raises(ProtocolError) as ei:
        parse_line(line)
    kind = orjson.loads(line)["type"]
    sid = orjson.loads(line).get("seq_id", -1)
    assert ei.value.event() == {"type": "error", "seq_id": sid, "message": message, "request": kind}
