"""One tick's sampling over a [n_out, n_vocab] logits block, batched where that is exact.

``sample_tick(samplers, logits, rows, masks)`` returns what
``[s.sample(logits[r], m) for s, r, m in ...]`` returns, bit for bit, in the same order,
drawing the same random numbers. Which rows run batched is route.py's decision
(``ChainPlan.host``): greedy (one argmax per row) and top-k, then optionally top-p and a
temperature > 0 (the default chain: the k best from column maxima, then top-p and the
draw on an [n, k] matrix in the per-sequence steps' element order, so every float64
reduction is the same). Every other row, and a row whose top is not finite, takes the
per-sequence path. With ``threads`` > 1 the row passes are spread over threads
(``workers.run_all``) without changing any result; chains with a step that reads shared
state (``ChainPlan.thread_safe``) stay on the calling thread. Costs: docs/BENCHMARKS.md, "Sampler host cost per token".
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from . import steps as S
from .chain import SampleResult, SequenceSampler
from .cut import default_cols
from .route import plan as chain_plan
from ..base.order import canonical_keys, is_canonical
from .params import SamplerParams
from .workers import run_all

__all__ = ["sample_tick", "topk_draw"]

_NEG_INF = -np.inf


def sample_tick(samplers: Sequence[SequenceSampler], logits: np.ndarray, rows: Sequence[int],
                masks: Sequence[np.ndarray | None] | None = None,
                isolate: tuple[type[BaseException], ...] = (), threads: int = 1) -> list:
    """Sample one token for each (sampler, row of ``logits``, grammar mask or None).

    ``logits`` is the decode's [n_out, n_vocab] float32 block (only read); the samplers
    are distinct. An exception of a type in ``isolate`` (the engine passes a user step's
    StepFailed) raised by one sequence's ``sample`` takes that sequence's place in the
    list instead of a SampleResult, so the other sequences of the tick still get theirs;
    any other exception propagates. ``threads``: how many threads may share the tick's
    row passes (1: all on the calling thread, in tick order)."""
    logits = np.asarray(logits)
    n = len(samplers)
    out: list[SampleResult | None] = [None] * n
    anywhere: list[int] = []  # per sequence, on any thread
    here: list[int] = []  # per sequence, on this thread
    greedy: list[int] = []
    topk: dict[tuple, list[int]] = {}
    for j, s in enumerate(samplers):
        mask = masks[j] if masks is not None else None
        p = s.params
        has_hist = s.penalizes
        decided = chain_plan(p, has_hist, s.n_vocab)
        plan = None
        if mask is None and logits.ndim == 2 and logits.shape[1] == s.n_vocab:
            plan = decided.host
        if plan is None:
            (anywhere if threads > 1 and decided.thread_safe else here).append(j)
        elif plan[0] == "greedy":
            greedy.append(j)
        else:
            topk.setdefault(plan[1:], []).append(j)

    def one(j: int) -> None:
        try:
            out[j] = samplers[j].sample(logits[rows[j]], masks[j] if masks is not None else None)
        except isolate as e:
            out[j] = e

    tasks: list = [functools.partial(one, j) for j in anywhere]  # the slow rows first
    g = _greedy_tasks(logits, rows, greedy, threads, tasks) if greedy else None
    parts = {key: _topk_tasks(logits, rows, js, key[0], tasks) for key, js in topk.items()}
    run_all(tasks, threads)
    for j in here:
        one(j)
    if greedy:
        _greedy(samplers, logits, rows, greedy, g, out)
    for (k, top_p, temp), js in topk.items():
        topk_draw(samplers, js, k, top_p, temp, parts[(k, top_p, temp)], out,
                  lambda j: samplers[j].sample(logits[rows[j]]))
    return out  # type: ignore[return-value]


def _greedy_tasks(logits, rows, js, threads, tasks) -> np.ndarray:
    """Tasks that fill the argmax of each greedy row (in chunks, one per thread), and
    the array they fill."""
    r = np.fromiter((rows[j] for j in js), np.intp, len(js))
    first = np.empty(r.size, np.intp)
    lo = _contiguous(r)
    edges = np.linspace(0, r.size, min(max(int(threads), 1), r.size) + 1).astype(np.intp).tolist()

    def chunk(a: int, b: int) -> None:
        if lo is not None:  # one call over a slice of the block (no copy)
            first[a:b] = logits[lo + a: lo + b].argmax(axis=1)
        else:
            for x in range(a, b):
                first[x] = logits[r[x]].argmax()
    tasks.extend(functools.partial(chunk, a, b) for a, b in zip(edges, edges[1:]))
    return first


def _greedy(samplers, logits, rows, js, first, out) -> None:
    r = np.fromiter((rows[j] for j in js), np.intp, len(js))
    ok = logits[r, first] > _NEG_INF  # NaN and -inf tops: per sequence
    for j, tok, good in zip(js, first.tolist(), ok.tolist()):
        s = samplers[j]
        if not good:
            out[j] = s.sample(logits[rows[j]])
            continue
        s.draw()  # the draw sample() makes (the stream stays aligned)
        out[j] = SampleResult(tok, n_candidates=1)


def _contiguous(r: np.ndarray) -> int | None:
    """r[0] when r is r[0], r[0]+1, ... (a slice of the block, no copy), else None."""
    return int(r[0]) if r.size and int(r[-1]) - int(r[0]) == r.size - 1 and (np.diff(r) == 1).all() else None


def _topk_tasks(logits, rows, js, k, tasks) -> list:
    """One task per row that finds a threshold t with >= k tokens >= t and the tokens
    >= t (ids ascending, their values), into the returned list: (t, ids, values)."""
    V = logits.shape[1]
    cols = default_cols(V)
    nr = V // cols
    head_n = nr * cols
    res: list = [None] * len(js)

    def one(a: int, i: int) -> None:
        # Per row while it is in cache (a 64-row block is far bigger than the cache): column
        # maxima, the k-th largest of them (and of the tail) as a threshold t, and the
        # tokens >= t from the columns that reach it.
        row = logits[i]
        head = row[:head_n].reshape(nr, cols)
        colmax = np.fmax.reduce(head, axis=0)
        cand = colmax if head_n == V else np.concatenate((colmax, row[head_n:]))
        t = np.partition(cand, cand.size - k)[cand.size - k]  # the value argpartition's index has
        sel = np.flatnonzero(colmax >= t)
        block = head.take(sel, axis=1)
        ri, ci = np.nonzero(block >= t)
        ids = ri * cols + sel[ci]
        if head_n < V:
            ids = np.concatenate((ids, np.flatnonzero(row[head_n:] >= t) + head_n))
        res[a] = (t, ids, row[ids])
    tasks.extend(functools.partial(one, a, rows[j]) for a, j in enumerate(js))
    return res


def _k_first(seq: np.ndarray, ids: np.ndarray, v: np.ndarray, m: int, k: int):
    """([m, k] ids, [m, k] values, counts[m]): each row's k first candidates in canonical
    order (value descending, then id ascending), in no particular order within the row;
    ``seq`` (ascending) names each candidate's row, ``v`` has no NaN. A row with fewer
    than k candidates gets any k entries (the caller sends it per sequence). Each row on
    its own, on a [m, W] matrix padded with -inf at the largest id (after every real
    candidate in canonical order): the k-th largest value by a partition, the values
    above it and the ties at it with the smallest ids, the set a full sort's first k hold."""
    counts = np.bincount(seq, minlength=m)
    width = max(int(counts.max()) if m else 0, k)
    if seq.size == m * width:  # every row has width candidates: no padding
        vv, ii = v.reshape(m, width), ids.reshape(m, width)
    else:
        pos = np.arange(seq.size) - (np.cumsum(counts) - counts)[seq]
        vv = np.full((m, width), _NEG_INF)
        vv[seq, pos] = v
        ii = np.full((m, width), np.iinfo(np.int32).max, np.int64)
        ii[seq, pos] = ids
    if width == k:
        return ii, vv, counts
    kth = np.partition(vv, width - k, axis=1)[:, width - k]
    keep = vv >= kth[:, None]
    n_keep = keep.sum(axis=1)
    for a in np.flatnonzero(n_keep != k).tolist():  # ties at the k-th value, or too few rows
        row = np.zeros(width, bool)
        row[np.lexsort((ii[a], -vv[a]))[:k]] = True
        keep[a] = row
    return ii[keep].reshape(m, k), vv[keep].reshape(m, k), counts


