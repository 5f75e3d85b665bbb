"""Packed rows to `Preselected`: the float32 rows the graph hands back, decoded for the
fast path as [m, size] matrices (a Python pass per row would cost what the fast path
saves), each row keeping only what its own order asked for.
"""

from __future__ import annotations

import functools

import numpy as np

from ...base.order import canonical_keys, is_canonical, strictly_descending
from .rows import DENSE_BLOCKS, BLOCK, Layout, Preselected, RowOrder


def unpack(packed: np.ndarray, lay: Layout, orders: list[RowOrder]) -> list[Preselected]:
    """The Preselected of each packed row ([m, lay.size] float32, one per order). The
    graph's masses are softmax probabilities: over the top's they are exp((y - top) /
    tau); every row is computed as it would be alone (elementwise, or per row)."""
    at = lay.at
    m = packed.shape[0]
    # the pieces "vals", "ids" (and "raw_vals", "raw_ids") lie side by side
    ids, vals, clean = _own_best_rows(packed[:, :2 * lay.k], lay.k)
    z = None
    if lay.mass:  # as float32(1 / p_top) times each float32 mass, the read of one row
        z = (1.0 / packed[:, at["p_top"].start].astype(np.float64)).astype(np.float32)[:, None]
    blocks = packed[:, at["blocks"]] * z if lay.mass else None
    tops = packed[:, at["top"].start].tolist() if lay.mass else None
    dense_ids = dense = None
    if lay.dense:
        dense_ids = packed[:, at["dense_ids"]].astype(np.int64).tolist()
        dense = packed[:, at["dense"]].reshape(m, DENSE_BLOCKS, BLOCK) * z[:, :, None]
    raw_ids = raw_vals = None
    if lay.raw:
        raw_max = packed[:, at["raw_max"].start].tolist()
        raw_mass = (1.0 / packed[:, at["raw_p_max"].start].astype(np.float64)).tolist()
        if lay.raw_top:
            r = at["raw_vals"].start
            raw_ids, raw_vals, _ = _own_best_rows(packed[:, r:r + 2 * lay.k], lay.k)
    touched = packed[:, at["touched"]] if lay.n_touched else None
    if not lay.mass:  # y's max: the first of the sorted values, unless a NaN is among them
        first = vals[:, 0].tolist()
        nan = [False] * m if clean else np.logical_or.reduce(np.isnan(vals), axis=1).tolist()
    # one view per row, made in C (list() of a matrix), sliced only where a row's own k or
    # touched ids are fewer than the graph's (an index per row costs as much as the row)
    K, T = lay.k, lay.n_touched
    id_rows, val_rows = list(ids), list(vals)
    block_rows = list(blocks) if lay.mass else None
    touched_rows = list(touched) if touched is not None else None
    out = []
    for j, o in enumerate(orders):
        k = o.k
        own_ids, v = (id_rows[j], val_rows[j]) if k == K else (id_rows[j][:k], val_rows[j][:k])
        raw = lay.raw and o.raw
        raw_top = raw and lay.raw_top and o.mask is not None
        out.append(Preselected(
            o, own_ids, v,
            tops[j] if lay.mass else (float(v.max()) if nan[j] else first[j]),
            block_rows[j] if lay.mass and (o.mass or o.u is not None) else None,
            {int(b): dense[j, i] for i, b in enumerate(dense_ids[j])} if lay.dense and o.u is not None else None,
            raw_max[j] if raw else None,
            raw_mass[j] if raw else None,
            raw_ids[j, :k] if raw_top else None,
            raw_vals[j, :k] if raw_top else None,
            _NO_FLOATS if touched_rows is None else
            touched_rows[j] if o.touched.size == T else touched_rows[j][:o.touched.size]))
    return out


_NO_FLOATS = np.empty(0, np.float32)
_NO_FLOATS.flags.writeable = False


def _own_best_rows(head: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Each row's K values by value then id, from ``head`` ([m, 2K]: the K values, then
    their K ids as float32, as the graph packs them): ([m, K] int32 ids, [m, K] values,
    whether every row came strictly descending: no ties and no NaN, so a row's first value
    is its max). The first k of a row are its own k best, the same whatever the others'
    K. At K = 1 the one id is the smallest of equal maxima (the graph's top-k of 1 for a
    micro-batch of greedy rows)."""
    if k == 1:
        return head[:, 1:].astype(np.int32), head[:, :1], False
    # ggml's CPU top_k hands the K best back sorted by value but for its first two, which
    # it swaps on purpose: one gather puts them back (values and ids at once), and rows
    # already canonical need no sort (a check of a few passes against the keys' dozen and
    # an argsort); any other order is sorted
    g = head[:, _unswap_columns(k)]
    vals, ids = g[:, :k], g[:, k:].astype(np.int32)
    if strictly_descending(vals):
        return ids, vals, True
    if is_canonical(ids, vals):
        return ids, vals, False
    o = np.argsort(canonical_keys(ids, vals), axis=1)
    return np.take_along_axis(ids, o, 1), np.take_along_axis(vals, o, 1), False


@functools.lru_cache(maxsize=64)
def _unswap_columns(k: int) -> np.ndarray:
    """The columns of a [m, 2k] head (values, then ids) with each half's first two swapped."""
    sw = np.arange(k)
    sw[:2] = 1, 0
    return np.concatenate([sw, sw + k])
