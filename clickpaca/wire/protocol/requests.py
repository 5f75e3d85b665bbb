"""The request types: one frozen dataclass per wire request, each field with its check
and default, and each type's checks across its fields (an infer's sampler fields become
one `SamplerParams` in `params`; init's nBatch against its nSeqMax). Checks that need the
server's state (is the seq_id active, does the grammar exist) are the engine's handlers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ...llama import cachetypes
from ..chat import Message
from ...base.fieldcheck import (boolean as _bool, integer as _int, one_of as _one_of, optional as _opt,
                                real as _num, show as _show, string as _str)
from ...grammar.json_schema import NUMBER_DIGITS
from ...sampling import SamplerParams
from ..scoring import SCORE_LAST_MIN
from . import checks
from .checks import (CAPTURE_DEFAULT, CAPTURE_DTYPES, CAPTURE_TOKENS, MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS,
                     MAX_NUMBER_DIGITS, MAX_PROMPT_BYTES, MAX_SCORE_BYTES, MAX_TEMPLATE_BYTES, MAX_THREADS, SEQ,
                     sampler_fields)
from .declare import Request, folded, given_fields, request_type, wire


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


def _lens_fits(values: dict, kind: str) -> None:
    """A lens reads the rows its capture machinery takes (engine/readout.py): with a
    capture of its own, that capture must read the same tokens (generated for an infer,
    all for a score)."""
    if values["lens"] is None or values["capture"] is None:
        return
    if values["captureTokens"] != CAPTURE_DEFAULT[kind]:
        raise ValueError(f"lens: reads the {CAPTURE_DEFAULT[kind]} tokens; with capture, captureTokens "
                         f"must be {CAPTURE_DEFAULT[kind]} too (or send the lens in its own request)")


def _batch_fits(values: dict) -> None:
    if values["nBatch"] < values["nSeqMax"]:
        raise ValueError(f"nBatch: must be >= nSeqMax ({values['nSeqMax']}) so every sequence gets "
                         f"a token each tick, got {values['nBatch']}")
    if values["nUbatch"] is not None and values["nUbatch"] > values["nBatch"]:
        raise ValueError(f"nUbatch: must be <= nBatch ({values['nBatch']}), got {values['nUbatch']}")
    if values["nCtx"] < values["nSeqMax"]:
        # llama.cpp clamps n_batch to n_ctx, then reserves n_seq_max output rows:
        # GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) aborts the process.
        raise ValueError(f"nCtx: must be >= nSeqMax ({values['nSeqMax']}), got {values['nCtx']}")


def _deterministic_fits(obj: dict, values: dict) -> None:
    """deterministic: true sets flashAttn off (on, row by row, for a turbo K and V: the
    types' rows in cachetypes.py say which) and kvUnified false (deterministic.py); an
    explicit other value, or a cache type that needs another attention path, is refused."""
    from ...llama.deterministic import required, type_problem

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
    if values["nUbatch"] is not None and values["nUbatch"] < 3:
        raise ValueError(f"nUbatch: deterministic mode needs >= 3 (no micro-batch may hold a "
                         f"sequence's lone token), got {values['nUbatch']}")


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


@request_type("init")
@dataclass(frozen=True, kw_only=True)
class InitRequest(Request):
    """Load the model and make the context (engine/runtime.py); once per server."""

    modelPath: str | None = wire(_opt(_str(True)), None)
    nGpuLayers: int = wire(_int(-1, (1 << 31) - 1), -1)  # -1: every layer (llama.cpp's own default)
    nCtx: int = wire(_int(16, 1 << 24), 8192)
    nBatch: int = wire(_int(1, 1 << 16), 512)
    # rows per graph pass (llama.cpp's n_ubatch; a larger tick is split): None = nBatch. Below
    # 64 on a CPU build keeps ggml's attention row by row for many sequences' tokens
    # (docs/BENCHMARKS.md, "Rows per graph pass")
    nUbatch: int | None = wire(_opt(_int(1, 1 << 16)), None)
    nSeqMax: int = wire(_int(1, 256), 64)
    cacheTypeK: str = wire(_str(True), cachetypes.DEFAULT)
    cacheTypeV: str = wire(_str(True), cachetypes.DEFAULT)
    nThreads: int | None = wire(_opt(_int(1, MAX_THREADS)), None)
    build: str | None = wire(_opt(checks.build_name), None)
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
    rpcServers: tuple[str, ...] | None = wire(_opt(checks.endpoints), None)
    tensorSplit: tuple[float, ...] | None = wire(_opt(checks.shares), None)
    rpcTimeout: float = wire(_num(0.1, 86400.0), 120.0)
    outputLocal: bool = wire(_bool, False)
    # requests may `capture`: on a build without llama_set_eval_callback the eval callback
    # can only be given at context creation, where it costs every decode (docs/ACTIVATIONS.md)
    capture: bool = wire(_bool, False)
    # a control vector (docs/ACTIVATIONS.md): a GGUF path or {layer: vector}, its layers, and
    # every sequence's strength (infer's controlVectorStrength sets one sequence's)
    controlVector: Any = wire(_opt(checks.cvec("control_vector")), None)
    controlVectorLayers: tuple[int, int] | None = wire(_opt(checks.cvec("layer_range")), None)
    controlVectorStrength: float = wire(checks.cvec("strength"), 1.0)
    # resident steering vectors (`vector` requests) of the activations build (docs/ACTIVATIONS.md)
    vectorSlots: int = wire(_int(1, 64), 8)
    # key centering (docs/KV-RESEARCH.md, "Key centering in the graph"): a center file that
    # `clickpaca kv-center` wrote; every key is stored minus its layer's mean key
    kvCenter: str | None = wire(_opt(_str(True)), None)
    # the fields the client gave: a shared server compares those with what it runs
    given: frozenset[str] = given_fields()

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        values["given"] = frozenset(k for k in obj if k != "type")
        _batch_fits(values)
        for name in ("controlVectorLayers", "controlVectorStrength"):
            if name in obj and values["controlVector"] is None:
                raise ValueError(f"{name}: only applies with controlVector")
        if values["deterministic"]:
            _deterministic_fits(obj, values)


@request_type("grammar")
@dataclass(frozen=True, kw_only=True)
class GrammarRequest(Request):
    """Compile a grammar under an id of the client's session."""

    id: str = wire(checks.grammar_id)
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


@request_type("vector")
@dataclass(frozen=True, kw_only=True)
class VectorRequest(Request):
    """Register a steering vector under an id of the client's session (docs/ACTIVATIONS.md):
    a control-vector GGUF path or {layer: vector}, as init's controlVector."""

    id: str = wire(checks.cvec("vector_id"))
    vector: Any = wire(checks.cvec("control_vector"))


@request_type("infer")
@dataclass(frozen=True, kw_only=True)
class InferRequest(Request):
    """Generate on a sequence: from a prompt or chat messages, or continuing a held one."""

    seq_id: int = wire(SEQ)
    prompt: str | None = wire(_str(max_bytes=MAX_PROMPT_BYTES), None)
    messages: tuple[Message, ...] | None = wire(_opt(checks.messages), None)  # instead of prompt
    chatTemplate: str | None = wire(_opt(_str(True, MAX_TEMPLATE_BYTES)), None)
    addGenerationPrompt: bool = wire(_bool, True)
    maxTokens: int = wire(_int(0, 1 << 24), 256)
    grammar_id: str | None = wire(_opt(checks.grammar_id), None)
    stop: list[str] | None = wire(_opt(checks.stops), None)
    reusePrefix: bool = wire(_bool, True)
    capture: tuple[str, ...] | None = wire(_opt(checks.node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")
    patch: tuple | None = wire(_opt(checks.patches), None)  # activation patching: docs/ACTIVATIONS.md
    controlVectorStrength: float | None = wire(_opt(checks.cvec("strength")), None)  # this sequence's (init's vector)
    lens: tuple | None = wire(_opt(checks.lens), None)  # the logit lens (docs/ACTIVATIONS.md)
    steer: tuple | None = wire(_opt(checks.cvec("steer_list")), None)  # its own vectors (activations/steering.py)
    validate: bool = wire(_bool, False)  # check the finished output against the JSON schema grammar
    jumpForward: bool = wire(_bool, False)  # a grammar's forced tokens fed as one chunk (engine/jump.py)
    params: SamplerParams = folded(sampler_fields, SamplerParams)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        bias = obj.get("logit_bias")
        if isinstance(bias, (list, dict)) and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} entries, the limit is {MAX_LOGIT_BIAS} "
                             "(a grammar restricts the vocabulary at any size)")
        values["params"] = _sampler_params(obj)
        _prompt_or_messages(values, "infer")
        _capture_fits(obj, values, "infer")
        _lens_fits(values, "infer")
        if values["validate"] and values["grammar_id"] is None:
            raise ValueError("validate: checks the output against a JSON schema grammar; give grammar_id")


@request_type("score")
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
    steer: tuple | None = wire(_opt(checks.cvec("steer_list")), None)  # its own vectors (activations/steering.py)
    capture: tuple[str, ...] | None = wire(_opt(checks.node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")
    patch: tuple | None = wire(_opt(checks.patches), None)  # activation patching: docs/ACTIVATIONS.md
    lens: tuple | None = wire(_opt(checks.lens), None)  # the logit lens (docs/ACTIVATIONS.md)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        _capture_fits(obj, values, "score")
        _lens_fits(values, "score")


@request_type("cancel")
@dataclass(frozen=True, kw_only=True)
class CancelRequest(Request):
    """End a running sequence (`done` with stop_reason cancelled)."""

    seq_id: int = wire(SEQ)


@request_type("free")
@dataclass(frozen=True, kw_only=True)
class FreeRequest(Request):
    """Release a sequence, running or held, and its KV cells; or (`vector`) a steering
    vector registered by this client."""

    seq_id: int | None = wire(_opt(SEQ), None)
    vector: str | None = wire(_opt(checks.cvec("vector_id")), None)

    @property
    def reply_seq_id(self) -> int:
        return -1 if self.seq_id is None else self.seq_id

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        if values["seq_id"] is None and values["vector"] is None:
            raise ValueError("seq_id: missing (required for free)")
        if values["seq_id"] is not None and values["vector"] is not None:
            raise ValueError("vector: a free names a sequence (seq_id) or a vector, not both")


@request_type("prefill")
@dataclass(frozen=True, kw_only=True)
class PrefillRequest(Request):
    """Decode a prompt into a sequence and hold it (to fork, save, or continue)."""

    seq_id: int = wire(SEQ)
    prompt: str | None = wire(_str(True, MAX_PROMPT_BYTES), None)
    messages: tuple[Message, ...] | None = wire(_opt(checks.messages), None)  # instead of prompt
    chatTemplate: str | None = wire(_opt(_str(True, MAX_TEMPLATE_BYTES)), None)
    addGenerationPrompt: bool = wire(_bool, True)
    capture: tuple[str, ...] | None = wire(_opt(checks.node_names), None)  # docs/ACTIVATIONS.md
    captureTokens: str | None = wire(_opt(_one_of(CAPTURE_TOKENS)), None)
    captureDtype: str = wire(_one_of(CAPTURE_DTYPES), "float32")
    patch: tuple | None = wire(_opt(checks.patches), None)  # activation patching: docs/ACTIVATIONS.md
    steer: tuple | None = wire(_opt(checks.cvec("steer_list")), None)  # its own vectors (activations/steering.py)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        _prompt_or_messages(values, "prefill")
        _capture_fits(obj, values, "prefill")


@request_type("fork")
@dataclass(frozen=True, kw_only=True)
class ForkRequest(Request):
    """Copy a held sequence's KV cells to a new sequence."""

    seq_id: int = wire(SEQ)
    dst_seq_id: int = wire(SEQ)


@request_type("save")
@dataclass(frozen=True, kw_only=True)
class SaveRequest(Request):
    """Write a held sequence's state to a file. path: a name in the state directory
    (statedir.py); shared: in the namespace all clients share."""

    seq_id: int = wire(SEQ)
    path: str = wire(_str(True))
    shared: bool = wire(_bool, False)
    replace: bool = wire(_bool, False)


@request_type("load")
@dataclass(frozen=True, kw_only=True)
class LoadRequest(Request):
    """Restore a saved state into a sequence, held."""

    seq_id: int = wire(SEQ)
    path: str = wire(_str(True))
    shared: bool = wire(_bool, False)


@request_type("quit")
@dataclass(frozen=True, kw_only=True)
class QuitRequest(Request):
    """End the server: after the running sequences, or `now`, cancelling them."""

    now: bool = wire(_bool, False)


@request_type("stats")
@dataclass(frozen=True, kw_only=True)
class StatsRequest(Request):
    """What the server holds that grows with requests, and each bound (engine/accounting.py)."""
