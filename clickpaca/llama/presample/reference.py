"""What the graph's ops hand back for one row, computed with numpy: the exact reference
of graph.py's ops. tests/test_presample.py holds the graph to it, and the fast path's
property tests run on it without a model.
"""

from __future__ import annotations

import numpy as np

from .rows import BLOCK, DENSE_BLOCKS, Preselected, RowOrder


def reference(row: np.ndarray, o: RowOrder, k: int | None = None) -> Preselected:
    """What the graph's ops hand back for one row, computed with numpy: the exact
    reference of `graph.build` (tests/test_presample.py holds the graph to it, and
    the fast path's property tests run on it without a model). ``k``: default the
    order's own, which is what `Presampler.read` hands back; the micro-batch's K (the
    largest order's) gives what the graph's ops computed, before `read` keeps the row's
    own. Ties at the K-th value are broken by the smaller id here; the graph may pick
    any of the tied ids."""
    x = np.asarray(row, np.float32)
    V = x.size
    k = min(V, k or o.k)
    y = x
    if o.mask is not None:
        bits = np.unpackbits(np.asarray(o.mask, np.uint8), bitorder="little")[:V]
        y = np.where(bits == 1, x, np.float32(-np.inf)).astype(np.float32)
    top = np.float32(y[int(np.argmax(y))])
    ids = (np.array([np.argmax(y)]) if k == 1 else np.argsort(-y, kind="stable")[:k]).astype(np.int32)
    e, z = _softmax(y * np.float32(o.inv_tau))
    e = e * z  # over the top's probability, as `read` does
    nb = -(-V // BLOCK)
    ep = np.zeros(nb * BLOCK, np.float64)
    ep[:V] = e
    blocks = ep.reshape(nb, BLOCK).sum(axis=1)
    if not (o.mass or o.u is not None):
        blocks = None
    dense = None
    if o.u is not None:
        cum = np.cumsum(blocks.astype(np.float32), dtype=np.float32)
        b = int((cum < np.float32(cum[-1] * np.float32(o.u))).sum())
        dense = {}
        for d in range(-1, DENSE_BLOCKS - 1):
            bb = min(max(b + d, 0), nb - 1)
            dense[bb] = ep[bb * BLOCK:(bb + 1) * BLOCK].copy()
    raw_max = raw_mass = raw_ids = raw_vals = None
    if o.raw:
        raw_max = float(x.max())
        raw_mass = _softmax(x)[1]
        if o.mask is not None:
            raw_ids = np.argsort(-x, kind="stable")[:k].astype(np.int32)
            raw_vals = x[raw_ids]
    return Preselected(order=o, ids=ids, vals=y[ids], top=float(top), blocks=blocks, dense=dense,
                       raw_max=raw_max, raw_mass=raw_mass, raw_ids=raw_ids, raw_vals=raw_vals,
                       touched=x[o.touched] if o.touched.size else np.empty(0, np.float32))


def _softmax(v: np.ndarray) -> tuple[np.ndarray, float]:
    """ggml's soft_max of a row, and the sum it divided by relative to the max (1 / the
    top's probability): float32 exp(v - max), summed in float64, scaled by 1/sum."""
    m = np.float32(v.max())
    e = np.exp(v - m).astype(np.float32)
    total = float(e.sum(dtype=np.float64))
    p = (e * np.float32(1.0 / total)).astype(np.float32)
    return p, 1.0 / float(p[int(np.argmax(v))])
