"""fastpath.sample_tick's batched rows with touched tokens: logit bias and penalties
before a top-k [top-p] [temperature] chain, for a whole tick at once.

A row qualifies (route.py's ``ChainPlan.touched``) when, without a grammar, nProbs or trace,
its steps before the first truncation all have a TOUCH form that carries its params (no
forced token), and the rest is what ``batch.topk_draw`` runs. `tick` then does what
``fastpath.sample`` does for such a row, for all of them together: the touched tokens' raw
values get each prefix step's batched form, declared on its row beside its scalar form
(registry.Batched; for logit bias and penalties steps.py's ``*_touched``: the same float64
arithmetic, with the counts the order kept), so the same bits as the host; top-k is exact
when its k values all lie above the row's floor
(the smallest untouched value handed back), else the row goes to ``fastpath.sample``
(PAST_K); the values above the floor, their first k in canonical order, go to
``batch.topk_draw``, the draw the host's batched rows use. A row pre-selected for another
plan, whose penalty window changed, or whose K best hold -inf also goes to
``fastpath.sample``. Every per-row quantity comes from that row's values alone, so a row's
answer does not depend on the other rows of its tick.
"""

from __future__ import annotations

import numpy as np

from .batch import topk_draw
from .chain import SequenceSampler

__all__ = ["tick"]


def _segments(row: np.ndarray, m: int) -> np.ndarray:
    """Per row a < m, how many entries of ``row`` (row indices) are a."""
    return np.bincount(row, minlength=m)


def tick(samplers, pres, groups: dict[tuple, list[int]], out: list, fallback) -> None:
    """Fill ``out[j]`` for the rows of ``groups`` ({("touched", `plan`): rows j}, one key
    per chain: the rows of a group share every parameter but the seed, and have no
    grammar): the answer, or ``fallback(j)`` (``fastpath.sample``) where the values cannot
    decide in the batch."""
    for (_, pl), g in groups.items():
        _group(samplers, pres, g, samplers[g[0]].params, pl, samplers[g[0]].n_vocab, out, fallback)


