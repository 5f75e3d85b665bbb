"""clickpaca.wire.protocol without a model: request validation, line parsing, error events.

Table-driven: every field of every request type, with values of the wrong type and out
of range, must be refused with a message that starts with the field's name. Hypothesis:
whatever arrives on a line, `parse_line` returns a request of a known type or raises
`ProtocolError`, never anything else.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clickpaca.sampling.params import protocol_names
from clickpaca.wire.protocol import (MAX_LINE_BYTES, REQUESTS, ProtocolError, Request, encode, sampler_fields,
                                     error_event, parse_line, validate)
from clickpaca.sampling import SamplerParams
from clickpaca.serve.server import read_lines

# A minimal valid body for each request type (required fields only).
MINIMAL = {
    "init": {},
    "grammar": {"id": "g", "grammar": 'root ::= "a"'},
    "vector": {"id": "v", "vector": "/tmp/v.gguf"},
    "infer": {"seq_id": 3},
    "score": {"seq_id": 3, "text": "hello"},
    "cancel": {"seq_id": 3},
    "free": {"seq_id": 3},
    "prefill": {"seq_id": 3, "prompt": "hi"},
    "fork": {"seq_id": 3, "dst_seq_id": 4},
    "save": {"seq_id": 3, "path": "/tmp/x.state"},
    "load": {"seq_id": 3, "path": "/tmp/x.state"},
    "quit": {},
    "stats": {},
}

CHAT_DEFAULTS = {"messages": None, "chatTemplate": None, "addGenerationPrompt": True}
CAPTURE_DEFAULTS = {"capture": None, "captureTokens": None, "captureDtype": "float32", "patch": None}
DEFAULTS = {
    "init": {"modelPath": None, "nGpuLayers": -1, "nCtx": 8192, "nBatch": 512, "nUbatch": None, "nSeqMax": 64,
             "cacheTypeK": "f16", "cacheTypeV": "f16", "nThreads": None, "build": None,
             "flashAttn": "auto", "swaFull": True, "kvUnified": True, "stateDir": None,
             "deterministic": False, "preselect": None, "rpcServers": None, "tensorSplit": None,
             "rpcTimeout": 120.0,
             "outputLocal": False, "capture": False,
             "controlVector": None, "controlVectorLayers": None, "controlVectorStrength": 1.0,
             "vectorSlots": 8, "kvCenter": None},
    "grammar": {"lenient": False, "numberDigits": 16, "strict": False, "validate": False},
    "vector": {},
    "infer": {"prompt": "", "maxTokens": 256, "grammar_id": None, "stop": None, "reusePrefix": True,
              "params": SamplerParams(), **CHAT_DEFAULTS, **CAPTURE_DEFAULTS,
              "controlVectorStrength": None, "steer": None, "validate": False, "jumpForward": False,
              "lens": None},
    "score": {"window": None, "perToken": False, "scoreLast": None, **CAPTURE_DEFAULTS, "lens": None, "steer": None},
    "cancel": {}, "free": {"vector": None}, "prefill": {**CHAT_DEFAULTS, **CAPTURE_DEFAULTS, "steer": None},
    "fork": {},
    "save": {"shared": False, "replace": False}, "load": {"shared": False}, "quit": {"now": False},
    "stats": {},
}


def req(kind: str, **fields) -> dict:
    return {"type": kind, **MINIMAL[kind], **fields}


def as_dict(r: Request) -> dict:
    """A typed request's type and the fields that make its equality (what the client's
    line determines; not the work prepared for the engine)."""
    return {"type": r.type, **{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.compare}}


def test_every_request_type_is_covered():
    assert set(MINIMAL) == set(REQUESTS) == set(DEFAULTS)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_defaults_filled(kind):
    out = validate(req(kind))
    assert as_dict(out) == {"type": kind, **MINIMAL[kind], **DEFAULTS[kind]}


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_validate_does_not_modify_its_input(kind):
    obj = req(kind)
    before = json.dumps(obj, sort_keys=True)
    validate(obj)
    assert json.dumps(obj, sort_keys=True) == before


def test_sampler_fields_become_one_sampler_params():
    out = validate(req("infer"))
    assert not set(sampler_fields()) & set(as_dict(out))
    assert out.params == SamplerParams()
    fields = {"temperature": 0, "topK": 1, "topP": 0.5, "minP": 0.1, "penaltyRepeat": 1.1,
              "penaltyFreq": 0.2, "penaltyPresent": 0.3, "penaltyLastN": -1,
              "logit_bias": [{"token": 5, "bias": -1e9}], "seed": 42, "nProbs": 3,
              "samplers": ["grammar", "top_k", "temperature"]}
    assert set(fields) <= set(sampler_fields()) == set(protocol_names().values())  # the registry's
    out = validate(req("infer", **fields))
    assert not set(sampler_fields()) & set(as_dict(out))
    assert out.params == SamplerParams.from_request(fields)
    echoed = out.params.to_request()
    assert {k: echoed[k] for k in fields} == {**fields, "samplers": ["grammar", "top_k", "temperature"]}
    assert validate(req("infer", dryMultiplier=0.5, mirostat=2)).params.mirostat == 2
    # a JSON null means the default, as for every optional field
    assert validate(req("infer", topK=None, seed=None)).params == SamplerParams()


@pytest.mark.parametrize("name,bad", [
    ("temperature", math.nan), ("temperature", math.inf), ("topP", 1.5), ("topK", True), ("seed", -1),
    ("nProbs", 1.5), ("samplers", "top_k"), ("samplers", ["sample", "grammar"]), ("penaltyRepeat", 0),
    ("logit_bias", [{"token": -1, "bias": 1}]), ("logit_bias", [[1, 1], [1, 2]]), ("nProbs", 101),
])
def test_bad_sampler_field_named_at_the_edge(name, bad):
    # checked together by SamplerParams, at the edge: the message names the field
    with pytest.raises(ProtocolError) as ei:
        validate(req("infer", **{name: bad}))
    e = ei.value
    assert e.message.startswith(name + ":"), e.message
    assert e.request == "infer" and e.seq_id == MINIMAL["infer"]["seq_id"]
    assert validate(req("infer", nProbs=100)).params.n_probs == 100


def test_sampler_fields_checked_after_the_others():
    with pytest.raises(ProtocolError, match="^maxTokens: "):
        validate(req("infer", maxTokens=-1, topP=1.5))


def test_init_batch_must_hold_a_token_per_sequence():
    with pytest.raises(ProtocolError) as ei:
        validate(req("init", nBatch=7, nSeqMax=8))
    assert ei.value.message == ("nBatch: must be >= nSeqMax (8) so every sequence gets a token "
                                "each tick, got 7")
    assert ei.value.request == "init" and ei.value.seq_id == -1
    assert validate(req("init", nBatch=8, nSeqMax=8)).nBatch == 8


def test_init_context_must_hold_a_cell_per_sequence():
    """nCtx < nSeqMax aborted the process inside llama.cpp (GGML_ASSERT): refused at the edge."""
    with pytest.raises(ProtocolError) as ei:
        validate(req("init", nCtx=31, nBatch=32, nSeqMax=32))
    assert ei.value.message == "nCtx: must be >= nSeqMax (32), got 31"
    assert ei.value.request == "init"
    assert validate(req("init", nCtx=32, nBatch=32, nSeqMax=32)).nCtx == 32


def test_messages_share_the_prompt_limit():
    """Messages are formatted and tokenized like a prompt: their contents have its limit."""
    half = "x" * (1 << 19)
    ok = validate(req("infer", messages=[{"role": "user", "content": half},
                                         {"role": "assistant", "content": half}]))
    assert len(ok.messages) == 2
    with pytest.raises(ProtocolError) as ei:
        validate({"type": "prefill", "seq_id": 3, "messages": [{"role": "user", "content": half},
                                                               {"role": "user", "content": half + "é"}]})
    assert ei.value.message == f"messages: {(1 << 20) + 2} bytes of content, the limit is {1 << 20}"


def test_valid_values_accepted():
    out = validate(req("init", modelPath="/m.gguf", nGpuLayers=0, nCtx=16, nBatch=1, nSeqMax=1,
                       cacheTypeK="q8_0", cacheTypeV="q4_0", nThreads=1, build="turboquant",
                       flashAttn="on", swaFull=False, kvUnified=False))
    assert out.nCtx == 16 and out.nSeqMax == 1 and out.swaFull is False
    assert validate(req("init", nCtx=1 << 24, nBatch=1 << 16, nSeqMax=256, nThreads=512)).nSeqMax == 256
    out = validate(req("infer", prompt="x", maxTokens=0, grammar_id=7, stop=["a", "bc"], reusePrefix=False))
    assert out.grammar_id == "7" and out.stop == ["a", "bc"] and out.maxTokens == 0
    assert validate(req("infer", grammar_id="g")).grammar_id == "g"
    assert validate(req("infer", stop=[])).stop == []
    assert validate(req("infer", seq_id=0)).seq_id == 0
    assert validate(req("grammar", id=5)).id == "5"
    assert validate(req("score", window=3, perToken=True)).window == 3
    assert validate(req("quit", now=True)).now is True
    # explicit nulls on optional fields mean the default
    assert validate(req("init", modelPath=None, nThreads=None, build=None)).build is None
    assert validate(req("infer", grammar_id=None, stop=None)).stop is None


@pytest.mark.parametrize("field", ["seq_id", "maxTokens", "topK", "seed", "nProbs", "mirostat"])
def test_integral_floats_are_refused_by_every_integer_field(field):
    # one rule (issue #25): the protocol's own integer fields refuse 40.0 as the
    # sampler's always did, so {"maxTokens": 40.0} and {"topK": 40.0} agree
    with pytest.raises(ProtocolError) as ei:
        validate(req("infer", **{field: 3.0}))
    assert ei.value.message.startswith(f"{field}: must be an integer"), ei.value.message
    assert validate(req("infer", **{field: 1})) is not None


# (request, field, bad value, words the message must contain)
BAD = [
    # init
    ("init", "modelPath", 5, "string"), ("init", "modelPath", "", "empty"),
    ("init", "modelPath", ["a"], "string"),
    ("init", "nGpuLayers", -2, ">= -1"), ("init", "nGpuLayers", 1e20, "integer"), ("init", "nGpuLayers", 1 << 31, "<="), ("init", "nGpuLayers", "1", "integer"),
    ("init", "nGpuLayers", 1.5, "integer"), ("init", "nGpuLayers", None, "integer"),
    ("init", "nCtx", 15, ">= 16"), ("init", "nCtx", (1 << 24) + 1, "<="), ("init", "nCtx", "4096", "integer"),
    ("init", "nBatch", 0, ">= 1"), ("init", "nBatch", (1 << 16) + 1, "<="), ("init", "nBatch", [], "integer"),
    ("init", "nUbatch", 0, ">= 1"), ("init", "nUbatch", "x", "integer"),
    ("init", "nSeqMax", 0, ">= 1"), ("init", "nSeqMax", 257, "<= 256"), ("init", "nSeqMax", {}, "integer"),
    ("init", "cacheTypeK", "", "empty"), ("init", "cacheTypeK", 16, "string"), ("init", "cacheTypeK", None, "string"),
    ("init", "cacheTypeV", "", "empty"), ("init", "cacheTypeV", False, "string"),
    ("init", "nThreads", 0, ">= 1"), ("init", "nThreads", 513, "<= 512"), ("init", "nThreads", "2", "integer"),
    ("init", "build", "", "empty"), ("init", "build", 1, "string"),
    ("init", "build", "../evil", "build name"), ("init", "build", "/tmp/evil", "build name"),
    ("init", "stateDir", "", "empty"), ("init", "stateDir", 3, "string"),
    ("init", "flashAttn", "", "empty"), ("init", "flashAttn", True, "string"), ("init", "flashAttn", None, "string"),
    ("init", "swaFull", 1, "true or false"), ("init", "swaFull", "true", "true or false"),
    ("init", "swaFull", None, "true or false"),
    ("init", "kvUnified", 0, "true or false"),
    ("init", "deterministic", 1, "true or false"), ("init", "deterministic", None, "true or false"),
    ("init", "preselect", 1, "true or false"), ("init", "preselect", "yes", "true or false"),
    ("init", "rpcServers", "127.0.0.1:50052", "list"), ("init", "rpcServers", [], "non-empty"),
    ("init", "rpcServers", ["127.0.0.1"], "host:port"), ("init", "rpcServers", ["h:70000"], "1..65535"),
    ("init", "rpcServers", [5], "host:port"), ("init", "rpcServers", ["a:1", "a:1"], "twice"),
    ("init", "rpcServers", [f"h:{i + 1}" for i in range(17)], "at most 16"),
    ("init", "tensorSplit", [], "list of 1..16 numbers"), ("init", "tensorSplit", [1, -1], ">= 0"),
    ("init", "tensorSplit", [0, 0], "> 0"), ("init", "tensorSplit", ["1"], "number"),
    ("init", "tensorSplit", 1, "list"),
    ("init", "rpcTimeout", 0, "must be in [0.1, 86400], got 0.0"), ("init", "rpcTimeout", "5", "number"), ("init", "rpcTimeout", None, "number"),
    ("init", "outputLocal", 1, "true or false"),
    ("init", "controlVector", "", "empty"), ("init", "controlVector", 3, "GGUF path"),
    ("init", "controlVector", {}, "non-empty"), ("init", "controlVector", {"0": [1.0]}, "layer 0"),
    ("init", "controlVector", {"x": [1.0]}, "not a layer number"), ("init", "controlVector", {"2": "a"}, "list of numbers"),
    ("init", "controlVector", {"2": [1.0], "3": [1.0, 2.0]}, "differ in length"),
    ("init", "controlVector", {"2": {"dtype": "int8", "shape": [1], "data": ""}}, "payload"),
    ("init", "controlVector", {"2": {"dtype": "float32", "shape": [2], "data": "AAAAAA=="}}, "does not decode"),
    ("init", "controlVectorLayers", [3], "[start, end]"), ("init", "controlVectorLayers", [4, 3], "start <= end"),
    ("init", "controlVectorLayers", [0, 3], "layer 0"),
    ("init", "controlVectorStrength", "1", "finite number"), ("init", "controlVectorStrength", 1e7, "within"),
    ("init", "kvCenter", "", "empty"), ("init", "kvCenter", 3, "string"),
    # grammar
    ("grammar", "id", 1.5, "string or an integer"), ("grammar", "id", None, "string or an integer"),
    ("grammar", "id", [], "string or an integer"), ("grammar", "id", {"a": 1}, "string or an integer"),
    ("grammar", "grammar", "", "empty"), ("grammar", "grammar", 5, "string"), ("grammar", "grammar", None, "string"),
    # infer
    ("infer", "seq_id", -1, ">= 0"), ("infer", "seq_id", "0", "integer"), ("infer", "seq_id", 0.5, "integer"),
    ("infer", "seq_id", None, "integer"), ("infer", "seq_id", [0], "integer"),
    ("infer", "seq_id", 1e20, "integer"), ("infer", "seq_id", 1 << 31, "<="),
    ("infer", "prompt", 5, "string"), ("infer", "prompt", None, "string"), ("infer", "prompt", ["a"], "string"),
    ("infer", "maxTokens", -1, ">= 0"), ("infer", "maxTokens", (1 << 24) + 1, "<="),
    ("infer", "maxTokens", "5", "integer"), ("infer", "maxTokens", 2.5, "integer"), ("infer", "maxTokens", None, "integer"),
    ("infer", "maxTokens", 1e300, "integer"), ("infer", "maxTokens", (1 << 24) + 1, "<="),
    ("infer", "grammar_id", 1.5, "string or an integer"), ("infer", "grammar_id", [], "string or an integer"),
    ("infer", "stop", "x", "list of strings"), ("infer", "stop", [1], "list of strings"),
    ("infer", "stop", [""], "empty"), ("infer", "stop", [["a"]], "list of strings"),
    ("infer", "stop", {"a": "b"}, "list of strings"), ("infer", "stop", ["a", None], "list of strings"),
    ("infer", "reusePrefix", 1, "true or false"), ("infer", "reusePrefix", None, "true or false"),
    ("infer", "controlVectorStrength", True, "finite number"), ("infer", "controlVectorStrength", -2e6, "within"),
    ("infer", "messages", [], "empty"), ("infer", "messages", "hi", "list"),
    ("infer", "chatTemplate", "", "empty"), ("infer", "chatTemplate", 3, "string"),
    ("infer", "addGenerationPrompt", 1, "true or false"),
    # score
    ("score", "seq_id", -5, ">= 0"), ("score", "text", "", "empty"), ("score", "text", 5, "string"),
    ("score", "text", None, "string"),
    ("score", "window", 1, ">= 3"), ("score", "window", 2, ">= 3"), ("score", "window", "512", "integer"), ("score", "window", (1 << 24) + 1, "<="),
    ("score", "scoreLast", 1, ">= 2"), ("score", "scoreLast", "64", "integer"), ("score", "scoreLast", (1 << 24) + 1, "<="),
    ("score", "perToken", 0, "true or false"), ("score", "perToken", "yes", "true or false"),
    # seq requests
    ("cancel", "seq_id", -1, ">= 0"), ("cancel", "seq_id", "1", "integer"),
    ("free", "seq_id", 1.25, "integer"), ("free", "seq_id", {}, "integer"),
    ("free", "vector", True, "string or an integer"), ("free", "vector", "", "1..128 characters"),
    # steering vectors (activations/wire.py)
    ("vector", "id", [1], "string or an integer"), ("vector", "vector", {}, "non-empty"),
    ("vector", "vector", {"1": [math.nan]}, "finite"),
    ("init", "vectorSlots", 0, ">= 1"), ("init", "vectorSlots", 65, "<="),
    ("infer", "steer", [], "list of 1..16"), ("infer", "steer", [{"vector": "a"}], "[0].strength: missing"),
    ("infer", "steer", [{"vector": "a", "strength": 1, "from": "later"}], "token index"),
    ("infer", "steer", [{"vector": "a", "strength": 1, "layers": "9-3"}], "a <= b"),
    ("infer", "steer", [{"vector": "a", "strength": 1, "when": {"vector": "b", "layer": 0, "above": 0}}],
     "[0].when.layer"),
    ("score", "steer", {"vector": "a"}, "list"), ("prefill", "steer", [{"vector": "a", "strength": "x"}], "finite"),
    ("prefill", "seq_id", -2, ">= 0"), ("prefill", "prompt", "", "empty"), ("prefill", "prompt", 3, "string"),
    ("prefill", "messages", {}, "list"), ("prefill", "chatTemplate", "gemma", "only applies with messages"),
    ("prefill", "addGenerationPrompt", "no", "true or false"),
    ("fork", "seq_id", "a", "integer"), ("fork", "dst_seq_id", -1, ">= 0"), ("fork", "dst_seq_id", "4", "integer"),
    ("fork", "dst_seq_id", 1e20, "integer"), ("fork", "dst_seq_id", 1 << 31, "<="),
    ("save", "path", "", "empty"), ("save", "path", 1, "string"), ("save", "seq_id", None, "integer"),
    ("load", "path", "", "empty"), ("load", "path", ["p"], "string"), ("load", "seq_id", -1, ">= 0"),
    ("save", "shared", 1, "true or false"), ("save", "replace", "yes", "true or false"),
    ("load", "shared", None, "true or false"),
    ("infer", "prompt", "x" * ((1 << 20) + 1), "limit"), ("prefill", "prompt", "é" * (1 << 19) + "x", "limit"),
    ("score", "text", "x" * ((4 << 20) + 1), "limit"), ("grammar", "grammar", "x" * ((128 << 10) + 1), "limit"),
    ("init", "nCtx", 63, ">= nSeqMax"),
    ("grammar", "lenient", 1, "true or false"), ("grammar", "lenient", True, "JSON schemas"),
    ("grammar", "numberDigits", 0, ">= 1"), ("grammar", "numberDigits", 19, "<= 18"),
    ("grammar", "numberDigits", 16, "JSON schemas"),  # the minimal grammar is GBNF
    ("grammar", "strict", True, "JSON schemas"), ("grammar", "validate", True, "JSON schemas"),
    ("grammar", "strict", "yes", "true or false"), ("infer", "validate", 1, "true or false"), ("infer", "jumpForward", "yes", "true or false"),
    ("infer", "validate", True, "give grammar_id"),
    ("infer", "messages", [{"role": "user", "content": "x" * ((1 << 20) + 1)}], "limit"),
    # activation capture (docs/ACTIVATIONS.md); the names are checked against the model's graph later
    ("init", "capture", 1, "true or false"),
    *[(k, f, v, w) for k in ("infer", "score", "prefill") for f, v, w in (
        ("capture", "l_out-1", "list of strings"), ("capture", [], "at least one"),
        ("capture", [""], "must not be empty"), ("capture", [f"n{i}" for i in range(65)], "limit"),
        ("captureTokens", "first", "must be one of last, generated, all"),
        ("captureTokens", "all", "only applies with capture"),
        ("captureDtype", "int8", "must be one of float32, float16"),
        ("captureDtype", "float16", "only applies with capture"))],
    # activation patching (activations/patch_wire.py); nodes, files and positions are checked later
    *[(k, "patch", v, w) for k in ("infer", "score", "prefill") for v, w in (
        ([], "non-empty list"), ({"node": "l_out-1"}, "non-empty list"), ([1], "must be an object"),
        ([{"node": "l_out-1", "positions": [0]}], "patch: [0].source: required"),
        ([{"node": "l_out-1", "positions": [0], "source": "x.npy", "scale": 2}], "unknown field 'scale'"),
        ([{"node": "l_out-1", "positions": [0, 0], "source": "x.npy"}], "given twice"),
        ([{"node": "l_out-1", "positions": [True], "source": "x.npy"}], "integers"),
        ([{"node": "l_out-1", "positions": [0], "source": "x.npy", "mode": "mul"}], "patch: [0].mode"),
        ([{"node": "l_out-1", "positions": [0], "source": {"dtype": "float32", "shape": [2, 2],
                                                             "data": "AAAAAAAAAAAAAAAAAAAAAA=="}}],
         "2 rows for 1 positions"),
        ([{"node": "l_out-1", "positions": [0], "source": {"dtype": "float32", "shape": [1, 2],
                                                             "data": "AADAfwAAAAA="}}], "finite"),
        ([{"node": "l_out-1", "positions": [0], "source": {"dtype": "int8", "shape": [1], "data": ""}}],
         "capture payload"),
        ([{"node": "", "positions": [0], "source": "x.npy"}], "patch: [0].node"))],
    # the logit lens (docs/ACTIVATIONS.md); its layers are checked against the model later
    *[(k, "lens", v, w) for k in ("infer", "score") for v, w in (
        ("all", "must be an object"), ({"layers": []}, "non-empty list"), ({"layers": [True]}, "non-empty list"),
        ({"top": 0}, "top must be"), ({"top": 65}, "top must be"), ({"layer": [1]}, "unknown field 'layer'"))],
    # quit
    ("quit", "now", 1, "true or false"), ("quit", "now", "true", "true or false"), ("quit", "now", None, "true or false"),
]


@pytest.mark.parametrize("kind,field,value,words", BAD, ids=[f"{k}.{f}={v!r}"[:60] for k, f, v, _ in BAD])
def test_bad_field_named(kind, field, value, words):
    with pytest.raises(ProtocolError) as ei:
        validate(req(kind, **{field: value}))
    e = ei.value
    assert e.message.startswith(field + ":"), e.message
    assert words in e.message, e.message
    assert e.request == kind
    # the error is answered on the request's sequence when its seq_id is an integer
    own = MINIMAL[kind].get("seq_id", -1)
    int_sid = isinstance(value, int) and not isinstance(value, bool)
    assert e.seq_id == (own if field != "seq_id" else value if int_sid else -1), (e.seq_id, value)
    ev = e.event()
    assert ev["type"] == "error" and ev["message"] == e.message and ev["request"] == kind
    encode(ev)  # always encodable


def test_every_field_has_a_bad_case():
    covered = {(k, f) for k, f, _, _ in BAD}
    for kind, spec in REQUESTS.items():
        for name in spec:
            if name in sampler_fields():
                continue
            assert (kind, name) in covered, (kind, name)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_an_int(kind, value):
    for name, (check, _) in REQUESTS[kind].items():
        if name in sampler_fields():
            continue
        probe = {name: value}
        try:
            out = validate(req(kind, **probe))
        except ProtocolError as e:
            assert e.message.startswith(name + ":")
            continue
        # only true boolean fields may accept a bool, and they keep it as a bool
        assert getattr(out, name) is value, (kind, name, getattr(out, name))
        # init.preselect left out is None: the build's backend's row decides (llama/backends.py)
        assert DEFAULTS[kind].get(name) in ((None,) if (kind, name) == ("init", "preselect") else (True, False)), \
            (kind, name)


@pytest.mark.parametrize("kind", [k for k in sorted(REQUESTS) if "seq_id" in REQUESTS[k]])
def test_missing_required_field_named(kind):
    for name, (_, default) in REQUESTS[kind].items():
        if name in MINIMAL[kind]:
            obj = req(kind)
            del obj[name]
            with pytest.raises(ProtocolError) as ei:
                validate(obj)
            assert ei.value.message == f"{name}: missing (required for {kind})"
            assert ei.value.request == kind


def test_missing_grammar_fields():
    for name in ("id", "grammar"):
        obj = req("grammar")
        del obj[name]
        with pytest.raises(ProtocolError, match=f"^{name}: missing"):
            validate(obj)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
@pytest.mark.parametrize("name", ["tmperature", "seqId", "top_k", "", "TYPE", "extra"])
def test_unknown_fields_refused(kind, name):
    with pytest.raises(ProtocolError) as ei:
        validate(req(kind, **{name: 1}))
    assert ei.value.message.startswith(f"{name}: unknown field for {kind}")
    assert ei.value.request == kind
    assert ei.value.seq_id == MINIMAL[kind].get("seq_id", -1)


@pytest.mark.parametrize("kind,name,hint", [
    ("infer", "top_k", "topK"), ("infer", "repeat_penalty", "penaltyRepeat"),
    ("infer", "tmperature", "temperature"), ("infer", "seqId", "seq_id"),
    ("infer", "maxtokens", "maxTokens"), ("init", "nctx", "nCtx"), ("score", "pertoken", "perToken"),
])
def test_a_misspelt_field_gets_a_hint_the_client_sees(kind, name, hint):
    with pytest.raises(ProtocolError) as ei:
        validate(req(kind, **{name: 1}))
    assert ei.value.message == f"{name}: unknown field for {kind} (did you mean {hint}?)"


@pytest.mark.parametrize("kind,name", [("score", "top_k"), ("infer", "extra"), ("free", "temperature")])
def test_no_hint_names_a_field_the_request_does_not_have(kind, name):
    with pytest.raises(ProtocolError) as ei:
        validate(req(kind, **{name: 1}))
    assert ei.value.message == f"{name}: unknown field for {kind}"


def test_sampler_field_on_other_request_is_unknown():
    with pytest.raises(ProtocolError, match="^temperature: unknown field for score"):
        validate(req("score", temperature=0))


@pytest.mark.parametrize("obj", [None, 1, 1.5, "infer", [], [{"type": "quit"}], True])
def test_non_object_refused(obj):
    with pytest.raises(ProtocolError) as ei:
        validate(obj)
    assert "must be a JSON object" in ei.value.message
    assert ei.value.seq_id == -1 and ei.value.request is None
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        parse_line(orjson.dumps(obj))


@pytest.mark.parametrize("kind", [None, 1, "", "Infer", "infer ", "bogus", [], {"x": 1}, True])
def test_bad_type(kind):
    with pytest.raises(ProtocolError) as ei:
        validate({"type": kind, "seq_id": 4})
    assert ei.value.message.startswith("type: unknown request type")
    assert "infer" in ei.value.message  # lists the known types
    assert ei.value.seq_id == 4


def test_missing_type():
    with pytest.raises(ProtocolError) as ei:
        validate({"seq_id": 2, "prompt": "x"})
    assert ei.value.message.startswith("type: missing")
    assert ei.value.seq_id == 2
    with pytest.raises(ProtocolError, match="^type: missing"):
        validate({})


def test_error_seq_id_only_from_an_integer():
    for sid, expect in [(True, -1), ("3", -1), (3.0, -1), (None, -1), (7, 7)]:
        with pytest.raises(ProtocolError) as ei:
            validate({"type": "infer", "seq_id": sid, "bogus": 1})
        assert ei.value.seq_id == expect, sid


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind,field", [("infer", "maxTokens"), ("infer", "seq_id"), ("init", "nCtx"),
                                        ("score", "window"), ("init", "nThreads")])
def test_non_finite_numbers_refused(kind, field, value):
    with pytest.raises(ProtocolError) as ei:
        validate(req(kind, **{field: value}))
    assert ei.value.message.startswith(field + ":")
    encode(ei.value.event())


@pytest.mark.parametrize("line", [
    b'{"type": "infer", "seq_id": 0, "maxTokens": NaN}',
    b'{"type": "infer", "seq_id": 0, "maxTokens": Infinity}',
    b'{"type": "infer", "seq_id": 0, "maxTokens": -Infinity}',
    b'{"type": "infer", "seq_id": 0, "maxTokens": 1e999}',
    b'{"type": "infer", "seq_id": 0, "temperature": NaN}',
])
def test_non_finite_literals_are_not_json(line):
    with pytest.raises(ProtocolError, match="^not valid JSON"):
        parse_line(line)


@pytest.mark.parametrize("line", [
    b"", b"   ", b"{", b'{"type": "infer"', b'{"type": "infer", "seq_id": 0,}', b"nul", b"{'type': 'quit'}",
    b"\xff\xfe\x00", b'"\xed\xa0\x80"', b'{"type": "infer", "seq_id": 0, "prompt": "\\ud800"}',
    b'{"type": "quit"} {"type": "quit"}', b'{"type": "quit"}garbage', b"\x00", b"[1, 2",
])
def test_not_json(line):
    with pytest.raises(ProtocolError) as ei:
        parse_line(line)
    assert ei.value.message.startswith("not valid JSON")
    assert ei.value.seq_id == -1 and ei.value.request is None


def test_parse_line_valid_and_whitespace():
    assert as_dict(parse_line(b'  {"type": "quit"}  \r\n')) == {"type": "quit", "now": False}
    assert parse_line('{"type":"infer","seq_id":1,"prompt":"é ☃ 😀"}'.encode()).prompt == "é ☃ 😀"


def test_huge_json_integers():
    # orjson turns integers beyond 64 bits into floats; they must still be refused cleanly
    for line in [b'{"type": "infer", "seq_id": 100000000000000000000000}',
                 b'{"type": "infer", "seq_id": 0, "maxTokens": 100000000000000000000000}',
                 b'{"type": "fork", "seq_id": 0, "dst_seq_id": 18446744073709551615}',
                 b'{"type": "infer", "seq_id": 0, "prompt": [100000000000000000000000]}']:
        with pytest.raises(ProtocolError) as ei:
            parse_line(line)
        encode(ei.value.event())


def test_validate_with_unencodable_python_ints():
    # validate() called in-process with ints beyond 64 bits: still a ProtocolError
    for obj in [req("infer", prompt=2 ** 70), req("infer", stop=[2 ** 70]), req("grammar", id=[2 ** 80]),
                req("infer", maxTokens=2 ** 70), {"type": 2 ** 70}]:
        with pytest.raises(ProtocolError):
            validate(obj)


def test_line_length_limit():
    assert MAX_LINE_BYTES == 16 * 1024 * 1024
    with pytest.raises(ProtocolError) as ei:
        parse_line(b" " * (MAX_LINE_BYTES + 1))
    assert "line too long" in ei.value.message and ei.value.seq_id == -1
    # exactly at the limit is fine
    body = b'{"type": "infer", "seq_id": 1, "prompt": "x"}'
    line = body + b" " * (MAX_LINE_BYTES - len(body))
    assert len(line) == MAX_LINE_BYTES
    assert parse_line(line).seq_id == 1


def _read_all(data: bytes, limit: int = MAX_LINE_BYTES) -> list:
    return list(read_lines(io.BytesIO(data), limit))


def test_read_lines_skips_over_long_lines_and_goes_on():
    out = _read_all(b"a" * 101 + b"\n" + b'{"x": 1}\n' + b"b" * 100 + b"\n" + b"c" * 5000 + b"\n" + b"d", limit=100)
    assert isinstance(out[0], ProtocolError) and "line too long" in out[0].message
    assert out[1] == b'{"x": 1}'
    assert out[2] == b"b" * 100  # exactly the limit: served
    assert isinstance(out[3], ProtocolError)
    assert out[4] == b"d"  # a last line without newline
    assert len(out) == 5


def test_read_lines_blank_lines_and_crlf():
    assert _read_all(b"\n\n  \r\n{}\r\n\t\n[]") == [b"{}", b"[]"]


def test_read_lines_real_limit():
    data = b"x" * (MAX_LINE_BYTES + 10) + b"\n" + b'{"type": "quit"}\n'
    out = _read_all(data)
    assert len(out) == 2 and isinstance(out[0], ProtocolError)
    assert parse_line(out[1]).type == "quit"


def test_error_event_shape():
    assert error_event("boom") == {"type": "error", "seq_id": -1, "message": "boom"}
    assert error_event("boom", 3, "infer") == {"type": "error", "seq_id": 3, "message": "boom", "request": "infer"}
    e = ProtocolError("x: bad", 2, "score")
    assert str(e) == "x: bad"
    assert e.event() == {"type": "error", "seq_id": 2, "message": "x: bad", "request": "score"}
    assert ProtocolError("y").event() == {"type": "error", "seq_id": -1, "message": "y"}


def test_encode_one_line():
    ev = {"type": "token", "seq_id": 1, "token": 5, "piece": "a\nb\"é😀", "logprob": float("nan"),
          "x": np.float32(1.5), "arr": np.arange(3)}
    line = encode(ev)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = orjson.loads(line)
    assert back["piece"] == "a\nb\"é😀" and back["logprob"] is None and back["x"] == 1.5
    assert back["arr"] == [0, 1, 2]


# ------------------------------------------------------------------ hypothesis

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)

ALL_FIELDS = sorted({f for spec in REQUESTS.values() for f in spec} | {"type"})
plausible_requests = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    st.sampled_from(sorted(REQUESTS) + ["bogus"]),
    st.dictionaries(st.sampled_from(ALL_FIELDS), json_values | st.integers(-3, 300), max_size=6),
)


def _check_result(line: bytes) -> None:
    try:
        out = parse_line(line)
    except ProtocolError as e:
        assert isinstance(e.message, str) and e.message
        assert isinstance(e.seq_id, int)
        encode(e.event())
        return
    assert isinstance(out, Request) and out.type in REQUESTS
    spec = REQUESTS[out.type]
    out = as_dict(out)
    assert set(out) <= (set(spec) - set(sampler_fields())) | {"type", "params"}
    assert ("params" in out) == (out["type"] == "infer")
    for name, (_, default) in spec.items():
        if name not in sampler_fields():
            assert name in out
    if "params" in out:  # SamplerParams is not a dataclass (its fields come from the step registry)
        out["params"] = out["params"].to_request()
    encode(out)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values | plausible_requests)
def test_any_json_value_parses_or_protocol_error(value):
    # stdlib json can write what orjson cannot (ints beyond 64 bits, NaN literals)
    _check_result(json.dumps(value).encode())


@settings(max_examples=250, deadline=None)
@given(plausible_requests)
def test_any_python_request_validates_or_protocol_error(obj):
    try:
        out = validate(obj)
    except ProtocolError as e:
        encode(e.event())
        return
    assert out.type in REQUESTS


@settings(max_examples=250, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_parse_or_protocol_error(data):
    _check_result(data)


@settings(max_examples=150, deadline=None)
@given(plausible_requests, st.integers(0, 200), st.binary(max_size=3))
def test_truncated_or_corrupted_json(obj, cut, junk):
    line = json.dumps(obj).encode()
    _check_result(line[:cut])
    _check_result(line[:cut] + junk + line[cut:])


@pytest.mark.parametrize("extra,field,words", [
    ({"flashAttn": "on"}, "flashAttn", 'needs "off"'), ({"flashAttn": "auto"}, "flashAttn", 'needs "off"'),
    ({"kvUnified": True}, "kvUnified", "needs false"), ({"cacheTypeV": "q8_0"}, "cacheTypeV", "flash attention"),
    ({"cacheTypeK": "q4_0"}, "cacheTypeK", "f32, f16, bf16"), ({"nBatch": 2, "nSeqMax": 2}, "nBatch", ">= 3"),
    ({"nUbatch": 2}, "nUbatch", ">= 3"),
    ({"cacheTypeK": "turbo3", "cacheTypeV": "turbo3", "flashAttn": "off"}, "flashAttn", 'needs "on"'),
    ({"cacheTypeV": "turbo3"}, "cacheTypeK", "both K and V"),
    ({"cacheTypeK": "turbo4", "cacheTypeV": "q8_0"}, "cacheTypeV", "both K and V")])
def test_deterministic_refuses_what_it_cannot_keep(extra, field, words):
    with pytest.raises(ProtocolError) as ei:
        validate(req("init", deterministic=True, **extra))
    assert ei.value.message.startswith(field + ":") and words in ei.value.message, ei.value.message


def test_deterministic_sets_its_kernel_paths():
    out = validate(req("init", deterministic=True))
    assert (out.flashAttn, out.kvUnified, out.deterministic) == ("off", False, True)
    # turbo K and V: flash attention on, row by row (deterministic.ubatch; test_turbo_deterministic)
    out = validate(req("init", deterministic=True, cacheTypeK="turbo3", cacheTypeV="turbo4"))
    assert (out.flashAttn, out.kvUnified) == ("on", False)
    out = validate(req("init", deterministic=True, flashAttn="off", kvUnified=False, cacheTypeK="bf16"))
    assert (out.flashAttn, out.kvUnified, out.cacheTypeK) == ("off", False, "bf16")
