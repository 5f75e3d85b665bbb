"""Which path samples a row: the one place that decides it, once per chain.

`plan(p, has_hist, n_vocab)` is a chain's `ChainPlan`, made once per chain (every
parameter but the seed), penalty history or not, and vocabulary, from the registry rows
of its active steps (forms.shape reads their declared batched forms): whether the chain
runs on the values the decode pre-selects (``fallback`` None) or why not, which batched
pass takes its row on the host (``host``) and on the pre-selected values (``tick``), and
whether it may run on a worker thread. The passes (batch.py, fastpath.py,
fastpath_touched.py, fastpath_dense.py) carry out what it says and decide nothing.
A row that takes the host path says why with a `Fallback`, the typed reason a done's
``samplingPath`` counts; the pre-selection's refusals after the decode are `Fallback`s too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from . import forms, registry
from .chain import SequenceSampler, greedy_tail, steps_to_run
from .cut import default_cols
from .table import TEMPERATURE

__all__ = ["ChainPlan", "Fallback", "KMAX", "path", "per_chain", "plan", "route"]

#: The largest top-k run batched (the [n, k] matrices stay small).
KMAX = 256


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


class _Route(tuple):
    """A pass of `ChainPlan.tick`, compared and hashed by identity: there is one per chain and
    order shape, so a tick groups its rows by the object itself (a tuple's hash is
    recomputed at every lookup)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other


@dataclass(frozen=True, slots=True, eq=False)
class ChainPlan:
    """What is decided about one chain (`plan`). The passes, as tuples their modules read:

    - ``fallback``: None when the chain runs on pre-selected values, else why not;
    - ``host``: the host's batched pass (batch.sample_tick) of a row without a grammar:
      ("greedy",) or ("topk", k, top_p or None, temperature or None); None: per row;
    - ``thread_safe``: no active step reads shared state (its row's ``shared_state``), so
      the row may be sampled on a worker thread (user steps say they do);
    - ``touched``: (the touching steps, k, top_p, temperature) for fastpath_touched;
    - ``probs``: ``host`` of the same chain without nProbs (the candidates do not depend on
      it), nProbs appended, where nProbs stay within its k;
    - ``nucleus``: ("topk", None, top_p, temperature or None) for a chain that is top-p
      first, then at most a positive temperature;
    - ``dense``: the temperature (1.0: none) of a draw over the whole vocabulary.
    """

    fallback: Fallback | None
    host: tuple | None
    thread_safe: bool
    touched: tuple | None
    probs: tuple | None
    nucleus: tuple | None
    dense: float | None
    _ticks: dict = field(default_factory=dict, repr=False)

    def tick(self, masked: bool, touched: bool, mass: bool, raw: bool, dense: bool) -> _Route | None:
        """Which of fastpath.sample_tick's batched passes takes a pre-selected row, from
        what its order asked of the graph (a grammar mask, touched ids, the block masses,
        the raw normaliser, a dense draw): ("greedy",), ("topk", k, top_p, temperature[,
        n_probs]) (k None: top-p first), ("touched", `touched`), ("dense", 1 / tau), or
        None (per row). One object per order shape. A masked row's pass holds only while
        its K values are all finite (the caller checks)."""
        key = (masked, touched, mass, raw, dense)
        r = self._ticks.get(key, _UNKEPT)
        if r is _UNKEPT:
            got = self._tick(*key)
            r = self._ticks[key] = None if got is None else _Route(got)
        return r

    def _tick(self, masked: bool, touched: bool, mass: bool, raw: bool, dense: bool) -> tuple | None:
        if touched:
            return None if masked or self.touched is None else ("touched", self.touched)
        got = self.host  # None with nProbs
        if got is None and self.probs is not None and not masked and mass and not raw:
            got = self.probs  # nProbs from the same candidates (the raw normaliser from the masses)
        if got is not None or masked or not mass:
            return got
        if self.nucleus is not None:
            return self.nucleus
        return ("dense", 1.0 / self.dense) if dense and self.dense is not None else None


def route(s: SequenceSampler, grammar: bool, rows: int = 1) -> Fallback | None:
    """None when the sequence's chain runs on pre-selected values, else why not.
    ``rows``: the logits rows the sequence's job asked of this decode."""
    if rows != 1:
        return MORE_THAN_ONE_ROW
    return plan(s.params, s.penalizes, s.n_vocab).fallback


def path(fallback: Fallback | None) -> str:
    """A result's ``path``: "graph" (decided on pre-selected values) or "host: <why>"."""
    return "graph" if fallback is None else f"host: {fallback}"


@per_chain
def plan(p, has_hist: bool, n_vocab: int) -> ChainPlan:
    """The chain's `ChainPlan` (params p, with a penalty history or not), kept per chain."""
    active, first = steps_to_run(p, has_hist, n_vocab)
    sh = forms.shape(p, has_hist, n_vocab)
    plain = not (p.trace or p.n_probs)  # no trace, no nProbs: what the batched passes take
    return ChainPlan(
        fallback=_fallback(p, active, first),
        host=_host(p, sh, has_hist, n_vocab),
        thread_safe=not any(st.shared_state for st in active),  # the same steps whatever the grammar allows
        touched=(sh.touch, sh.k, sh.mass, sh.divide)
        if plain and sh is not None and sh.touch and sh.k is not None and 1 < sh.k <= KMAX else None,
        probs=_probs(p, has_hist, n_vocab),
        nucleus=("topk", None, sh.mass, sh.divide)
        if plain and sh is not None and not sh.touch and sh.k is None else None,
        dense=_dense(p, active, first),
    )


def _fallback(p, active, first) -> Fallback | None:
    """ChainPlan.fallback: from the registry rows of the chain's active steps."""
    if p.trace:
        return TRACE
    for step in active:
        if not step.preselected:
            return Fallback.step(step.name)
    if first is None and any(st.touches is not None for st in active):
        return DENSE_TOUCHED
    return None


def _host(p, sh: forms.Shape | None, has_hist: bool, n_vocab: int) -> tuple | None:
    """ChainPlan.host (``sh``: the chain's forms.shape)."""
    if p.trace or p.n_probs:
        return None
    if greedy_tail(p, has_hist, n_vocab) is not None:
        return ("greedy",)
    if sh is None or sh.touch or sh.k is None or not 1 < sh.k <= min(KMAX, default_cols(n_vocab)):
        return None
    return ("topk", sh.k, sh.mass, sh.divide)


def _probs(p, has_hist: bool, n_vocab: int) -> tuple | None:
    """ChainPlan.probs: the host pass of the chain without nProbs, nProbs appended, where
    that pass is a top-k holding them."""
    if not p.n_probs or p.trace:
        return None
    q = p.replace(n_probs=0)
    got = _host(q, forms.shape(q, has_hist, n_vocab), has_hist, n_vocab)
    return got + (p.n_probs,) if got is not None and got[0] == "topk" and p.n_probs <= got[1] else None


def _dense(p, active, first) -> float | None:
    """ChainPlan.dense: no trace, no truncation, and every active step pre-selectable and
    touching nothing."""
    if p.trace or first is not None or any(not st.preselected or st.touches is not None for st in active):
        return None
    return p.temperature if TEMPERATURE in active else 1.0
