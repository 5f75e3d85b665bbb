"""What a sampled row asks of the decode graph and what it gets back: `RowOrder` (one
row's request), `Layout` (where each piece sits in the float32 row the graph packs) and
`Preselected` (a packed row decoded for the fast path). Plain data shared by every other
module of the package; the block size the host path's dense draw shares lives here too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


#: tokens per mass block (the host path's dense draw uses the same: sampling/candidates.py)
BLOCK = 1024
#: blocks handed back around the one where a dense draw lands
DENSE_BLOCKS = 3


@dataclass(slots=True)
class RowOrder:
    """What one sampled row asks of the graph (made once per row and tick and not changed
    after: not frozen, whose __init__ costs three times a plain one's).

    k: top ids wanted (the graph gives the tick's largest k to every row); when the
      largest is 1, the one id is a top-k of 1 (the first of equal maxima: the canonical
      first token; ggml's CPU argmax would keep the last);
    mass: the block masses (and the max they are taken from) are wanted;
    inv_tau: 1/temperature for the masses (1.0 when no temperature applies);
    touched: int32 ids whose raw logits the host adjusts (bias, penalties);
    u: the uniform of a draw over the whole set (None: no dense draw);
    raw: the raw row's own max, mass and top ids are wanted (nProbs when y is not x at tau 1);
    mask: the grammar's bitmask as uint8 bytes (None: no grammar)."""

    k: int
    mass: bool = True
    inv_tau: float = 1.0
    touched: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    u: float | None = None
    raw: bool = False
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class Layout:
    """Where each piece sits in a packed row (float32 offsets); one per micro-batch graph."""

    k: int
    n_blocks: int
    n_touched: int
    dense: bool
    raw: bool
    raw_top: bool
    mass: bool = True

    @functools.cached_property
    def pieces(self) -> list[tuple[str, int]]:
        out = [("vals", self.k), ("ids", self.k)]
        if self.mass:
            out += [("top", 1), ("p_top", 1), ("blocks", self.n_blocks)]
        if self.dense:
            out += [("dense_ids", DENSE_BLOCKS), ("dense", DENSE_BLOCKS * BLOCK)]
        if self.raw:
            out += [("raw_max", 1), ("raw_p_max", 1)]
            if self.raw_top:
                out += [("raw_vals", self.k), ("raw_ids", self.k)]
        if self.n_touched:
            out += [("touched", self.n_touched)]
        return out

    @functools.cached_property
    def size(self) -> int:
        return sum(n for _, n in self.pieces)

    @functools.cached_property
    def at(self) -> dict[str, slice]:
        """Each piece's columns in a packed row."""
        out, at = {}, 0
        for name, n in self.pieces:
            out[name] = slice(at, at + n)
            at += n
        return out


@dataclass(slots=True)
class Preselected:
    """One row's pre-selection, decoded from its packed floats (see the package doc).

    ids/vals: the K best of y (the row with the grammar applied), in canonical order
    (value descending, then id; the fast path reads a row's k best as its first k):
    disallowed tokens may appear with -inf when fewer than K are allowed. top: y's max.
    blocks: the masses exp((y - top) * inv_tau) summed per BLOCK tokens (ggml's softmax in float32,
    summed in float64 per block, over the top's probability; None when not ordered).
    dense: {block id: its BLOCK masses} around the draw.
    raw_max/raw_mass: the raw row's max and sum exp(x - max) (None: y is x and inv_tau 1,
    so top/blocks serve). raw_ids/raw_vals: x's own K best (None: ids/vals serve).
    touched: x at the order's touched ids."""

    order: RowOrder
    ids: np.ndarray
    vals: np.ndarray
    top: float
    blocks: np.ndarray | None
    dense: dict[int, np.ndarray] | None
    raw_max: float | None
    raw_mass: float | None
    raw_ids: np.ndarray | None
    raw_vals: np.ndarray | None
    touched: np.ndarray

    @property
    def floor(self) -> float:
        """Every token outside ``ids`` has y <= this (the K-th best value): a decision is
        exact when what it keeps lies strictly above it."""
        return float(self.vals.min()) if self.vals.size else np.inf

    @property
    def first(self) -> bool:
        """``ids`` is a greedy graph's one id: the canonical first token itself (the
        largest value, the smallest id among equal ones), exact whatever ties."""
        return self.ids.size == 1
