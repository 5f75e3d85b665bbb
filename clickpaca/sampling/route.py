"""Which path samples a row, and why a row takes the host path: the one place that
decides it. `route` says, from the registry rows of a chain's active steps, whether the
chain can run on the values the decode pre-selects (None) or needs the whole row (a
`Fallback`); the pre-selection's own refusals after the decode are `Fallback`s too, as is
every other reason a row comes back whole. `path` is what a result's ``path`` says.
`tick_route` says which of fastpath.sample_tick's batched passes takes a pre-selected row
(or none: per row). Each is kept per chain (`per_chain`, the cache the fast path's plans
use too).
"""

from __future__ import annotations

import functools

from . import forms, registry
from . import fastpath_touched as T
from .batch import batch_plan
from .chain import SequenceSampler, steps_to_run
from .fastpath_dense import dense_plan


class Fallback(str):
    """Why a row takes the host path: one of the constants below or `step`'s. Its text is
    what a done's ``samplingPath.reasons`` and a trace's ``path`` name."""

    __slots__ = ()

    @classmethod
    def step(cls, name: str) -> "Fallback":
        """An active step whose registry row does not say ``preselected``."""
        return cls(name)


# before the decode (route, and the engine's pre-selection)
TRACE = Fallback("trace")
DENSE_TOUCHED = Fallback("dense draw with touched tokens")
MORE_THAN_ONE_ROW = Fallback("more than one row")  # a capture asked for rows beside the sampled one
MASK_FAILED = Fallback("grammar mask failed")
CAME_BACK_WHOLE = Fallback("the row came back whole")  # not read back packed (a callback failed)
HOST = Fallback("host")  # not ordered for another reason
# after it (fastpath.sample: nothing was drawn, the host path runs on the whole row)
PAST_K = Fallback("truncation reaches past the K best")  # the sequence asks for twice K next time
NON_FINITE = Fallback("non-finite row")
NOTHING_ALLOWED = Fallback("grammar allows nothing")
OTHER_PLAN = Fallback("pre-selected for another plan")  # made for other params, history or mask
N_PROBS_PAST_K = Fallback("nProbs reach past the K best")
NO_MASS = Fallback("no mass")
DRAW_OUTSIDE = Fallback("draw outside the blocks handed back")


_UNKEPT = object()


def per_chain(make):
    """``make(p, *args)`` kept per chain and args: keyed by ``p.chain`` (every parameter
    but the seed, hashed by identity), so a row's lookup hashes no parameter values, where
    an lru_cache keyed by the params calls their Python-level __hash__. What it keeps
    must not depend on the seed; it is dropped when the registry changes, and at 4,096
    entries."""
    kept: dict = {}

    def lookup(p, *args):
        key = (p.chain, *args)
        r = kept.get(key, _UNKEPT)
        if r is _UNKEPT:
            if len(kept) >= 4096:
                kept.clear()
            r = kept[key] = make(p, *args)
        return r

    registry.on_change(kept.clear)
    return functools.wraps(make)(lookup)


def route(s: SequenceSampler, grammar: bool, rows: int = 1) -> Fallback | None:
    """None when the sequence's chain runs on pre-selected values, else why not.
    ``rows``: the logits rows the sequence's job asked of this decode."""
    if rows != 1:
        return MORE_THAN_ONE_ROW
    return _route(s.params, s.penalizes, s.n_vocab)


@per_chain
def _route(p, has_hist: bool, n_vocab: int) -> Fallback | None:
    """`route` for a chain: from the registry rows of its active steps."""
    if p.trace:
        return TRACE
    active, first = steps_to_run(p, has_hist, n_vocab)
    for step in active:
        if not step.preselected:
            return Fallback.step(step.name)
    if first is None and any(st.touches is not None for st in active):
        return DENSE_TOUCHED
    return None


def path(fallback: Fallback | None) -> str:
    """A result's ``path``: "graph" (decided on pre-selected values) or "host: <why>"."""
    return "graph" if fallback is None else f"host: {fallback}"


# ------------------------------------------------------------------ a pre-selected row's pass


class _Route(tuple):
    """A route of `_tick_route`, compared and hashed by identity: there is one per chain
    and order shape (`tick_route`), so a tick groups its rows by the object itself (a
    tuple's hash is recomputed at every lookup)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other


@per_chain
def tick_route(p, has_hist: bool, n_vocab: int, masked: bool, touched: bool, mass: bool, raw: bool,
               dense: bool) -> _Route | None:
    """Which batched pass of fastpath.sample_tick takes a pre-selected row (`_tick_route`),
    as a `_Route`: one object per chain and order shape; None: per row."""
    plan = _tick_route(p, has_hist, n_vocab, masked, touched, mass, raw, dense)
    return None if plan is None else _Route(plan)


def _tick_route(p, has_hist: bool, n_vocab: int, masked: bool, touched: bool, mass: bool, raw: bool,
                dense: bool) -> tuple | None:
    """Which of sample_tick's batched passes takes a row, from its params and what its
    order asked of the graph (`tick_route` keeps it: one lookup per row and tick): ("greedy",),
    ("topk", k, top_p, temperature[, n_probs]) (k None: top-p first, `_nucleus_tick`),
    ("touched", fastpath_touched's plan) (bias / penalties), ("dense", 1 / tau) (a draw over
    the whole vocabulary: fastpath_dense), or None (per row: ``sample``). A masked
    row's route holds only while its K values are all finite (the caller checks)."""
    if touched:
        pl = None if masked else T.plan_of(p, has_hist, n_vocab)
        return None if pl is None else ("touched", pl)
    plan = None
    if not p.n_probs:
        plan = batch_plan(p, has_hist, n_vocab)
    elif not masked and mass and not raw:  # nProbs from the same candidates (the raw normaliser from the masses)
        plan = _without_probs(p, has_hist, n_vocab)
        plan = plan + (p.n_probs,) if plan is not None and plan[0] == "topk" and p.n_probs <= plan[1] else None
    if plan is not None or masked or not mass:
        return plan
    if not (p.trace or p.n_probs) and (plan := _nucleus_plan_of(p, has_hist, n_vocab)) is not None:
        return plan
    tau = dense_plan(p, has_hist, n_vocab) if dense else None
    return None if tau is None else ("dense", 1.0 / tau)


@functools.lru_cache(maxsize=1024)
def _without_probs(p, has_hist: bool, n_vocab: int) -> tuple | None:
    """batch_plan of the same chain without nProbs (the candidates do not depend on it)."""
    return batch_plan(p.replace(n_probs=0), has_hist, n_vocab)


registry.on_change(_without_probs.cache_clear)


@functools.lru_cache(maxsize=1024)
def _nucleus_plan_of(p, has_hist: bool, n_vocab: int) -> tuple | None:
    """("topk", None, top_p, temperature or None) for a chain that is top-p first (no
    temperature before it), then at most a positive temperature (the caller has ruled
    out nProbs and trace); None otherwise."""
    sh = forms.shape(p, has_hist, n_vocab)
    if sh is None or sh.touch or sh.k is not None:
        return None
    return ("topk", None, sh.mass, sh.divide)


registry.on_change(_nucleus_plan_of.cache_clear)
