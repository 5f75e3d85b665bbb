"""The NDJSON protocol: request validation and event construction.

One JSON object per line in each direction. `parse_line` turns a raw line into a typed
request, one frozen dataclass per request type (InitRequest, InferRequest, ...: defaults
filled in, types checked, unknown fields refused with a hint for a misspelt one), or a
`ProtocolError` naming the wire field and the reason. This is the edge: every check that
needs only the request is made here, once, including those across fields (an infer's
sampler fields become one `SamplerParams` in `params`; init's nBatch against its
nSeqMax). Checks that need the server's state (is the seq_id active, does the grammar
exist, are the logit_bias ids in the vocabulary) belong to the engine's handlers.
docs/PROTOCOL.md is the user-facing description; tests/test_protocol_doc.py runs its
examples.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import orjson

from ..llama import cachetypes
from . import endings as _endings
from .chat import Message, check_messages
from ..base.fieldcheck import (boolean as _bool, integer as _int, one_of as _one_of, optional as _opt,
                               real as _num, show as _show, string as _str, string_list as _str_list)
from ..grammar.json_schema import NUMBER_DIGITS
from ..sampling import SamplerParams
from .scoring import SCORE_LAST_MIN
from ..sampling.params import misspellings, wire_names


MAX_LINE_BYTES = 16 * 1024 * 1024  # a line longer than this is refused (and skipped)
# Nesting of arrays/objects in one request line. Requests are at most 3 deep (logit_bias);
# a deeper line is refused before anything walks it recursively (repr of a 1,000-deep
# value raised RecursionError and ended the reader thread).
MAX_JSON_DEPTH = 32
MAX_PROMPT_BYTES = 1 << 20  # infer/prefill prompt (UTF-8 bytes); tokenized on the reader thread (engine/prepare.py)
MAX_MESSAGES = 1024  # chat turns in one infer/prefill: each costs a template turn and two special tokens
MAX_TEMPLATE_BYTES = 64 << 10  # chatTemplate text (llama.cpp matches it against its built-in ones)
MAX_STOPS, MAX_STOP_BYTES = 64, 4096  # stop strings: every generated piece is searched for each
MAX_LOGIT_BIAS = 16384  # logit_bias entries: the engine builds the sequence's bias arrays from them
MAX_SCORE_BYTES = 4 << 20  # score text
MAX_GRAMMAR_BYTES = 128 << 10  # grammar text, checked here only (grammars.py checks its other limits)
MAX_NUMBER_DIGITS = 18  # integral digits of a bounded JSON number: 10**18 - 1 fits an i64
MAX_THREADS = 512  # GGML_MAX_N_THREADS in ggml.h: the CPU threadpool's fixed arrays


@dataclass
class ProtocolError(Exception):
    """A request that cannot be served; becomes an `error` event."""

    message: str
    seq_id: int = -1
    request: str | None = None

    def __str__(self) -> str:
        return self.message

    def event(self) -> dict:
        return error_event(self.message, self.seq_id, self.request)


# ------------------------------------------------------------------ field checks
# The general checks and the message style are fieldcheck's (the sampler parameters use
# them too); those below are the protocol's own fields'.

def _name(name: str, v: Any) -> str:
    """A build name: one path component under builds/, never a path to import code from."""
    v = _str(True)(name, v)
    if not _NAME_RE.fullmatch(v):
        raise ValueError(f"{name}: must be a build name under builds/ (letters, digits, '.', '_', '-'; "
                         f"no path), got {_show(v)}")
    return v


def _grammar_id(name: str, v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError(f"{name}: must be a string or an integer, got {_show(v)}")
    return str(v)


def _stops(name: str, v: Any) -> list[str]:
    v = _str_list(name, v)
    if len(v) > MAX_STOPS:
        raise ValueError(f"{name}: {len(v)} strings, the limit is {MAX_STOPS}")
    for s in v:
        if len(s) > MAX_STOP_BYTES // 4 and len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise ValueError(f"{name}: a string of {len(s.encode('utf-8', 'surrogatepass'))} bytes, "
                             f"the limit is {MAX_STOP_BYTES}")
    return v


MAX_RPC_SERVERS = 16  # GGML_RPC_MAX_SERVERS in ggml-rpc.h


def _endpoints(name: str, v: Any) -> tuple[str, ...]:
    """rpcServers: distinct "host:port" strings (rpc/wire.py parses them)."""
    from ..rpc.wire import parse_endpoint

    if not isinstance(v, list) or not v:
        raise ValueError(f"{name}: must be a non-empty list of \"host:port\" strings, got {_show(v)}")
    if len(v) > MAX_RPC_SERVERS:
        raise ValueError(f"{name}: at most {MAX_RPC_SERVERS} workers, got {len(v)}")
    for item in v:
        try:
            parse_endpoint(item)
        except ValueError as e:
            raise ValueError(f"{name}: {_show(item)}: {e}") from None
    if len(set(v)) != len(v):
        raise ValueError(f"{name}: a worker is listed twice")
    return tuple(v)


def _shares(name: str, v: Any) -> tuple[float, ...]:
    """tensorSplit: the share of the offloaded layers per device (normalised by llama.cpp)."""
    if not isinstance(v, list) or not v or len(v) > MAX_RPC_SERVERS:
        raise ValueError(f"{name}: must be a list of 1..{MAX_RPC_SERVERS} numbers, got {_show(v)}")
    out = [_num(0.0)(name, x) for x in v]
    if not any(out):
        raise ValueError(f"{name}: at least one share must be > 0")
    return tuple(out)


MAX_CAPTURE_NODES = 64  # capture: node names per request (each is looked for on every decode's ask)
CAPTURE_TOKENS = ("last", "generated", "all")
CAPTURE_DTYPES = ("float32", "float16")
#: captureTokens when not given: what a researcher reads from each kind of request
#: (docs/ACTIVATIONS.md): the state each generated token was sampled from; every token
#: of a scored text; a prefilled prompt's summary at its last token
CAPTURE_DEFAULT = {"infer": "generated", "score": "all", "prefill": "last"}


def _node_names(name: str, v: Any) -> tuple[str, ...]:
    """capture: graph node names (checked against the model's graph by the handler)."""
    v = _str_list(name, v)
    if not v:
        raise ValueError(f"{name}: must name at least one graph node (or leave it out)")
    if len(v) > MAX_CAPTURE_NODES:
        raise ValueError(f"{name}: {len(v)} nodes, the limit is {MAX_CAPTURE_NODES}")
    return tuple(dict.fromkeys(v))


def _capture_fits(obj: dict, values: dict, kind: str) -> None:
    """captureTokens / captureDtype need capture; captureTokens 'generated' needs a request
    that generates; the default captureTokens is the request kind's (CAPTURE_DEFAULT)."""
    if values["capture"] is None:
        for name in ("captureTokens", "captureDtype"):
            if name in obj:
                raise ValueError(f"{name}: only applies with capture")
        return
    if values["captureTokens"] is None:
        values["captureTokens"] = CAPTURE_DEFAULT[kind]
    elif values["captureTokens"] == "generated" and kind != "infer":
        raise ValueError(f"captureTokens: a {kind} generates no tokens; use last or all")


def _cvec(check_name: str) -> Callable[[str, Any], Any]:
    """A control-vector field's check, from activations/wire.py (loaded when first used)."""
    def check(name: str, v: Any) -> Any:
        from ..activations import wire as cvec_wire
        return getattr(cvec_wire, check_name)(name, v)
    return check


def _with_params(name: str, v: Any) -> Any:
    """Marks the sampler fields: never checked one by one, but together by SamplerParams
    (InferRequest.check_across), which also decides which bad field to report first."""
    raise AssertionError(name)


def json_depth(obj: Any, limit: int) -> int:
    """Nesting depth of arrays/objects, without recursion; stops counting past `limit`."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SEQ = _int(0, (1 << 31) - 1)  # bounded: an event's seq_id must stay encodable (1e20 crashed encode)


def sampler_fields() -> tuple[str, ...]:
    """infer's sampler fields: the wire name of every parameter in the step registry now,
    a step registered after this module was imported (`serve --steps`) included."""
    return wire_names()


def _messages(name: str, v: Any) -> Any:
    """check_messages, and the prompt's size limit over all the contents (they are
    formatted and tokenized like a prompt) and on their number."""
    if isinstance(v, list) and len(v) > MAX_MESSAGES:
        raise ValueError(f"{name}: {len(v)} messages, the limit is {MAX_MESSAGES}")
    messages = check_messages(name, v)
    if sum(len(m.content) for m in messages) * 4 > MAX_PROMPT_BYTES:  # UTF-8: at most 4 bytes a char
        n = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in messages)
        if n > MAX_PROMPT_BYTES:
            raise ValueError(f"{name}: {n} bytes of content, the limit is {MAX_PROMPT_BYTES}")
    return messages


def _batch_fits(values: dict) -> None:
    if values["nBatch"] < values["nSeqMax"]:
        raise ValueError(f"nBatch: must be >= nSeqMax ({values['nSeqMax']}) so every sequence gets "
                         f"a token each tick, got {values['nBatch']}")
    if values["nCtx"] < values["nSeqMax"]:
        # llama.cpp clamps n_batch to n_ctx, then reserves n_seq_max output rows:
        # GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) aborts the process.
        raise ValueError(f"nCtx: must be >= nSeqMax ({values['nSeqMax']}), got {values['nCtx']}")


def _deterministic_fits(obj: dict, values: dict) -> None:
    """deterministic: true sets flashAttn off (on, row by row, for a turbo K and V: the
    types' rows in cachetypes.py say which) and kvUnified false (deterministic.py); an
    explicit other value, or a cache type that needs another attention path, is refused."""
    from ..llama.deterministic import required, type_problem

    types = (values["cacheTypeK"], values["cacheTypeV"])
    problem = type_problem(types)  # per type: its row's deterministic settings (cachetypes.py)
    if problem is not None:
        name = ("cacheTypeK", "cacheTypeV")[problem[0]]
        raise ValueError(f"{name}: {problem[1]}, got {_show(values[name])}")
    for name, need in required(types).items():
        if name in obj and values[name] != need:
            raise ValueError(f"{name}: deterministic mode needs {orjson.dumps(need).decode()}, "
                             f"got {_show(values[name])} (docs/DETERMINISM.md)")
        values[name] = need
    if values["nBatch"] < 3:
        raise ValueError(f"nBatch: deterministic mode needs >= 3 (a prompt is never split "
                         f"to leave a chunk of one token), got {values['nBatch']}")


def _sampler_params(obj: dict) -> SamplerParams:
    """The sampler fields, checked together by SamplerParams (its errors name the field;
    each bound is its row's: sampling/table.py); the vocabulary-dependent checks wait for
    the model (SamplerParams.validate, in the infer handler)."""
    return SamplerParams.from_request({k: obj[k] for k in sampler_fields() if k in obj})


def _prompt_or_messages(values: dict, kind: str) -> None:
    """Exactly one of `prompt` and `messages` (infer alone may send neither: it then
    continues a held sequence with nothing added)."""
    if values["prompt"] is not None and values["messages"] is not None:
        raise ValueError("messages: send either prompt or messages, not both")
    if values["messages"] is None:
        if values["chatTemplate"] is not None:
            raise ValueError("chatTemplate: only applies with messages")
        if values["prompt"] is None:
            if kind == "prefill":
                raise ValueError("prompt: missing (required for prefill)")
            values["prompt"] = ""


# ------------------------------------------------------------------ typed requests
#
# One frozen dataclass per request type (keyword-only: a request is built by field name,
# as on the wire, and a required field may follow a defaulted one); each wire field is
# declared once, with its check and its default (`wire`), and REQUESTS, the table `validate` walks, is derived
# from the classes. Attributes carry the wire names (req.nBatch, req.seq_id): the wire
# mixes camelCase and snake_case, and one spelling in docs, error messages and code
# needs no table translating between them. Attributes that are not on the wire are
# snake_case: infer's `params` (its sampler fields, folded into one SamplerParams) and
# init's `given`. A request holds only what the client sent: the engine's work on it
# (prompt tokens, a compiled grammar) travels beside it, in the engine's own type.


def wire(check: Callable[[str, Any], Any], default: Any = MISSING) -> Any:
    """A wire field: its check (name, value) -> value or ValueError naming the field, and
    its default (none: the field is required)."""
    if default is MISSING:
        return field(metadata={"check": check})
    return field(default=default, metadata={"check": check})


def _folded(names: Callable[[], tuple[str, ...]], make: Callable[[], Any]) -> Any:
    """A value made from several wire fields together (the request's check_across makes
    it); ``names()`` says which fields, read at each use."""
    return field(default_factory=make, metadata={"folds": names})


def _given() -> Any:
    """The wire fields the client wrote (the others took their defaults); not compared:
    requests are equal by their values."""
    return field(default=frozenset(), compare=False, repr=False, metadata={"given": True})


class Request:
    """A validated request; `type` is its wire name."""

    type: ClassVar[str]

    @property
    def reply_seq_id(self) -> int:
        """The seq_id an answer about this request goes to (-1: none)."""
        return getattr(self, "seq_id", -1)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        """Checks across fields, after each field's own check: `obj` as received, `values`
        checked and defaulted (it may be completed here); a ValueError naming the field."""


class _Fields(Mapping):
    """A request's wire fields in declaration order: name -> (check, default). A folded
    group's names are asked of its source at each use (infer's sampler fields, of the
    step registry), so a step registered later is a field with no copy to refresh; the
    flat row is rebuilt only when a source answers differently."""

    def __init__(self, parts: list) -> None:
        self._parts = parts  # (name, (check, default)) pairs and folded groups' name sources
        self._key: tuple | None = None
        self._row: dict[str, tuple[Callable[[str, Any], Any], Any]] = {}

    def _flat(self) -> dict[str, tuple[Callable[[str, Any], Any], Any]]:
        key = tuple(part() for part in self._parts if callable(part))
        if key != self._key:
            row: dict[str, tuple[Callable[[str, Any], Any], Any]] = {}
            for part in self._parts:
                if callable(part):
                    row.update((name, (_with_params, MISSING)) for name in part())
                else:
                    row[part[0]] = part[1]
            self._key, self._row = key, row
        return self._row

    def __getitem__(self, name: str) -> tuple[Callable[[str, Any], Any], Any]:
        return self._flat()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._flat()

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())

    def items(self):  # one look at the sources, not one per field
        return self._flat().items()

    def keys(self):
        return self._flat().keys()

    def values(self):
        return self._flat().values()


#: Request type -> its dataclass, and -> its wire fields: name -> (check, default), where
#: default MISSING means required. The sampler fields of infer map to _with_params.
REQUEST_TYPES: dict[str, type[Request]] = {}
REQUESTS: dict[str, _Fields] = {}


def _request(kind: str) -> Callable[[type], type]:
    """Register a request's dataclass under its wire type `kind` and derive its row of
    REQUESTS from the fields."""
    def register(cls: type) -> type:
        if not is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__}: a request is a frozen dataclass")
        cls.type = kind
        spec: list = []
        for f in fields(cls):
            if "check" in f.metadata:
                spec.append((f.name, (f.metadata["check"], f.default)))
            elif "folds" in f.metadata:
                spec.append(f.metadata["folds"])
            elif "given" not in f.metadata:
                raise TypeError(f"{cls.__name__}.{f.name}: declare it with wire(), _folded() or _given()")
        REQUEST_TYPES[kind] = cls
        REQUESTS[kind] = _Fields(spec)
        return cls
    return register


@_request("init")
@dataclass(frozen=True, kw_only=True)
class InitRequest(Request):
    """Load the model and make the context (engine/runtime.py); once per server."""

    modelPath: str | None = wire(_opt(_str(True)), None)
    nGpuLayers: int = wire(_int(-1, (1 << 31) - 1), -1)  # -1: every layer (llama.cpp's own default)
    nCtx: int = wire(_int(16, 1 << 24), 8192)
    nBatch: int = wire(_int(1, 1 << 16), 512)
    nSeqMax: int = wire(_int(1, 256), 64)
    cacheTypeK: str = wire(_str(True), cachetypes.DEFAULT)
    cacheTypeV: str = wire(_str(True), cachetypes.DEFAULT)
    nThreads: int | None = wire(_opt(_int(1, MAX_THREADS)), None)
    build: str | None = wire(_opt(_name), None)
    flashAttn: str = wire(_str(True), "auto")
    swaFull: bool = wire(_bool, True)
    kvUnified: bool = wire(_bool, True)
    stateDir: str | None = wire(_opt(_str(True)), None)
    deterministic: bool = wire(_bool, False)  # docs/DETERMINISM.md
    # sample where the logits are: each sampled row's chain runs on the few values the
    # decode's graph pre-selects, where its steps allow (docs/BENCHMARKS.md, "Pre-selection");
    # left out: the build's backend's row (llama/backends.py; the host path where not measured)
    preselect: bool | None = wire(_opt(_bool), None)
    # RPC workers (docs/SCALE-OUT.md): "host:port" each, the offloaded layers' share per
    # worker device, seconds without progress before a worker counts as lost, and the
    # output layer's weights kept local (its logits then never cross the network)
    rpcServers: tuple[str, ...] | None = wire(_opt(_endpoints), None)
    tensorSplit: tuple[float, ...] | None = wire(_opt(_shares), None)
    rpcTimeout: float = wire(_num(0.1, 86400.0), 120.0)
    outputLocal: bool = wire(_bool, False)
    # requests may `capture`: on a build without llama_set_eval_callback the eval callback
    # can only be given at context creation, where it costs every decode (docs/ACTIVATIONS.md)
    capture: bool = wire(_bool, False)
    # a control vector (docs/ACTIVATIONS.md): a GGUF path or {layer: vector}, its layers, and
    # every sequence's strength (infer's controlVectorStrength sets one sequence's)
    controlVector: Any = wire(_opt(_cvec("control_vector")), None)
    controlVectorLayers: tuple[int, int] | None = wire(_opt(_cvec("layer_range")), None)
    controlVectorStrength: float = wire(_cvec("strength"), 1.0)
    # key centering (docs/KV-RESEARCH.md, "Key centering in the graph"): a center file that
    # `clickpaca kv-center` wrote; every key is stored minus its layer's mean key
    kvCenter: str | None = wire(_opt(_str(True)), None)
    # the fields the client gave: a shared server compares those with what it runs
    given: frozenset[str] = _given()

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        values["given"] = frozenset(k for k in obj if k != "type")
        _batch_fits(values)
        for name in ("controlVectorLayers", "controlVectorStrength"):
            if name in obj and values["controlVector"] is None:
                raise ValueError(f"{name}: only applies with controlVector")
        if values["deterministic"]:
            _deterministic_fits(obj, values)


@_request("grammar")
@dataclass(frozen=True, kw_only=True)
class GrammarRequest(Request):
    """Compile a grammar under an id of the client's session."""

    id: str = wire(_grammar_id)
    grammar: str = wire(_str(True, MAX_GRAMMAR_BYTES))
    # JSON schemas only (docs/GRAMMARS.md): ignore the keywords llguidance does not
    # implement, bound typed numbers' integral digits (null: unbounded), refuse anything
    # not enforced (unknown formats, oneOf as anyOf), check every finished output
    lenient: bool = wire(_bool, False)
    numberDigits: int | None = wire(_opt(_int(1, MAX_NUMBER_DIGITS)), NUMBER_DIGITS)
    strict: bool = wire(_bool, False)
    validate: bool = wire(_bool, False)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        # the same test as grammars.detect_format, which this module does not import
        if not values["grammar"].lstrip().startswith("%json_schema"):
            for name in ("lenient", "numberDigits", "strict", "validate"):
                if name in obj and obj[name] is not False:  # lenient: false changes nothing
                    raise ValueError(f"{name}: applies to JSON schemas (%json_schema) only")
        if values["strict"] and values["lenient"]:
            raise ValueError("strict: refuses what lenient ignores; give one of them")


@_request("infer")
@dataclass(frozen=True, kw_only=True)
class InferRequest(Request):
    """Generate on a sequence: from a prompt or chat messages, or continuing a held one."""

    seq_id: int = wire(SEQ)
    prompt: str | None = wire(_str(max_bytes=MAX_PROMPT_BYTES), None)
    messages: tuple[Message, ...] | None = wire(_opt(_messages), None)  # instead of prompt
    chatTemplate: str | None = wire(_opt(_str(True, MAX_TEMPLATE_BYTES)), None)
    addGenerationPrompt: bool = wire(_bool, True)
    maxTokens: int = wire(_int(0, 1 << 24), 256)
    grammar_id: str | None = wire(_opt(_grammar_id), None)
    stop: list[str] | None = wire(_opt(_stops), None)
    reusePrefix: bool = wire(_bool, True)
    capture: tuple[str, ...] | None = wire(_opt(_node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")
    controlVectorStrength: float | None = wire(_opt(_cvec("strength")), None)  # this sequence's (init's vector)
    validate: bool = wire(_bool, False)  # check the finished output against the JSON schema grammar
    jumpForward: bool = wire(_bool, False)  # a grammar's forced tokens fed as one chunk (engine/jump.py)
    params: SamplerParams = _folded(sampler_fields, SamplerParams)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        bias = obj.get("logit_bias")
        if isinstance(bias, (list, dict)) and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} entries, the limit is {MAX_LOGIT_BIAS} "
                             "(a grammar restricts the vocabulary at any size)")
        values["params"] = _sampler_params(obj)
        _prompt_or_messages(values, "infer")
        _capture_fits(obj, values, "infer")
        if values["validate"] and values["grammar_id"] is None:
            raise ValueError("validate: checks the output against a JSON schema grammar; give grammar_id")


@_request("score")
@dataclass(frozen=True, kw_only=True)
class ScoreRequest(Request):
    """The negative log-likelihood of a text (scoring.py), in windows of the context."""

    seq_id: int = wire(SEQ)
    text: str = wire(_str(True, MAX_SCORE_BYTES))
    window: int | None = wire(_opt(_int(3, 1 << 24)), None)  # 2 would score no token of a long text
    # from SCORE_LAST_MIN here (needs only the request), below the window in the handler
    # (the default window is the context's): both scoring.check_score_last's rule
    scoreLast: int | None = wire(_opt(_int(SCORE_LAST_MIN, 1 << 24)), None)
    perToken: bool = wire(_bool, False)
    capture: tuple[str, ...] | None = wire(_opt(_node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        _capture_fits(obj, values, "score")


@_request("cancel")
@dataclass(frozen=True, kw_only=True)
class CancelRequest(Request):
    """End a running sequence (`done` with stop_reason cancelled)."""

    seq_id: int = wire(SEQ)


@_request("free")
@dataclass(frozen=True, kw_only=True)
class FreeRequest(Request):
    """Release a sequence, running or held, and its KV cells."""

    seq_id: int = wire(SEQ)


@_request("prefill")
@dataclass(frozen=True, kw_only=True)
class PrefillRequest(Request):
    """Decode a prompt into a sequence and hold it (to fork, save, or continue)."""

    seq_id: int = wire(SEQ)
    prompt: str | None = wire(_str(True, MAX_PROMPT_BYTES), None)
    messages: tuple[Message, ...] | None = wire(_opt(_messages), None)  # instead of prompt
    chatTemplate: str | None = wire(_opt(_str(True, MAX_TEMPLATE_BYTES)), None)
    addGenerationPrompt: bool = wire(_bool, True)
    capture: tuple[str, ...] | None = wire(_opt(_node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        _prompt_or_messages(values, "prefill")
        _capture_fits(obj, values, "prefill")


@_request("fork")
@dataclass(frozen=True, kw_only=True)
class ForkRequest(Request):
    """Copy a held sequence's KV cells to a new sequence."""

    seq_id: int = wire(SEQ)
    dst_seq_id: int = wire(SEQ)


@_request("save")
@dataclass(frozen=True, kw_only=True)
class SaveRequest(Request):
    """Write a held sequence's state to a file. path: a name in the state directory
    (statedir.py); shared: in the namespace all clients share."""

    seq_id: int = wire(SEQ)
    path: str = wire(_str(True))
    shared: bool = wire(_bool, False)
    replace: bool = wire(_bool, False)


@_request("load")
@dataclass(frozen=True, kw_only=True)
class LoadRequest(Request):
    """Restore a saved state into a sequence, held."""

    seq_id: int = wire(SEQ)
    path: str = wire(_str(True))
    shared: bool = wire(_bool, False)


@_request("quit")
@dataclass(frozen=True, kw_only=True)
class QuitRequest(Request):
    """End the server: after the running sequences, or `now`, cancelling them."""

    now: bool = wire(_bool, False)


@_request("stats")
@dataclass(frozen=True, kw_only=True)
class StatsRequest(Request):
    """What the server holds that grows with requests, and each bound (engine/accounting.py)."""


def _did_you_mean(name: str, spec: dict) -> str:
    """A hint for a misspelt field: another server's name for it (llama-server's top_k),
    else the closest field of this request, ignoring case."""
    guess = misspellings().get(name)
    if guess is None:
        lowered = {f.lower(): f for f in spec}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.8)
        guess = lowered[close[0]] if close else None
    return f" (did you mean {guess}?)" if guess in spec else ""


def validate(obj: Any) -> Request:
    """A typed request (defaults filled in) or ProtocolError naming the field."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"request must be a JSON object, got {type(obj).__name__}")
    seq_id = obj.get("seq_id", -1)
    seq_id = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else -1
    kind = obj.get("type", MISSING)
    if kind is MISSING:
        raise ProtocolError("type: missing (one of " + ", ".join(REQUESTS) + ")", seq_id)
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise ProtocolError(f"type: unknown request type {_show(kind)} (one of "
                            + ", ".join(REQUESTS) + ")", seq_id)
    spec = REQUESTS[kind]
    for name in obj:
        if name != "type" and name not in spec:
            raise ProtocolError(f"{name}: unknown field for {kind}{_did_you_mean(name, spec)}",
                                seq_id, kind)
    values: dict[str, Any] = {}
    for name, (check, default) in spec.items():
        if check is _with_params:
            continue
        if name in obj:
            try:
                values[name] = check(name, obj[name])
            except ValueError as e:  # a check names its field; one from deeper down (int()) gets it here
                msg = str(e)
                raise ProtocolError(msg if msg.startswith(name) else f"{name}: {msg}", seq_id, kind) from None
        elif default is MISSING:
            raise ProtocolError(f"{name}: missing (required for {kind})", seq_id, kind)
        else:
            values[name] = default
    cls = REQUEST_TYPES[kind]
    try:
        cls.check_across(obj, values)
    except ValueError as e:
        raise ProtocolError(str(e), seq_id, kind) from None
    return cls(**values)


def parse_line(line: bytes) -> Request:
    """Decode and validate one request line into its typed request."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line too long: {len(line)} bytes (limit {MAX_LINE_BYTES})")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"not valid JSON: {e}") from None
    # cheap first: a line with few brackets cannot be deep
    if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        seq_id = obj.get("seq_id", -1) if isinstance(obj, dict) else -1
        seq_id = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else -1
        kind = obj.get("type") if isinstance(obj, dict) else None
        raise ProtocolError(f"request nested deeper than {MAX_JSON_DEPTH} levels of arrays/objects",
                            seq_id, kind if isinstance(kind, str) and kind in REQUESTS else None)
    return validate(obj)


# ------------------------------------------------------------------ events
#
# One constructor per event type; the engine and the servers build events only through
# them. EVENTS maps each type to its constructor; END_EVENTS are the types that answer a
# request on its seq_id (the last event a client waits for there; client.py reads them).

EVENTS: dict[str, Callable[..., dict]] = {}
END_EVENTS: set[str] = set()


def _event(kind: str, ends: bool = False) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    def register(make: Callable[..., dict]) -> Callable[..., dict]:
        EVENTS[kind] = make
        if ends:
            END_EVENTS.add(kind)
        return make
    return register


@_event("ready")
def ready_event(**fields: Any) -> dict:
    """The answer to `init`: what was loaded (runtime.py names the fields)."""
    return {"type": "ready", **fields}


@_event("grammar_ready")
def grammar_ready_event(grammar_id: str, enforced: bool | None = None,
                        ignored: list[dict] | None = None) -> dict:
    """A grammar registered; for a JSON schema, whether it is ``enforced`` whole and what
    is not (``ignored``: path, keyword, reason each; docs/GRAMMARS.md)."""
    ev: dict[str, Any] = {"type": "grammar_ready", "id": grammar_id}
    if enforced is not None:
        ev["enforced"] = enforced
    if ignored is not None:
        ev["ignored"] = list(ignored)
    return ev


@_event("token")
def token_event(seq_id: int, token: int, piece: str, logprobs: dict | None = None,
                forced: bool = False) -> dict:
    """One generated token; with nProbs, ``logprobs`` holds logprob, top, steered_logprob
    and steered_top; ``forced``: the grammar forced it and it was fed in a jump-forward
    chunk (the field is present only then)."""
    ev: dict[str, Any] = {"type": "token", "seq_id": seq_id, "token": token, "piece": piece}
    if forced:
        ev["forced"] = True
    if logprobs is not None:
        ev.update(logprobs)
    return ev


@_event("done", ends=True)
def done_event(seq_id: int, stop_reason: str, stop: str | None = None, request: str | None = None,
               **stats: Any) -> dict:
    """The end of an infer (``stats``: tokens_prompt, tokens_reused, tokens_predicted,
    prompt_ms, eval_ms, prompt_tps, eval_tps), or of a cancelled score or prefill (its
    ``request`` instead)."""
    ev: dict[str, Any] = {"type": "done", "seq_id": seq_id, **stats, "stop_reason": stop_reason}
    if stop is not None:
        ev["stop"] = stop
    if request is not None:
        ev["request"] = request
    return ev


@_event("error", ends=True)
def error_event(message: str, seq_id: int = -1, request: str | None = None) -> dict:
    ev: dict[str, Any] = {"type": "error", "seq_id": seq_id, "message": message}
    if request:
        ev["request"] = request
    return ev


@_event("scored", ends=True)
def scored_event(seq_id: int, nll: list[float], windows: int, per_token: bool,
                 capture: dict | None = None) -> dict:
    """The mean negative log-likelihood of the scored tokens and its perplexity (and the
    request's `capture`, when it asked)."""
    mean = float(np.mean(nll)) if nll else float("nan")
    ev: dict[str, Any] = {"type": "scored", "seq_id": seq_id, "tokens": len(nll), "nll": mean,
                          "ppl": float(np.exp(mean)), "windows": windows}
    if per_token:
        ev["token_nll"] = [round(x, 6) for x in nll]
    if capture is not None:
        ev["capture"] = capture
    return ev


@_event("prefilled", ends=True)
def prefilled_event(seq_id: int, tokens: int, prompt_ms: float, capture: dict | None = None) -> dict:
    ev = {"type": "prefilled", "seq_id": seq_id, "tokens": tokens, "prompt_ms": round(prompt_ms, 3)}
    if capture is not None:
        ev["capture"] = capture
    return ev


@_event("forked", ends=True)
def forked_event(seq_id: int, dst_seq_id: int, tokens: int) -> dict:
    return {"type": "forked", "seq_id": seq_id, "dst_seq_id": dst_seq_id, "tokens": tokens}


@_event("saved", ends=True)
def saved_event(seq_id: int, path: str, n_bytes: int, tokens: int) -> dict:
    return {"type": "saved", "seq_id": seq_id, "path": path, "bytes": n_bytes, "tokens": tokens}


@_event("loaded", ends=True)
def loaded_event(seq_id: int, tokens: int) -> dict:
    return {"type": "loaded", "seq_id": seq_id, "tokens": tokens}


@_event("freed", ends=True)
def freed_event(seq_id: int) -> dict:
    return {"type": "freed", "seq_id": seq_id}


@_event("stats")
def stats_event(**fields: Any) -> dict:
    """The answer to `stats`: ticks so far, rssBytes, every cache with its bounds, logitsRows."""
    return {"type": "stats", **fields}


def encode(event: dict) -> bytes:
    """One event as one line (orjson: compact, UTF-8; non-finite floats become null)."""
    return orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


if END_EVENTS != _endings.END_EVENTS:  # an ending event added here needs its row there
    raise ImportError(f"protocol END_EVENTS {sorted(END_EVENTS)} differ from endings.py's "
                      f"{sorted(_endings.END_EVENTS)}")
