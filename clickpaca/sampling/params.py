"""Sampler parameters: one frozen, validated value per sequence, derived from the rows.

Every field is a ``registry.Param`` of some step's row (or of the chain: seed, nProbs,
samplers): its attribute, wire name, check, default and misspellings live there, so a
registered step's parameters are accepted, checked, defaulted and echoed with no change
here. Protocol names (camelCase, as they appear on the NDJSON wire) are used in every
error message, so a client sees the name it sent: ``topP: must be in [0, 1], got 1.5``.
"""

from __future__ import annotations

import weakref
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from . import registry as R
from .registry import SamplerParamError
from .steps import BAN, FORCE
from . import table  # noqa: F401  (registers the built-in rows)

__all__ = [
    "BAN",
    "FORCE",
    "SamplerParamError",
    "SamplerParams",
    "step_names",
    "protocol_names",
    "wire_names",
    "misspellings",
]

# Everything here is read from the registry when asked (cached per registry version):
# a step registered later (usersteps, `serve --steps`) is a parameter like any other,
# with no copy to refresh.


def step_names() -> tuple[str, ...]:
    """Every step, in the default order (the registry's rows): ``samplers``' default. The
    grammar is always applied first when the caller passes a bitmask: it is a hard
    constraint, not a preference, so no other step may see (and e.g. force) a token the
    grammar forbids."""
    return _tables()[3]


def protocol_names() -> dict[str, str]:
    """SamplerParams attribute -> protocol (wire) name, for every registered parameter."""
    return dict(_tables()[4])


def wire_names() -> tuple[str, ...]:
    """The wire names of every registered parameter, in order (the same tuple object
    while the registry is unchanged)."""
    return _tables()[5]


def misspellings() -> dict[str, str]:
    """Spellings a client may plausibly send by mistake (e.g. llama-server's names) -> the
    wire name meant."""
    return _tables()[6]


_cache: dict[int, tuple] = {}


def _tables() -> tuple:
    """(params, by attribute, wire -> attribute, step names, attribute -> wire, wire names,
    misspelling -> wire) for the registry's current version."""
    t = _cache.get(R.version())
    if t is None:
        ps = R.all_params()
        _cache.clear()
        wrong = {m: p.wire for p in ps for m in p.misspellings}
        t = _cache[R.version()] = (ps, {p.field: p for p in ps}, {p.wire: p.field for p in ps},
                                   tuple(s.name for s in R.steps()), {p.field: p.wire for p in ps},
                                   tuple(p.wire for p in ps), wrong)
    return t


class Chain:
    """A token for one chain (`SamplerParams.chain`); lives as long as a params names it."""

    __slots__ = ("__weakref__",)


#: chain_key -> its Chain, while some params holds it
_CHAINS: "weakref.WeakValueDictionary[tuple, Chain]" = weakref.WeakValueDictionary()


class SamplerParams:
    """Parameters of one sequence's sampler chain (see ``chain.apply_chain`` for semantics).

    Built by keyword, one per registered parameter (its attribute name, or its wire
    name); missing ones take their row's default. Frozen and hashable (the chain caches
    on it). ``temperature <= 0`` and ``top_k == 1`` are greedy; ``top_k == 0``,
    ``top_p == 1``, ``min_p == 0`` and ``penalty_last_n == 0`` switch their step off.
    ``samplers`` lists the steps in the order they run; the grammar, when the caller
    supplies a bitmask, runs first whether listed or not.
    """

    def __init__(self, **kwargs: Any) -> None:
        ps, by_field, by_wire = _tables()[:3]
        for k in kwargs:
            if k not in by_field and k not in by_wire:
                raise TypeError(f"SamplerParams: unknown parameter {k!r}")
        d = self.__dict__
        for p in ps:
            v = kwargs[p.field] if p.field in kwargs else kwargs.get(p.wire, p.default)
            d[p.field] = p.check(p.wire, v)
        d["_key"] = tuple(d[p.field] for p in ps)
        d["_hash"] = hash(d["_key"])  # the plans are cached per params, looked up per row and tick

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SamplerParams is frozen (use replace)")

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, SamplerParams) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        ps = _tables()[0]
        return "SamplerParams(" + ", ".join(f"{p.field}={getattr(self, p.field)!r}" for p in ps) + ")"

    def __reduce__(self):
        return (_rebuild, (self.to_request(),))

    # -- derived values ---------------------------------------------------------------

    @cached_property
    def steps(self) -> tuple[str, ...]:
        """Steps after the grammar, in order (the grammar is handled separately)."""
        return tuple(x for x in self.samplers if x != "grammar")

    @cached_property
    def chain_key(self) -> tuple:
        """Every parameter but the seed: what makes two sequences' chains compute alike
        (their random streams are their own), so a tick batches them together."""
        return tuple(v for p, v in zip(_tables()[0], self._key) if p.field != "seed")

    @cached_property
    def chain(self) -> "Chain":
        """The one `Chain` of every params with this `chain_key`: what a tick groups rows
        by, hashed by identity (hashing the key's values costs a microsecond a row)."""
        key = self.chain_key
        c = _CHAINS.get(key)
        if c is None:
            c = _CHAINS[key] = Chain()
        return c

    @cached_property
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
        are ignored (the server passes its whole request), except known misspellings of
        sampler fields, which are errors: silently ignoring ``top_k`` would run with the
        default and look like a bug elsewhere. A JSON null means "use the default". With
        ``n_vocab``, also runs ``validate``."""
        if not isinstance(request, Mapping):
            raise SamplerParamError("request", f"must be an object, got {type(request).__name__}")
        by_wire, wrong = _tables()[2], misspellings()
        for k in request:
            if k in wrong and k not in by_wire:
                raise SamplerParamError(k, f"unknown field (did you mean {wrong[k]}?)")
        kwargs = {by_wire[k]: v for k, v in request.items() if k in by_wire and v is not None}
        params = cls(**kwargs)
        if n_vocab is not None:
            params.validate(n_vocab)
        return params

    def replace(self, **changes: Any) -> "SamplerParams":
        """A copy with some fields changed (validated again)."""
        ps = _tables()[0]
        return SamplerParams(**{**{p.field: getattr(self, p.field) for p in ps}, **changes})

    def to_request(self) -> dict[str, Any]:
        """The protocol object for these parameters (logit_bias as {"token", "bias"}
        objects, tuples as lists)."""
        out = {}
        for p in _tables()[0]:
            v = getattr(self, p.field)
            if p.field == "logit_bias":
                v = [{"token": t, "bias": b} for t, b in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[p.wire] = v
        return out


def _rebuild(request: dict) -> SamplerParams:
    return SamplerParams.from_request(request)
