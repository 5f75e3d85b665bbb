"""The step registry: one row per sampler step owns everything about it.

A row (``Step``) names the step and gives its kind, its wire parameters (``Param``: name,
check, default, misspellings, meaning), its state, when it is an identity, what it touches
or truncates, and an optional superset hook (``cut``) for the fast path. ``SamplerParams``,
the protocol's checks and hints, the ``samplers`` names and docs/PROTOCOL.md's sampler table
are derived from the rows, so a new step is one function and one ``register`` call:

    register(Step("my_step", GENERAL, run=my_step_run,
                  params=(Param("my_x", "myX", 0.0, real(0, 1), doc="0 = off"),),
                  off=lambda p, has_hist: p.my_x == 0))

Kinds: constraint (the grammar, always first, never run by name); elementwise (changes a
small known set of tokens, ``touches``); truncation (keeps an upper set; skipped before
greedy when stateless); scale (temperature; t <= 0 is greedy); general (anything else).
Randomness comes from ``StepContext.uniform`` (the sequence's own seed); a step that reads
shared state says ``shared_state=True`` and stays on the calling thread.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..base.fieldcheck import (FieldError, boolean, choice_strings, integer, is_int, is_real, real, show,
                               to_float)

if TYPE_CHECKING:
    from .params import SamplerParams

__all__ = ["Param", "Step", "StepContext", "SamplerParamError", "register", "unregister", "register_chain_param", "on_change", "steps", "step", "by_name", "version", "docs_table",
           "chain_params", "all_params", "aliases", "empty_reasons", "real", "integer", "boolean", "choice_strings",
           "show", "is_int", "is_real", "to_float",
           "CONSTRAINT", "ELEMENTWISE", "TRUNCATION", "SCALE", "GENERAL", "KINDS", "NO_HIST",
           "Batched", "form", "KEEP_K", "KEEP_MASS", "DIVIDE", "TOUCH"]

CONSTRAINT, ELEMENTWISE, TRUNCATION, SCALE, GENERAL = (
    "constraint", "elementwise", "truncation", "scale", "general")
KINDS = (CONSTRAINT, ELEMENTWISE, TRUNCATION, SCALE, GENERAL)


#: A bad sampler parameter: the field checks' error (``field``: the protocol name,
#: ``reason``: the why), so a sampler field's message reads as any other field's.
SamplerParamError = FieldError


# ------------------------------------------------------------------ parameter checks
# fieldcheck's (shared with the protocol): ``real``, ``integer``, ``boolean``,
# ``choice_strings``; a step's own checks raise SamplerParamError with ``show(value)``.


@dataclass(frozen=True)
class Param:
    """One wire parameter of a step (or of the chain).

    field: the attribute on SamplerParams (snake_case); wire: the protocol name (in every
    error message); default; check(wire, value) -> normalised value or SamplerParamError;
    misspellings: names a client may send by mistake (llama-server's), answered with a
    hint; doc: the meaning, for the docs table."""

    field: str
    wire: str
    default: Any
    check: Callable[[str, Any], Any]
    misspellings: tuple[str, ...] = ()
    doc: str = ""
    shown: str | None = None  # the default as the docs table shows it (None: the value)


# ------------------------------------------------------------------ what a step sees


class StepContext:
    """What a step may use besides (ids, logits) and the params, for one sample call.

    hist: (ids sorted, counts) of the penalty window; history: every token of the
    sequence's context, in order (the sequence's own list in the engine: do not change
    it); rest_mass: for the first
    truncation on a superset, the mass left out (see ``cut``); vocab: the model's
    vocabulary helper or None (steps that need token text); n_vocab: the vocabulary
    size (0 when unknown); the sequence's step states and random streams (``state``,
    ``uniform``); prepared: what the request's preparation made for a step, by step
    name, off the engine thread (DRY's breaker table: engine/prepare.py), or None."""

    __slots__ = ("hist", "history", "rest_mass", "vocab", "n_vocab", "states", "streams", "seed", "used",
                 "prepared")

    def __init__(self, hist=None, history=(), vocab=None, states=None, streams=None, seed: int = 0,
                 n_vocab: int = 0, prepared=None):
        self.n_vocab = n_vocab
        self.hist = hist if hist is not None else NO_HIST
        self.history = history
        self.rest_mass = 0.0
        self.vocab = vocab
        self.states = {} if states is None else states
        self.streams = {} if streams is None else streams
        self.seed = seed
        self.used: list[Step] = []
        self.prepared = prepared

    def state(self, step: "Step", params: "SamplerParams") -> Any:
        """The sequence's state of a stateful step (made on first use by ``step.state``)."""
        st = self.states.get(step.name)
        if st is None:
            st = self.states[step.name] = step.state(params)
        if step not in self.used:
            self.used.append(step)
        return st

    def uniform(self, step: "Step") -> float:
        """One uniform draw in [0, 1) from the step's own stream of the sequence's seed:
        seeded runs stay reproducible, and the stream the final draw uses is not shifted."""
        g = self.streams.get(step.name)
        if g is None:
            g = self.streams[step.name] = np.random.default_rng([self.seed, zlib.crc32(step.name.encode())])
        return float(g.random())


#: the penalty window of a sequence without one: no ids, no counts
NO_HIST = (np.empty(0, np.int32), np.empty(0, np.float64))


def _never(p: "SamplerParams", n_allowed: int) -> bool:
    return False


#: The forms a step may take in the batched passes (the host's batch.sample_tick, the
#: pre-selection's passes in fastpath.py and fastpath_touched.py); which passes a chain
#: of them takes is decided in one place, sampling/forms.py.
KEEP_K, KEEP_MASS, DIVIDE, TOUCH = "keep_k", "keep_mass", "divide", "touch"


@dataclass(frozen=True)
class Batched:
    """A step's batched form, declared on its row beside its scalar ``run``.

    form: KEEP_K (keep the k best in canonical order: ``value`` is k), KEEP_MASS (keep the
      shortest canonical prefix holding a share of the mass: ``value`` is the share),
      DIVIDE (divide every logit: ``value`` is the divisor), or TOUCH (change the values of
      a few known ids: ``touch``).
    touch(v, ids, rows, m, p, counts): the TOUCH form's arithmetic over the touched ids of
      m rows side by side (float64 values ``v``, changed in place; ``ids`` and ``rows``
      their token ids and row numbers; ``counts`` their counts in the penalty window when
      ``counts`` is set, else None); returns (bool[m]: the rows whose result it can give,
      indices of ``v`` it removes), either None for all / none.
    counts: the TOUCH form reads the penalty window's counts of the touched ids.
    carries(p): False where these params need more than the form (a forcing logit bias).
    tests/test_sampling_forms.py holds each form against its row's ``run``."""

    form: str
    value: Callable[["SamplerParams"], Any] | None = None
    touch: Callable | None = None
    counts: bool = False
    carries: Callable[["SamplerParams"], bool] = lambda p: True


def form(step: "Step") -> str | None:
    """The step's batched form (None: it has none, so a chain holding it goes per row)."""
    return None if step.batched is None else step.batched.form


@dataclass(frozen=True, eq=False)
class Step:
    """One sampler step (see the module docstring for kinds).

    name: the canonical name (in ``samplers``, timings, traces and empty reasons).
    run(ids, logits, params, ctx): the step over a candidate set (None: not run by name).
    off(params, has_hist): True when the step is an identity for these params.
    params: its wire parameters (``Param``), checked and defaulted by SamplerParams.
    alias: another spelling accepted in ``samplers`` (camelCase, as the protocol's fields).
    truncates(params, n_allowed): True when it may drop candidates out of n_allowed.
    touches(params, ctx): ELEMENTWISE only: the sorted int32 ids whose logits it may change.
      (The pre-selection's orders, fastpath.order_many, call it with no penalty window in
      ctx: the one step whose ids are the window's, table.PENALTIES, is read from the
      window there.)
    cut: the optional superset hook: when this step is the first truncation, the ids of a
      superset of what it keeps among the allowed raw tokens outside ``touched``, and the
      mass (relative to the largest candidate) of those left out, which the chain puts in
      ``ctx.rest_mass`` for ``run``. Without it the step runs on the full candidate set.
    state(params): makes the per-sequence state of a stateful step (None: stateless). The
      state is copied with the sequence (fork) and must deep-copy.
    sampled(state, token, params): after a token is drawn from a chain in which the step
      ran (mirostat's mu update).
    empty: why the candidate set is empty when this step emptied it (None: the generic
      "no candidate left after <name>").
    doc: a line for the docs table.
    shared_state: True when its functions read or write anything besides their arguments,
      the sequence's own StepContext fields and immutable module constants: the
      vocabulary (``ctx.vocab`` and its memo), module-level mutable state, the registry.
      A chain holding such a step is sampled on the calling thread (``batch``), never on
      a worker. tests/test_sampling_table.py runs every row on a worker thread with the
      shared objects watched and fails for a row that touches one without saying so.
    keeps_one: True when, run on a one-token candidate set, it keeps that token (it may
      rescale its logit): after a cut to the canonical first token, a chain whose
      remaining steps all keep one is greedy (``chain.greedy_tail``). Checked by
      tests/test_sampling_table.py on one-token sets.
    preselected: True when the step runs exactly on the few values the decode's graph
      pre-selects (sampling/fastpath.py): an elementwise step whose touched tokens the
      graph gathers, a positive temperature, or a truncation that keeps an upper set (all
      candidates at or above some value, found from the K best and the block masses).
      A chain holding any other active step takes the host path.
      tests/test_sampling_fastpath.py checks every such row against the host path.
    batched: its form in the batched passes (``Batched``), None: per row only.
    """

    name: str
    kind: str
    run: Callable | None
    off: Callable[["SamplerParams", bool], bool]
    params: tuple[Param, ...] = ()
    alias: str | None = None
    truncates: Callable[["SamplerParams", int], bool] = _never
    touches: Callable[["SamplerParams", StepContext], np.ndarray] | None = None
    cut: Callable | None = None
    state: Callable[["SamplerParams"], Any] | None = None
    sampled: Callable[[Any, int, "SamplerParams"], None] | None = None
    empty: str | None = None
    doc: str = ""
    shared_state: bool = False
    keeps_one: bool = False
    preselected: bool = False
    batched: "Batched | None" = None

    @property
    def stateful(self) -> bool:
        return self.state is not None


# ------------------------------------------------------------------ the registry

_STEPS: list[Step] = []
_CHAIN_PARAMS: list[Param] = []
_version = [0]  # bumped at every registration (params.py caches on it)
_listeners: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn`` after every registration or removal: the chain's plan caches, keyed by
    params alone, are emptied so no plan outlives the rows it was made from."""
    _listeners.append(fn)
    return fn


def _changed() -> None:
    _version[0] += 1
    for fn in _listeners:
        fn()


def _check_new(names: set[str], p: Param) -> None:
    taken = {q.field for q in all_params()} | {q.wire for q in all_params()}
    if p.field in taken or p.wire in taken:
        raise ValueError(f"parameter {p.field!r} / {p.wire!r} is already registered")
    names.add(p.field)


def register(step: Step, *, before: str | None = None) -> Step:
    """Add a step to the registry: at the end of the default order, or just before the
    step named ``before``. Its name, alias and parameter names must be new."""
    if step.kind not in KINDS:
        raise ValueError(f"unknown kind {step.kind!r}; known: {', '.join(KINDS)}")
    spellings = aliases()
    for s in (step.name, step.alias):
        if s is not None and s in spellings:
            raise ValueError(f"step name {s!r} is already registered")
    if step.kind == ELEMENTWISE and step.touches is None:
        raise ValueError(f"{step.name}: an elementwise step must say which tokens it touches")
    if (step.sampled is not None) and step.state is None:
        raise ValueError(f"{step.name}: `sampled` needs a state")
    seen: set[str] = set()
    for p in step.params:
        _check_new(seen, p)
    if before is None:
        _STEPS.append(step)
    else:
        _STEPS.insert([s.name for s in _STEPS].index(before), step)
    _changed()
    return step


def unregister(name: str) -> Step:
    """Remove a registered step (tests; a client-defined step going away)."""
    i = [s.name for s in _STEPS].index(name)
    _changed()
    return _STEPS.pop(i)


def register_chain_param(p: Param) -> Param:
    """A parameter of the whole chain rather than of one step (seed, nProbs, samplers)."""
    _check_new(set(), p)
    _CHAIN_PARAMS.append(p)
    _changed()
    return p


def version() -> int:
    return _version[0]


def steps() -> tuple[Step, ...]:
    """Every step, in the default order."""
    return tuple(_STEPS)


_by_name: dict[int, dict[str, Step]] = {}


def by_name() -> dict[str, Step]:
    """Canonical name -> step (rebuilt after a registration)."""
    d = _by_name.get(_version[0])
    if d is None:
        _by_name.clear()
        d = _by_name[_version[0]] = {s.name: s for s in _STEPS}
    return d


def step(name: str) -> Step:
    return by_name()[name]


def active(p: "SamplerParams", has_hist: bool) -> list[Step]:
    """The steps `p` lists, in its order, less those that are identities for it (`off`):
    what a chain runs, asked in one place (chain.py, trace.py, the engine's jump-forward)."""
    by = by_name()
    return [s for s in map(by.__getitem__, p.steps) if not s.off(p, has_hist)]


def chain_params() -> tuple[Param, ...]:
    return tuple(_CHAIN_PARAMS)


def all_params() -> tuple[Param, ...]:
    """Every parameter: the steps' in step order, then the chain's."""
    return tuple(p for s in _STEPS for p in s.params) + tuple(_CHAIN_PARAMS)


def aliases() -> dict[str, str]:
    """Accepted spellings in ``samplers`` -> canonical step name."""
    out = {s.name: s.name for s in _STEPS}
    out.update({s.alias: s.name for s in _STEPS if s.alias})
    return out


def empty_reasons() -> dict[str, str]:
    """Why a candidate set became empty, by what emptied it ("sample": nothing drawable)."""
    return {**{s.name: s.empty for s in _STEPS if s.empty}, "sample": "no candidate has a finite logit"}


def docs_table() -> str:
    """The docs/PROTOCOL.md table of the sampler fields, one row per parameter, from the rows."""
    lines = ["| field | step | default | meaning |", "|---|---|---|---|"]
    for s in _STEPS:
        for p in s.params:
            lines.append(f"| `{p.wire}` | {s.name} | {p.shown or _show(p.default)} | {p.doc} |")
    for p in _CHAIN_PARAMS:
        lines.append(f"| `{p.wire}` | (chain) | {p.shown or _show(p.default)} | {p.doc} |")
    return "\n".join(lines)


def _show(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, tuple):
        return "[" + ", ".join(f"`{x!r}`".replace("'", '"') if isinstance(x, str) else str(x) for x in v) + "]" if v else "[]"
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


if __name__ == "__main__":  # python -m clickpaca.sampling.registry: the docs table
    import clickpaca.sampling.table  # noqa: F401  (the built-in rows, in the imported registry)
    from clickpaca.sampling.registry import docs_table as _table

    print(_table())