def _take(idx: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """np.take_along_axis(a, idx, 1) of each [m, n] a (all of one shape) for [m, k] idx,
    through flat takes with one flat index."""
    m, n = arrays[0].shape
    flat = idx + (np.arange(m) * n)[:, None]
    return tuple(np.take(np.ascontiguousarray(a).reshape(-1), flat) for a in arrays)


def _canonical(ids: np.ndarray, v: np.ndarray) -> np.ndarray | None:
    """Per row of [m, n] (ids distinct within a row, v float64 without NaN), the
    positions in canonical order: value descending, id ascending (``steps.canonical_order``;
    what a lexsort((ids, -v)) gives). Values that are float32 (a logits row's) sort as one
    uint64 key per entry, the value's order-preserving bits above the id: one sort with
    distinct keys, whatever the sort's stability; other values by two stable sorts.
    Rows already in canonical order are checked, not sorted: None then."""
    m, n = v.shape
    if n > 1 and is_canonical(ids, v):
        return None
    f = v.astype(np.float32)
    if ids.size and (f == v).all() and ids.min() >= 0 and ids.max() < 2**32:
        return np.argsort(canonical_keys(ids, f), axis=1)
    by_id = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(by_id, np.argsort(-np.take_along_axis(v, by_id, 1), axis=1, kind="stable"), 1)


def topk_draw(samplers, js, k, top_p, temp, parts, out, fallback, path: str = "host",
              rest: np.ndarray | None = None, floor: np.ndarray | None = None,
              n_probs: int = 0, raw_lse: np.ndarray | None = None, past=None,
              best: tuple | None = None) -> None:
    """The draw of each top-k row from its candidates, on [m, k] matrices: ``parts[a]``
    is (t, ids, values) for row js[a], every token >= t among ids (``_topk_tasks``, or
    the decode's pre-selection: fastpath.py). A row the matrices cannot take (fewer than
    k candidates, a non-finite top) gets ``fallback(j)``. The pre-selection's top-p
    chains pass ``rest`` (per row, the mass exp(v - max) of the tokens outside the
    candidates, which top-p's total includes) and ``floor`` (per row, a value every
    token outside is at most): a row whose top-p keeps a value not above it gets
    ``past(j)`` (default ``fallback(j)``); with ``n_probs`` (at most k) and ``raw_lse``
    (per row, the raw row's log-normaliser) the results carry the log-probabilities, as
    ``SequenceSampler.sample`` computes them from the same candidates. ``best`` (with
    ``parts`` None): (t per row, [m, k] ids, [m, k] float64 values without NaN) where
    each row already holds its k first candidates in canonical order (the
    pre-selection's rows come sorted: fastpath.py, fastpath_touched.py): no selection
    and no sort then.

    Every reduction runs along a row of a C-contiguous [m, .] matrix (numpy reduces it as
    the 1-D row) and every order is a row's own, so a row's result does not depend on
    the other rows; the per-row Python is the draw and the result. (Reductions are the
    ufuncs' own: ndarray.max and .sum are Python-level wrappers, slow on the caches a
    decode leaves.)"""
    m = len(js)
    counts = None  # every row has its k (best)
    if best is not None:
        thr, can_ids, can_v = best
    else:
        thr = np.fromiter((t for t, _, _ in parts), np.float64, m)
        seq = np.repeat(np.arange(m), np.fromiter((ids.size for _, ids, _ in parts), np.intp, m))
        ids = np.concatenate([ids for _, ids, _ in parts])
        if seq.size == 0:
            for j in js:
                out[j] = fallback(j)
            return
        v = np.fmax(np.concatenate([v for _, _, v in parts]), _NEG_INF, dtype=np.float64)  # as candidates.gather
        # [m, k]: the k first of each row (a row with fewer, from NaN, goes per sequence below)
        can_ids, can_v, counts = _k_first(seq, ids, v, m, k)
        if n_probs or (top_p is not None and top_p < 1.0):  # in canonical order (cut and n best by rank)
            canon = _canonical(can_ids, can_v)  # None: already
            if canon is not None:
                can_ids, can_v = _take(canon, can_ids, can_v)
    o = np.argsort(can_ids, axis=1)  # the per-sequence set after top-k is in id order
    top_ids, top_v = _take(o, can_ids, can_v)  # the id-ordered entry p has canonical rank o[p]
    top_ids = top_ids.astype(np.int32)
    vmax = np.maximum.reduce(top_v, axis=1)
    bad = ~(np.isfinite(vmax) & np.isfinite(thr))  # +-inf or NaN: per sequence
    if counts is not None:
        bad |= counts < k  # fewer than k candidates (NaN): per sequence
    keep = np.ones((m, k), bool)
    cut = np.full(m, k - 1)  # the last canonical rank kept
    if top_p is not None and top_p < 1.0:
        with np.errstate(invalid="ignore"):  # rows with a non-finite top go per sequence
            e = np.exp(top_v - vmax[:, None])
            e_can = np.exp(can_v - vmax[:, None])  # the same values in canonical order
        cut = S.top_p_cut(S.top_p_target(e, top_p, 0.0 if rest is None else rest), e_can)  # the step's own
        keep = o <= cut[:, None]
    past_k = np.zeros(m, bool)
    if floor is not None:  # what top-p keeps must lie above every token left out
        past_k = ~bad & ~(np.minimum.reduce(np.where(keep, top_v, np.inf), axis=1) > floor)
    lg = np.where(keep, top_v, _NEG_INF)
    if temp is not None:
        with np.errstate(over="ignore"):
            lg = lg / temp
    lmax = np.maximum.reduce(lg, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(lg - lmax[:, None])
    c = np.add.accumulate(e, axis=1)
    last = k - 1 - np.argmax(keep[:, ::-1], axis=1)  # the last kept position (id order)
    size = np.add.reduce(keep, axis=1)
    good = ~bad & ~past_k & (lmax < np.inf)
    for a in np.flatnonzero(~good).tolist():  # a row sent per sequence takes no draw
        out[js[a]] = past(js[a]) if past is not None and past_k[a] else fallback(js[a])
    g = np.flatnonzero(good)
    if not g.size:
        return
    gl = g.tolist()
    u = np.fromiter((samplers[js[a]].draw() for a in gl), np.float64, g.size)
    cg, sz, la = (c, size, last) if g.size == m else (c[g], size[g], last[g])
    # each row's np.searchsorted(c[a], u * c[a, -1], side="right"): c never decreases
    jj = np.add.reduce(cg <= (u * cg[:, -1])[:, None], axis=1)
    pos = np.where(sz == 1, la, np.minimum(jj, la))
    tok = top_ids[g, pos]
    if not n_probs:
        for a, t, n in zip(gl, tok.tolist(), sz.tolist()):
            out[js[a]] = SampleResult(t, n_candidates=n, path=path)
        return
    # log-probabilities: raw over the row (its top n are the k's first n, canonical),
    # steered over the kept set (a canonical prefix: temperature keeps the order)
    lse = raw_lse[g]
    lse_st = np.array([lm + math.log(cl) for lm, cl in zip(lmax[g].tolist(), c[g, -1].tolist())])
    # the n first in canonical order: the canonical matrices' first columns (lg's values there)
    can_v = can_v[g, :n_probs]
    f_ids = can_ids[g, :n_probs].tolist()
    f_raw = (can_v - lse[:, None]).tolist()
    f_lg = np.where(np.arange(can_v.shape[1])[None, :] <= cut[g][:, None], can_v, _NEG_INF)
    if temp is not None:
        with np.errstate(over="ignore"):
            f_lg = f_lg / temp
    f_st = (f_lg - lse_st[:, None]).tolist()
    f_in = ((np.arange(can_v.shape[1])[None, :] < size[g][:, None]) & (f_lg > _NEG_INF)).tolist()
    lp = (top_v[g, pos] - lse).tolist()
    lp_st = (lg[g, pos] - lse_st).tolist()
    for x, (a, t, sz) in enumerate(zip(gl, tok.tolist(), size[g].tolist())):
        top = tuple(zip(f_ids[x], f_raw[x]))
        st = tuple((i, v) for i, v, ok in zip(f_ids[x], f_st[x], f_in[x]) if ok)
        out[js[a]] = SampleResult(t, False, None, sz, lp[x], top, lp_st[x], st, path=path)