def _group(samplers, pres, js, p, pl, V, out, fallback) -> None:
    prefix, k, top_p, temp = pl
    wc = None
    if any(st.batched.counts for st in prefix):  # the window's counts of the touched ids, kept by the order
        wc = [samplers[j].order_counts(pres[j].order.touched) for j in js]
        if any(c is None for c in wc):  # the window changed since the order (or another made it): per row
            for j, c in zip(js, wc):
                if c is None:
                    out[j] = fallback(j)
            js, wc = [j for j, c in zip(js, wc) if c is not None], [c for c in wc if c is not None]
            if not js:
                return
    m = len(js)
    rows = np.arange(m)
    ps = [pres[j] for j in js]
    # the touched tokens of all rows side by side; keys row * V + id ascending
    t_list = [pr.order.touched for pr in ps]
    t_n = np.fromiter(map(len, t_list), np.intp, m)
    t_ids = np.concatenate(t_list)
    t_row = np.repeat(rows, t_n)
    t_key = t_row * V + t_ids
    raw = np.concatenate([pr.touched for pr in ps])
    v = np.fmax(raw, -np.inf, dtype=np.float64)  # as candidates.gather
    alive = np.ones(v.size, bool)
    ok = np.fromiter((pr.order.inv_tau == 1.0 for pr in ps), bool, m)
    counts = None if wc is None else np.concatenate(wc)
    for st in prefix:  # each touching step's batched form (registry.Batched, steps.py)
        rows_ok, removed = st.batched.touch(v, t_ids, t_row, m, p, counts)
        if rows_ok is not None:
            ok &= rows_ok
        if removed is not None:
            alive[removed] = False
    # The K best handed back. Without a grammar they are the raw row's, so a touched token
    # is among them when its raw value lies above the K-th value, may be when it equals it
    # (a tie: the graph picks), and is not when below: only the first two are looked up.
    k_list = [pr.ids for pr in ps]
    k_n = np.fromiter(map(len, k_list), np.intp, m)
    k_ids = np.concatenate(k_list)
    k_vals = np.concatenate([pr.vals for pr in ps])
    k_row = np.repeat(rows, k_n)
    ok &= k_n > 0
    finite = np.isfinite(k_vals)
    if not finite.all():  # -inf there: fewer allowed than K (or NaN)
        ok &= _segments(k_row[~finite], m) == 0
    k_start = np.cumsum(k_n) - k_n
    kth = np.full(m, np.inf, np.float32)
    some = k_n > 0
    kth[some] = np.minimum.reduceat(k_vals, k_start[some])
    t_kth = kth[t_row]
    maybe = np.flatnonzero(raw >= t_kth)  # above it: in there; equal to it (a tie): look
    t_in = t_key[maybe]  # sorted
    k_key = k_row * V + k_ids
    if t_in.size:
        at = np.searchsorted(t_in, k_key)
        at[at == t_in.size] = 0
        k_touched = t_in[at] == k_key
        k_of = maybe[at[k_touched]]  # the touched token each touched one of the K best is
        found = np.zeros(t_key.size, bool)
        found[k_of] = True
        ok &= _segments(t_row[(raw > t_kth) & ~found], m) == 0  # (the graph's values are the row's)
    else:
        k_touched = np.zeros(k_key.size, bool)
        k_of = np.empty(0, np.intp)
        found = np.zeros(t_key.size, bool)
    # the floor: the smallest untouched value handed back (inf: none, nothing is decided)
    floor = np.full(m, np.inf)
    floor[some] = np.minimum.reduceat(np.where(k_touched, np.float32(np.inf), k_vals), k_start[some])
    # Top-k keeps its whole-row set when its k values all lie above the floor, that is when
    # at least k values of the row's set do (else fastpath.sample refuses the row too:
    # PAST_K). Only those values go on: the untouched K best above the floor, and the
    # touched tokens above it that are not banned.
    t_above = alive & (v > floor[t_row])
    k_above = ~k_touched & (k_vals > floor[k_row])
    ok &= _segments(k_row[k_above], m) + _segments(t_row[t_above], m) >= k
    for j, g in zip(js, ok.tolist()):
        if not g:
            out[j] = fallback(j)
    if not ok.any():
        return
    # Each row's K best in their columns, a touched one's value replaced by its own after
    # the steps, every value not above the floor (or banned) -inf, then the touched
    # tokens from outside the K best that rise above it. A row where nothing moved (the
    # common case: a window's tokens and most biased ids lie far below the best) is its
    # K best's canonical prefix already; the others are sorted by value, stably, so that
    # ties keep the K best's canonical order (id ascending). Only a tie between a value
    # that moved and another can come out of id order: such rows are sorted again by
    # (value, id).
    r_ok = np.flatnonzero(ok)
    kv = np.where(k_above, k_vals, -np.inf)
    kv[k_touched] = np.where(t_above[k_of], v[k_of], -np.inf)
    app = np.flatnonzero(t_above & ~found)
    app_row = t_row[app]
    n_app = _segments(app_row, m)
    K = int(k_n.max())
    W = K + int(n_app.max())
    mv = np.full((m, W), -np.inf)
    mi = np.full((m, W), np.iinfo(np.int32).max, np.int64)
    k_col = np.arange(k_row.size) - k_start[k_row]
    mv[k_row, k_col] = kv
    mi[k_row, k_col] = k_ids
    if app.size:
        a_col = K + np.arange(app.size) - (np.cumsum(n_app) - n_app)[app_row]
        mv[app_row, a_col] = v[app]
        mi[app_row, a_col] = t_ids[app]
    mv, mi = mv[r_ok], mi[r_ok]
    moved = np.flatnonzero((_segments(k_row[k_touched], m) + n_app)[r_ok])
    if moved.size:
        o = np.argsort(-mv[moved], axis=1, kind="stable")
        sv, si = np.take_along_axis(mv[moved], o, 1), np.take_along_axis(mi[moved], o, 1)
        h = min(k + 1, W)  # the k first, and the one after (a tie there decides the set)
        tie = (sv[:, 1:h] == sv[:, :h - 1]) & (si[:, 1:h] < si[:, :h - 1])
        for a in np.flatnonzero(tie.any(axis=1)).tolist():
            o = np.lexsort((si[a], -sv[a]))
            sv[a], si[a] = sv[a, o], si[a, o]
        mv[moved], mi[moved] = sv, si
    topk_draw(samplers, [js[a] for a in r_ok.tolist()], k, top_p, temp, None, out, fallback, path="graph",
              best=(floor[r_ok], np.ascontiguousarray(mi[:, :k]), np.ascontiguousarray(mv[:, :k])))
