"""The sampler steps, one row each: the one place that says what a step is.

A row names the step (and the spelling a client may also use in ``samplers``), says
what kind of step it is, when it is an identity for the given params (the chain skips
it then), when it truncates, how it runs from the params (``steps`` holds the
definitions), which tokens it touches when elementwise, how the chain finds a superset
of what it keeps without scanning the row when it is the first truncation, and what
an empty candidate set after it means. ``params`` validates ``samplers`` against these
rows and ``chain`` composes them; adding a step is one definition in ``steps`` and one
row here.

Kinds:
- constraint: the grammar. Always first when the caller passes a bitmask, never run by
  name: the chain lists or counts the allowed tokens instead.
- elementwise: changes the logits of a small, known set of tokens (``touches``) and
  leaves every other token as it is.
- truncation: keeps an upper set of the current candidates (all tokens at or above
  some logit), so ``cut`` can find a superset of it from the row's column maxima.
- scale: temperature. Divides every logit; at t <= 0 it is greedy, a truncation to the
  first candidate in canonical order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import steps as S
from .bitmask import allows
from .candidates import dense_exp, gather
from .cut import RowView, isin_sorted, upper_ids

if TYPE_CHECKING:
    from .params import SamplerParams

__all__ = ["Step", "STEPS", "STEP_NAMES", "BY_NAME", "ALIASES", "EMPTY_REASONS",
           "CONSTRAINT", "ELEMENTWISE", "TRUNCATION", "SCALE"]

CONSTRAINT, ELEMENTWISE, TRUNCATION, SCALE = "constraint", "elementwise", "truncation", "scale"

#: (ids sorted, counts) of the penalty window.
Hist = tuple[np.ndarray, np.ndarray]
#: (view, params, tau, words, frac, touched, touched logits) -> (ids, rest_mass)
Cut = Callable[[RowView, "SamplerParams", float, "np.ndarray | None", float, np.ndarray, np.ndarray],
               tuple[np.ndarray, float]]


def _never(p: "SamplerParams", n_allowed: int) -> bool:
    return False


@dataclass(frozen=True, eq=False)
class Step:
    """One sampler step.

    name: the canonical name (in ``samplers``, timings and empty reasons).
    kind: CONSTRAINT, ELEMENTWISE, TRUNCATION or SCALE (see the module docstring).
    run(ids, logits, params, hist): the step over a candidate set (None: not run by name).
    off(params, has_hist): True when the step is an identity for these params.
    alias: another spelling accepted in ``samplers`` (camelCase, as the protocol's fields).
    truncates(params, n_allowed): True when it may drop candidates out of n_allowed.
    touches(params, hist): ELEMENTWISE only: the sorted ids whose logits it may change.
    cut: TRUNCATION and SCALE: when this step is the first truncation, the ids of a
      superset of what it keeps among the allowed raw tokens outside ``touched``, and the
      mass (relative to the largest candidate) of those tokens left out; a non-zero mass
      is passed to ``run`` as a fifth argument.
    empty: why the candidate set is empty when this step emptied it (None: the generic
      "no candidate left after <name>").
    """

    name: str
    kind: str
    run: Callable | None
    off: Callable[["SamplerParams", bool], bool]
    alias: str | None = None
    truncates: Callable[["SamplerParams", int], bool] = _never
    touches: Callable[["SamplerParams", Hist], np.ndarray] | None = None
    cut: Cut | None = None
    empty: str | None = None


# ------------------------------------------------------------------ cuts (first truncation)


def _upper_k(k: int) -> Cut:
    """Any k-truncation: the upper set of at least k raw tokens."""
    def cut(view, p, tau, words, frac, touched, t_logits):
        return upper_ids(view, k(p), words, frac, touched), 0.0
    return cut


def _largest(view: RowView, tau: float, words, frac: float, touched: np.ndarray,
             t_logits: np.ndarray) -> float:
    """The largest candidate logit: the best allowed untouched raw token (over tau) or a
    touched one (-inf when there is none)."""
    top = upper_ids(view, 1, words, frac, touched)
    best = float(gather(view.row, top, tau).max()) if top.size else -math.inf
    return max(best, float(t_logits.max())) if t_logits.size else best


def _allowed_ge(view: RowView, t: float, words, touched: np.ndarray) -> np.ndarray:
    """ids of the allowed raw tokens outside ``touched`` with row[i] >= t."""
    ids = view.ge(t)
    if words is not None:
        ids = ids[allows(words, ids)]
    if touched.size:
        ids = ids[~isin_sorted(ids, touched)]
    return ids


def _min_p_cut(view: RowView, p: "SamplerParams", tau: float, words, frac: float,
               touched: np.ndarray, t_logits: np.ndarray) -> tuple[np.ndarray, float]:
    """Every raw token within log(min_p) of the largest candidate logit."""
    vmax = _largest(view, tau, words, frac, touched, t_logits)
    if not vmax > -math.inf:
        return upper_ids(view, view.n, words, frac, touched), 0.0
    t = (vmax + math.log(p.min_p)) * tau
    t -= (abs(t) + 1.0) * 1e-6  # a slightly larger superset absorbs rounding
    return _allowed_ge(view, t, words, touched), 0.0


def _nucleus_cut(view: RowView, p: "SamplerParams", tau: float, words, frac: float,
                 touched: np.ndarray, t_logits: np.ndarray) -> tuple[np.ndarray, float]:
    """Untouched allowed tokens that, with the touched ones, form a superset of the
    nucleus, and the mass of the allowed untouched tokens left out. One exp pass."""
    ref = _largest(view, tau, words, frac, touched, t_logits)
    if not ref > -math.inf:
        return upper_ids(view, view.n, words, frac, touched), 0.0
    buf, z_out = dense_exp(view, tau, words, touched, ref)
    t_e = np.exp(t_logits - ref)
    target = p.top_p * (z_out + float(t_e.sum())) * (1 + 1e-5)
    for delta in (6.0, 12.0, 24.0, 48.0):
        t_v = ref - delta
        ids = _allowed_ge(view, t_v * tau, words, touched)
        mass = float(np.add.reduce(buf[ids], dtype=np.float64))
        if mass + float(t_e[t_logits >= t_v].sum()) >= target:
            return ids, max(z_out - mass, 0.0)
    return upper_ids(view, view.n, words, frac, touched), 0.0


# ------------------------------------------------------------------ the table

#: Every step, in the default order.
STEPS: tuple[Step, ...] = (
    Step("grammar", CONSTRAINT, run=None, off=lambda p, has_hist: True,
         empty="the grammar allows no token"),
    Step("logit_bias", ELEMENTWISE, alias="logitBias",
         run=lambda ids, logits, p, hist: S.logit_bias(ids, logits, *p.bias_arrays),
         off=lambda p, has_hist: not p.logit_bias,
         touches=lambda p, hist: p.bias_arrays[0],
         empty="logit_bias bans every token still allowed"),
    Step("penalties", ELEMENTWISE,
         run=lambda ids, logits, p, hist: S.penalties(ids, logits, *hist, p.penalty_repeat,
                                                      p.penalty_freq, p.penalty_present),
         off=lambda p, has_hist: not has_hist or not p.penalties_active,
         touches=lambda p, hist: hist[0]),
    Step("top_k", TRUNCATION, alias="topK",
         run=lambda ids, logits, p, hist: S.top_k(ids, logits, p.top_k),
         off=lambda p, has_hist: p.top_k <= 0,
         truncates=lambda p, n_allowed: 0 < p.top_k < n_allowed,
         cut=_upper_k(lambda p: p.top_k)),
    Step("min_p", TRUNCATION, alias="minP",
         run=lambda ids, logits, p, hist: S.min_p(ids, logits, p.min_p),
         off=lambda p, has_hist: p.min_p <= 0,
         truncates=lambda p, n_allowed: p.min_p > 0,
         cut=_min_p_cut),
    Step("top_p", TRUNCATION, alias="topP",
         run=lambda ids, logits, p, hist, rest_mass=0.0: S.top_p(ids, logits, p.top_p, rest_mass),
         off=lambda p, has_hist: p.top_p >= 1,
         truncates=lambda p, n_allowed: p.top_p < 1,
         cut=_nucleus_cut),
    Step("temperature", SCALE, alias="temp",
         run=lambda ids, logits, p, hist: S.temperature(ids, logits, p.temperature),
         off=lambda p, has_hist: p.temperature == 1.0,
         truncates=lambda p, n_allowed: p.temperature <= 0,
         cut=_upper_k(lambda p: 1)),  # greedy: the canonical first candidate
)

STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)
BY_NAME: dict[str, Step] = {s.name: s for s in STEPS}
#: Accepted spellings in ``samplers`` -> canonical step name.
ALIASES: dict[str, str] = {**{s.name: s.name for s in STEPS},
                           **{s.alias: s.name for s in STEPS if s.alias}}
#: Why a candidate set became empty, by what emptied it ("sample": nothing drawable).
EMPTY_REASONS: dict[str, str] = {**{s.name: s.empty for s in STEPS if s.empty},
                                 "sample": "no candidate has a finite logit"}
