"""Which path samples a row, and why a row takes the host path: the one place that
decides it. `route` says, from the registry rows of a chain's active steps, whether the
chain can run on the values the decode pre-selects (None) or needs the whole row (a
`Fallback`); the pre-selection's own refusals after the decode are `Fallback`s too, as is
every other reason a row comes back whole. `path` is what a result's ``path`` says.
The decision is kept per chain (`per_chain`, the cache the fast path's plans use too).
"""

from __future__ import annotations

import functools

from . import registry
from .chain import SequenceSampler, steps_to_run


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
