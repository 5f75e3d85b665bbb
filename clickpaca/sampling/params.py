"""Sampler parameters: one frozen, validated value per sequence.

Protocol names (camelCase, as they appear on the NDJSON wire) are used in every error
message, so a client sees the name it sent: ``topP: must be in [0, 1], got 1.5``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from .steps import BAN, FORCE
from .table import ALIASES, STEP_NAMES

__all__ = [
    "BAN",
    "FORCE",
    "DEFAULT_SAMPLERS",
    "STEP_NAMES",
    "PROTOCOL_NAMES",
    "SamplerParamError",
    "SamplerParams",
]

#: Every step, in the default order (the rows of ``table.STEPS``). The grammar is
#: always applied first when the caller passes a bitmask: it is a hard constraint, not
#: a preference, so no other step may see (and e.g. force) a token the grammar forbids.
DEFAULT_SAMPLERS = STEP_NAMES

#: Below this a positive temperature is greedy (0): dividing logits by it overflows
#: float32 (|logit + bias| up to 1e18 / 1e-20 stays under 3.4e38), and greedy is its limit.
MIN_TEMPERATURE = 1e-20

#: dataclass field -> protocol (wire) name.
PROTOCOL_NAMES = {
    "temperature": "temperature",
    "top_k": "topK",
    "top_p": "topP",
    "min_p": "minP",
    "penalty_repeat": "penaltyRepeat",
    "penalty_freq": "penaltyFreq",
    "penalty_present": "penaltyPresent",
    "penalty_last_n": "penaltyLastN",
    "logit_bias": "logit_bias",
    "seed": "seed",
    "n_probs": "nProbs",
    "samplers": "samplers",
}
_FIELD_BY_PROTOCOL = {v: k for k, v in PROTOCOL_NAMES.items()}
# Spellings a client may plausibly send by mistake (e.g. llama-server's names).
MISSPELLINGS = {
    "top_k": "topK", "top_p": "topP", "min_p": "minP", "repeat_penalty": "penaltyRepeat",
    "penalty_repeat": "penaltyRepeat", "frequency_penalty": "penaltyFreq",
    "penalty_freq": "penaltyFreq", "presence_penalty": "penaltyPresent",
    "penalty_present": "penaltyPresent", "repeat_last_n": "penaltyLastN",
    "penalty_last_n": "penaltyLastN", "logitBias": "logit_bias", "n_probs": "nProbs",
    "temp": "temperature",
}


class SamplerParamError(ValueError):
    """A bad sampler parameter. ``field`` is the protocol name, ``reason`` the why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _float(v: numbers.Real) -> float:
    """float(v); an integer beyond the float range (only in-process: JSON numbers that
    large arrive as inf and are refused by the parser) becomes +-inf, not OverflowError."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _real(name: str, v: Any, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False) -> float:
    """Check a finite real in [lo, hi] (or (lo, hi] with lo_open) and return it as float."""
    if not _is_real(v):
        raise SamplerParamError(name, f"must be a number, got {v!r}")
    x = _float(v)
    if not math.isfinite(x):
        raise SamplerParamError(name, f"must be finite, got {x!r}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        if hi is None:
            raise SamplerParamError(name, f"must be {'>' if lo_open else '>='} {lo:g}, got {x!r}")
        raise SamplerParamError(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {x!r}")
    if hi is not None and x > hi:
        raise SamplerParamError(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {x!r}")
    return x


def _int(name: str, v: Any, lo: int) -> int:
    if not _is_int(v):
        raise SamplerParamError(name, f"must be an integer, got {v!r}")
    x = int(v)
    if x < lo:
        raise SamplerParamError(name, f"must be >= {lo}, got {x}")
    return x


def _norm_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """Accept the protocol's list of {"token": id, "bias": x} objects, {id: bias} (ids may
    be decimal strings, as JSON object keys are) or a list of [id, bias] pairs; return
    sorted (id, bias) pairs. Duplicates are an error rather than silently summed or
    overwritten."""
    name = "logit_bias"
    if v is None:
        return ()
    if isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, (list, tuple)):
        items = []
        for pair in v:
            if isinstance(pair, Mapping):
                if set(pair) != {"token", "bias"}:
                    raise SamplerParamError(name, f"entries must be {{\"token\": id, \"bias\": x}}, got {pair!r}")
                items.append((pair["token"], pair["bias"]))
                continue
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SamplerParamError(name, f"list entries must be [tokenId, bias] pairs, got {pair!r}")
            items.append((pair[0], pair[1]))
    else:
        raise SamplerParamError(name, f"must be an object {{tokenId: bias}} or a list of [tokenId, bias], got {type(v).__name__}")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str):
            s = key.strip()
            if not (s.isascii() and s.isdigit()):
                raise SamplerParamError(name, f"token id must be a non-negative integer, got {key!r}")
            tok = int(s)
        elif _is_int(key):
            tok = int(key)
        else:
            raise SamplerParamError(name, f"token id must be an integer, got {key!r}")
        if tok < 0:
            raise SamplerParamError(name, f"token id must be >= 0, got {tok}")
        if not _is_real(bias):
            raise SamplerParamError(name, f"bias for token {tok} must be a number, got {bias!r}")
        b = _float(bias)
        if math.isnan(b):
            raise SamplerParamError(name, f"bias for token {tok} must not be NaN")
        if tok in out:
            raise SamplerParamError(name, f"token {tok} given more than once")
        out[tok] = b
    return tuple(sorted(out.items()))


def _norm_samplers(v: Any) -> tuple[str, ...]:
    name = "samplers"
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise SamplerParamError(name, f"must be a list of step names, got {v!r}")
    out = []
    if v and v[-1] == "sample":  # the draw itself: always the chain's end, accepted there
        v = v[:-1]
    for s in v:
        canon = ALIASES.get(s) if isinstance(s, str) else None
        if canon is None:
            where = " ('sample' is the fixed last step: only there)" if s == "sample" else ""
            raise SamplerParamError(name, f"unknown step {s!r}{where}; known: {', '.join(STEP_NAMES)}")
        if canon in out:
            raise SamplerParamError(name, f"step {canon!r} listed more than once")
        out.append(canon)
    if "grammar" in out and out[0] != "grammar":
        raise SamplerParamError(name, "'grammar' must come first: the grammar is always applied before every other step")
    return tuple(out)


@dataclass(frozen=True)
class SamplerParams:
    """Parameters of one sequence's sampler chain (see ``chain.apply_chain`` for semantics).

    ``temperature <= 0`` and ``top_k == 1`` are greedy; ``top_k == 0``, ``top_p == 1``,
    ``min_p == 0`` and ``penalty_last_n == 0`` switch their step off. ``logit_bias`` is
    given as a dict or pairs and stored as sorted (id, bias) pairs so the value stays
    hashable. ``samplers`` lists the steps in the order they run; the grammar, when the
    caller supplies a bitmask, runs first whether listed or not.
    """

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.0
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Any = ()
    seed: int | None = None
    n_probs: int = 0
    samplers: tuple[str, ...] = field(default=DEFAULT_SAMPLERS)

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "temperature", _real("temperature", self.temperature))
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / t would overflow: the limit is greedy
            s(self, "temperature", 0.0)
        s(self, "top_k", _int("topK", self.top_k, 0))
        s(self, "top_p", _real("topP", self.top_p, 0.0, 1.0))
        s(self, "min_p", _real("minP", self.min_p, 0.0, 1.0))
        s(self, "penalty_repeat", _real("penaltyRepeat", self.penalty_repeat, 0.0, None, lo_open=True))
        s(self, "penalty_freq", _real("penaltyFreq", self.penalty_freq))
        s(self, "penalty_present", _real("penaltyPresent", self.penalty_present))
        s(self, "penalty_last_n", _int("penaltyLastN", self.penalty_last_n, -1))
        s(self, "logit_bias", _norm_bias(self.logit_bias))
        if self.seed is not None:
            s(self, "seed", _int("seed", self.seed, 0))
        s(self, "n_probs", _int("nProbs", self.n_probs, 0))
        s(self, "samplers", _norm_samplers(self.samplers))

    # -- derived values ---------------------------------------------------------------

    @cached_property
    def steps(self) -> tuple[str, ...]:
        """Steps after the grammar, in order (the grammar is handled separately)."""
        return tuple(x for x in self.samplers if x != "grammar")

    @property
    def penalties_active(self) -> bool:
        """Whether the penalties step can change anything (else it is skipped)."""
        return self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0.0 or self.penalty_present != 0.0)

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 sorted, biases float64), built once for the hot path."""
        if not self.logit_bias:
            return np.empty(0, np.int32), np.empty(0, np.float64)
        ids, vals = zip(*self.logit_bias)
        return np.asarray(ids, np.int32), np.asarray(vals, np.float64)

    def validate(self, n_vocab: int) -> "SamplerParams":
        """Checks that need the vocabulary size; returns self so calls chain."""
        for tok, _ in self.logit_bias:
            if tok >= n_vocab:
                raise SamplerParamError("logit_bias", f"token id {tok} out of range [0, {n_vocab})")
        if self.n_probs > n_vocab:
            raise SamplerParamError("nProbs", f"must be <= the vocabulary size {n_vocab}, got {self.n_probs}")
        return self

    # -- protocol ---------------------------------------------------------------------

    @classmethod
    def from_request(cls, request: Mapping[str, Any], *, n_vocab: int | None = None) -> "SamplerParams":
        """Build from a protocol object (camelCase keys). Keys that are not sampler fields
        are ignored (the server passes its whole request), except known snake_case
        misspellings of sampler fields, which are errors: silently ignoring ``top_k``
        would run with the default and look like a bug elsewhere. A JSON null means
        "use the default". With ``n_vocab``, also runs ``validate``."""
        if not isinstance(request, Mapping):
            raise SamplerParamError("request", f"must be an object, got {type(request).__name__}")
        for k in request:
            if k in MISSPELLINGS and k not in _FIELD_BY_PROTOCOL:
                raise SamplerParamError(k, f"unknown field; did you mean {MISSPELLINGS[k]!r}?")
        kwargs = {}
        for proto, attr in _FIELD_BY_PROTOCOL.items():
            if proto in request and request[proto] is not None:
                kwargs[attr] = request[proto]
        params = cls(**kwargs)
        if n_vocab is not None:
            params.validate(n_vocab)
        return params

    def replace(self, **changes: Any) -> "SamplerParams":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_request(self) -> dict[str, Any]:
        """The protocol object for these parameters (logit_bias as {"token", "bias"} objects)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "logit_bias":
                v = [{"token": t, "bias": b} for t, b in v]
            elif f.name == "samplers":
                v = list(v)
            out[PROTOCOL_NAMES[f.name]] = v
        return out
