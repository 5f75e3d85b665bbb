"""A chain's shape in the batched passes, read from its rows' declared forms.

Each step's row declares its batched form beside its scalar `run` (registry.Batched): keep
the k best, keep a share of the mass, divide, or touch a few ids. This module is the one
place that says which batched arithmetic a chain's active steps add up to; route.py
reads its `Shape` once per chain to pick the batched pass (batch.py on the host,
fastpath_touched.py on the pre-selected values), and nothing compares a step's name. So
a step joins a batched pass by declaring a form on its row, and
tests/test_sampling_forms.py holds every declared form against the row's own `run`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import registry as R
from .chain import prefix_and_tail
from .registry import DIVIDE, KEEP_K, KEEP_MASS, TOUCH, Step

__all__ = ["Shape", "shape"]

#: the orders of forms after the touching steps that the passes compute
_TAILS = ((KEEP_K,), (KEEP_K, KEEP_MASS), (KEEP_K, DIVIDE), (KEEP_K, KEEP_MASS, DIVIDE),
          (KEEP_MASS,), (KEEP_MASS, DIVIDE))


@dataclass(frozen=True, slots=True)
class Shape:
    """A chain as the batched passes compute it: its touching steps, in chain order, then
    keep the k best (k None: not in the chain), keep `mass` of the mass, divide by
    `divide` (positive)."""

    touch: tuple[Step, ...]
    k: int | None
    mass: float | None
    divide: float | None


def shape(p, has_hist: bool, n_vocab: int) -> Shape | None:
    """The chain's Shape (params p, with a penalty history or not; route.plan keeps it);
    None where a pass cannot compute it: a trace (kept step by step), an active step
    without a form or with a form a pass does not take at its place, params its form does
    not carry (a forcing bias), or a temperature that is greedy."""
    split = prefix_and_tail(p, has_hist, n_vocab)
    if split is None:
        return None
    prefix, tail = split
    if any(R.form(st) != TOUCH or not st.batched.carries(p) for st in prefix):
        return None
    forms = tuple(R.form(st) for st in tail)
    if forms not in _TAILS:
        return None
    values = {f: st.batched.value(p) for f, st in zip(forms, tail)}
    if DIVIDE in values and values[DIVIDE] <= 0:
        return None
    return Shape(tuple(prefix), values.get(KEEP_K), values.get(KEEP_MASS), values.get(DIVIDE))

