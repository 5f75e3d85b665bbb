"""The sampler steps: one small pure function each, over a candidate set.

A candidate set is ``(ids, logits)``: ``ids`` int32[n] distinct token ids in any order,
``logits`` float64[n]. Every function returns a new set (inputs are never written) and
is correct for any candidate set, including the whole vocabulary: these functions ARE
the definition of each step; ``cut`` and ``chain`` only make the sets small first.

Ties are broken towards the smaller token id ("canonical order": logit descending, then
id ascending), so every result depends on the set only, not on its array order.
The ufunc methods (np.add.reduce, ...) are used instead of np.sum & co. on purpose:
the sets are small and numpy's Python-level wrappers would cost more than the work.
"""

from __future__ import annotations

import math

import numpy as np

from .bitmask import allows

__all__ = [
    "BAN", "FORCE", "grammar", "logit_bias", "penalties", "top_k", "min_p", "top_p", "temperature",
    "sample", "canonical_order", "top_n", "log_softmax", "top_p_target", "top_p_cut",
]

_EMPTY_I = np.empty(0, np.int32)
_EMPTY_F = np.empty(0, np.float64)
_max = np.maximum.reduce
_sum = np.add.reduce
_cumsum = np.add.accumulate
_NEG_INF = -np.inf
#: A bias at or below BAN removes the token; at or above FORCE forces it.
BAN = -1e9
FORCE = 1e9
#: The logit a forced token gets when the model gave it -inf (or NaN).
FORCED_FLOOR = -1e30


def _locate(ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in ids, in keys) of the ids present in ``keys`` (sorted, unique)."""
    if keys.size == 0 or ids.size == 0:
        return np.empty(0, np.intp), np.empty(0, np.intp)
    if ids.size <= 64 * keys.size:
        k = np.searchsorted(keys, ids)
        k[k == keys.size] = 0
        pos = np.flatnonzero(keys[k] == ids)
        return pos, k[pos]
    # Many candidates, few keys: a position table is O(n) instead of O(n log m).
    table = np.full(int(max(_max(ids), _max(keys))) + 1, -1, np.intp)
    table[ids] = np.arange(ids.size)
    p = table[keys]
    hit = np.flatnonzero(p >= 0)
    return p[hit], hit


def grammar(ids: np.ndarray, logits: np.ndarray, words: np.ndarray):
    """Keep the candidates the grammar allows (their bit is set in the uint32 ``words``)."""
    keep = allows(words, ids)
    return ids[keep], logits[keep]


def logit_bias(ids: np.ndarray, logits: np.ndarray, bias_ids: np.ndarray, bias: np.ndarray):
    """Add ``bias`` to the listed candidates (``bias_ids`` sorted). A bias <= -1e9 removes
    the token; a bias >= +1e9 forces it: if any forced token is among the candidates,
    only the forced tokens remain, with their own (unbiased) logits, so the model still
    ranks several forced tokens; a forced logit of -inf or NaN becomes -1e30 (finite:
    forcing beats the model's own ban)."""
    pos, k = _locate(ids, bias_ids)
    if pos.size == 0:
        return ids, logits
    b = bias[k]
    forced = b >= FORCE
    if forced.any():
        keep = pos[forced]
        return ids[keep], np.fmax(logits[keep], FORCED_FLOOR)
    out = logits.copy()
    out[pos] += b
    banned = b <= BAN
    if banned.any():
        keep = np.ones(ids.size, bool)
        keep[pos[banned]] = False
        return ids[keep], out[keep]
    return ids, out


def penalties(ids: np.ndarray, logits: np.ndarray, hist_ids: np.ndarray, hist_counts: np.ndarray,
              repeat: float, freq: float, present: float):
    """llama.cpp repetition penalties. For each candidate seen ``c > 0`` times in the
    penalty window (``hist_ids`` sorted, ``hist_counts`` their counts): a positive logit
    is divided by ``repeat``, a non-positive one multiplied; then ``c*freq + present`` is
    subtracted."""
    pos, k = _locate(ids, hist_ids)
    if pos.size == 0:
        return ids, logits
    out = logits.copy()
    out[pos] = _penalized(out[pos], hist_counts[k], repeat, freq, present)
    return ids, out


def _penalized(x: np.ndarray, counts: np.ndarray, repeat: float, freq: float, present: float) -> np.ndarray:
    """The penalties' arithmetic on the values of ids seen ``counts`` times (> 0)."""
    if repeat != 1.0:
        x = np.where(x > 0, x / repeat, x * repeat)
    return x - (counts * freq + present)


# ------------------------------------------------------------------ batched forms
# The TOUCH forms (registry.Batched) of the elementwise steps above: the same arithmetic
# over the touched ids of several rows side by side (fastpath_touched.py).


def logit_bias_touched(v, ids, rows, m, bias_ids, bias):
    """logit_bias on the touched ids of m rows: a row's result is given only where every
    biased id is among its touched ones; a ban removes the token. Forcing is not carried
    (the row's Batched.carries)."""
    at = np.searchsorted(bias_ids, ids)
    at[at == bias_ids.size] = 0
    hit = np.flatnonzero(bias_ids[at] == ids)
    b = bias[at[hit]]
    v[hit] += b
    return np.bincount(rows[hit], minlength=m) == bias_ids.size, hit[b <= BAN]


def penalties_touched(v, counts, repeat, freq, present):
    """penalties on the touched ids with a count (every token of the window is touched)."""
    hit = np.flatnonzero(counts)
    v[hit] = _penalized(v[hit], counts[hit], repeat, freq, present)
    return None, None


def canonical_order(ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Indices sorting the set by logit descending, then id ascending. A big set is
    sorted by logit alone (an unstable sort, 3x faster than lexsort at 262k), then only
    its runs of equal logits are put in id order."""
    if ids.size <= 4096:
        return np.lexsort((ids, -logits))
    o = np.argsort(-logits)
    v = logits[o]
    eq = v[1:] == v[:-1]
    if eq.any():
        tied = np.flatnonzero(np.concatenate(([False], eq)) | np.concatenate((eq, [False])))
        run = np.cumsum(np.concatenate(([True], ~eq)))[tied]
        sub = o[tied]
        o[tied] = sub[np.lexsort((ids[sub], run))]
    return o


def _best(ids: np.ndarray, logits: np.ndarray, k: int) -> np.ndarray:
    """bool mask of the k first candidates in canonical order (0 < k < n)."""
    n = ids.size
    kth = np.partition(logits, n - k)[n - k]
    keep = logits > kth
    need = k - int(np.count_nonzero(keep))
    eq = np.flatnonzero(logits == kth)
    if eq.size > need:
        eq = eq[np.argsort(ids[eq], kind="stable")[:need]]
    keep[eq] = True
    return keep


def top_k(ids: np.ndarray, logits: np.ndarray, k: int):
    """Keep the k highest logits (k <= 0: off)."""
    if k <= 0 or k >= ids.size:
        return ids, logits
    keep = _best(ids, logits, k)
    return ids[keep], logits[keep]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float):
    """Keep tokens with probability >= p * (max probability), i.e. exp(l - l_max) >= p,
    over the current candidates (p <= 0: off)."""
    if p <= 0 or ids.size <= 1:
        return ids, logits
    m = float(_max(logits))
    if not np.isfinite(m):
        return ids, logits
    keep = np.exp(logits - m) >= p
    return ids[keep], logits[keep]


def top_p(ids: np.ndarray, logits: np.ndarray, p: float, rest_mass: float = 0.0):
    """Keep the smallest prefix, in canonical order, whose cumulative probability >= p
    (at least one token; p >= 1: off). ``rest_mass`` is the mass exp(l - max(logits)) of
    tokens not passed in: the chain uses it to run top-p on a guaranteed superset of the
    nucleus instead of the whole vocabulary."""
    n = ids.size
    if p >= 1.0 or n <= 1:
        return ids, logits
    m = float(_max(logits))
    if not np.isfinite(m):
        return ids, logits
    e = np.exp(logits - m)
    target = top_p_target(e, p, rest_mass)
    head = None
    if n <= 2048:
        order = canonical_order(ids, logits)
        before = 0.0
    else:
        # Sorting a big nucleus is the slow part: bucket by distance to the max
        # (1/8 nat), find the bucket where the cumulative mass crosses the target and
        # sort only that bucket. Buckets are monotone in the logit, so this is exact.
        b = np.minimum((m - logits) * 8.0, 4095.0).astype(np.intp)
        c = _cumsum(np.bincount(b, weights=e, minlength=4096))
        cross = int(np.searchsorted(c, target, side="left"))
        if cross >= c.size:  # the target is the whole mass (rounding): keep everything
            return ids, logits
        before = float(c[cross - 1]) if cross else 0.0
        head = np.flatnonzero(b < cross)
        sub = np.flatnonzero(b == cross)
        order = sub[canonical_order(ids[sub], logits[sub])]
    keep = order[: int(top_p_cut(target, e[order], before)) + 1]
    if head is not None:
        keep = np.concatenate((head, keep))
    return ids[keep], logits[keep]


def top_p_target(e: np.ndarray, p: float, rest_mass=0.0):
    """Top-p's target along the last axis: ``p`` of the total mass, ``e`` (exp(v - max),
    in any order) summed with ``rest_mass`` (per row: the mass of tokens not passed in).
    The scalar step (`top_p`) and the batched rows (batch.topk_draw) both take it from
    here, so their bits agree."""
    return p * (_sum(e, axis=-1) + rest_mass)


def top_p_cut(target, e_canonical: np.ndarray, before=0.0):
    """Along the last axis: the position of the last token top-p keeps among
    ``e_canonical`` (the masses in canonical order, after ``before`` mass of tokens kept
    ahead of them): the first whose cumulative mass reaches ``target`` (a left-sided
    search: the count of cumulative masses below it), at most the last (one token is
    always kept). One row takes a binary search: the running masses never decrease, so
    it counts the same, in fewer numpy calls (this is on every top-p token's path)."""
    cum = _cumsum(e_canonical, axis=-1)
    if before:
        cum += before
    if cum.ndim == 1:
        return min(int(cum.searchsorted(target)), cum.size - 1)
    return np.minimum(_sum(cum < target[..., None], axis=-1), e_canonical.shape[-1] - 1)


def temperature(ids: np.ndarray, logits: np.ndarray, t: float):
    """Divide logits by t. t <= 0 is greedy: keep only the argmax (smallest id on ties).
    (A tiny t may overflow logits to +-inf; sampling then picks among the +inf ones.)"""
    if t == 1.0 or ids.size == 0:
        return ids, logits
    if t > 0:
        with np.errstate(over="ignore"):
            return ids, logits / t
    keep = np.flatnonzero(logits == _max(logits))
    if keep.size == 0:  # NaN max: nothing sensible to keep
        return _EMPTY_I, _EMPTY_F
    if keep.size > 1:
        keep = keep[np.argmin(ids[keep]):][:1]
    return ids[keep], logits[keep]


def sample(ids: np.ndarray, logits: np.ndarray, u: float) -> int:
    """Draw one token from softmax(logits) by inverse CDF over the candidates taken in
    id order, with ``u`` uniform in [0, 1): the token whose cumulative mass first exceeds
    u * total. Tokens at -inf are never drawn; if any logit is +inf the draw is uniform
    over those. Returns -1 when nothing can be drawn (empty, all -inf, or NaN)."""
    n = ids.size
    if n == 0:
        return -1
    m = _max(logits)
    if not m > _NEG_INF:  # all -inf, or NaN
        return -1
    if n == 1:
        return int(ids[0])
    if n <= 65536 or not (ids[1:] > ids[:-1]).all():
        order = np.argsort(ids, kind="stable")
        ids, logits = ids[order], logits[order]
    e = np.exp(logits - m) if m < np.inf else (logits == m).astype(np.float64)
    c = _cumsum(e)
    total = c[-1]
    if not total > 0:
        return -1
    j = int(np.searchsorted(c, u * total, side="right"))
    return int(ids[min(j, n - 1)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the set (float64)."""
    m = _max(logits)
    if not np.isfinite(m):
        return np.full(logits.shape, _NEG_INF)
    z = logits - m
    return z - np.log(_sum(np.exp(z)))


def top_n(ids: np.ndarray, logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n first (ids, logits) in canonical order, sorted."""
    if 0 < n < ids.size:
        keep = _best(ids, logits, n)
        ids, logits = ids[keep], logits[keep]
    o = canonical_order(ids, logits)
    return ids[o], logits[o]


# ------------------------------------------------------------------ llama.cpp's other steps
#
# Defined as llama.cpp defines them (src/llama-sampler.cpp of the pinned source; facts,
# not its code), over the same candidate sets, in float64 and with the canonical
# tie-break. Differences that remain are listed in docs/PROTOCOL.md.


def softmax_sorted(ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, probabilities in that order): canonical order and the softmax over the set."""
    order = canonical_order(ids, logits)
    lg = logits[order]
    e = np.exp(lg - lg[0]) if lg.size and lg[0] > _NEG_INF else np.zeros(lg.size)
    total = float(_sum(e))
    return order, (e / total if total > 0 else e)


def typical_p(ids: np.ndarray, logits: np.ndarray, p: float):
    """Locally typical sampling: order the candidates by |-log p - H| (H the entropy of the
    set; ties in canonical order) and keep the shortest prefix whose cumulative
    probability exceeds p (at least one token; p >= 1: off)."""
    if p >= 1.0 or ids.size <= 1:
        return ids, logits
    order, prob = softmax_sorted(ids, logits)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(prob)
        ent = -float(_sum(np.where(prob > 0, prob * logp, 0.0)))
        score = np.abs(-logp - ent)
    by = np.argsort(score, kind="stable")  # stable: ties stay in canonical order
    cum = _cumsum(prob[by])
    over = np.flatnonzero(cum > p)
    n = int(over[0]) + 1 if over.size else by.size
    keep = order[by[:n]]
    return ids[keep], logits[keep]


def xtc(ids: np.ndarray, logits: np.ndarray, probability: float, threshold: float, u: float | None):
    """Exclude Top Choices: with chance ``probability`` (``u`` uniform in [0, 1), drawn by
    the caller; the step runs when u <= probability), remove every token whose
    probability is >= threshold except the least likely of them, when there are at least
    two. Off for probability <= 0, threshold > 0.5 or fewer than two candidates (u None)."""
    if u is None or u > probability:
        return ids, logits
    order, prob = softmax_sorted(ids, logits)
    above = int(np.count_nonzero(np.logical_and.accumulate(prob >= threshold)))
    if above < 2:
        return ids, logits
    keep = np.ones(ids.size, bool)  # a mask keeps the set's own order (the draw sorts by id)
    keep[order[: above - 1]] = False
    return ids[keep], logits[keep]


def top_n_sigma(ids: np.ndarray, logits: np.ndarray, n: float):
    """Keep the tokens whose logit is >= max - n * std (max, mean and population std over
    the finite candidates; n <= 0: off)."""
    if n <= 0 or ids.size <= 1:
        return ids, logits
    fin = logits > _NEG_INF
    if not fin.any():
        return ids, logits
    v = logits[fin]
    std = float(np.sqrt(_sum((v - _sum(v) / v.size) ** 2) / v.size))
    keep = logits >= float(_max(v)) - n * std
    return ids[keep], logits[keep]


def dynatemp(ids: np.ndarray, logits: np.ndarray, t: float, delta: float, exponent: float):
    """Dynamic temperature: t' = max(0, t - delta) + 2 delta' (H / log n)^exponent between
    max(0, t - delta) and t + delta, H the entropy of the set; then temperature t'
    (t' <= 0: greedy). delta <= 0 is plain temperature t. In float64: for a peaked set
    t' may be ~1e-43, where llama.cpp's float32 goes greedy or overflows to +-inf; here
    every candidate stays and all the mass is on the top token (docs/PROTOCOL.md)."""
    if delta <= 0:
        return temperature(ids, logits, t)
    if ids.size <= 1:
        return ids, logits
    lo, hi = max(0.0, t - delta), t + delta
    _, prob = softmax_sorted(ids, logits)
    nz = prob[prob > 0]
    ent = -float(_sum(nz * np.log(nz)))
    dyn = lo + (hi - lo) * (ent / np.log(ids.size)) ** exponent
    return temperature(ids, logits, dyn)


def mirostat_k(prob: np.ndarray, mu: float, m: int, n_vocab: int) -> int:
    """Mirostat 1.0's k from the sorted probabilities: s_hat, the Zipf exponent fitted
    on the m most likely tokens, then k = (eps 2^mu / (1 - N^-eps))^(1/s_hat), eps =
    s_hat - 1, at least 1. As llama.cpp's int conversion on x86, a k that is not a
    finite number below 2^31 becomes 1 (INT_MIN, then max(k, 1))."""
    j = min(m - 1, prob.size - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        i = np.arange(j, dtype=np.float64)
        t = np.log((i + 2) / (i + 1))
        b = np.log(prob[:j] / prob[1:j + 1])
        # numpy scalars: 0/0, x/0 and a negative base to a fractional power give nan or inf
        # (as in C), where Python floats would raise or turn complex
        s_hat = _sum(t * b) / _sum(t * t) if j > 0 else np.float64(np.nan)
        eps = s_hat - 1
        k = float((eps * np.float64(2.0) ** mu / (1 - np.float64(n_vocab) ** -eps)) ** (1 / s_hat))
    if not (math.isfinite(k) and -2.0**31 < k < 2.0**31):
        return 1
    return max(int(k), 1)


def mirostat(ids: np.ndarray, logits: np.ndarray, mu: float, m: int, n_vocab: int):
    """Mirostat 1.0's truncation: the top k (``mirostat_k``) in canonical order."""
    if ids.size <= 1:
        return ids, logits
    order, prob = softmax_sorted(ids, logits)
    keep = order[: mirostat_k(prob, mu, m, n_vocab)]
    return ids[keep], logits[keep]


def mirostat_v2(ids: np.ndarray, logits: np.ndarray, mu: float):
    """Mirostat 2.0's truncation: the canonical prefix of tokens whose surprise -log2 p is
    at most mu (at least one)."""
    if ids.size <= 1:
        return ids, logits
    order, prob = softmax_sorted(ids, logits)
    with np.errstate(divide="ignore"):
        over = np.flatnonzero(-np.log2(prob) > mu)
    keep = order[: max(int(over[0]) if over.size else order.size, 1)]
    return ids[keep], logits[keep]


def surprise(ids: np.ndarray, logits: np.ndarray, token: int) -> float:
    """-log2 of the token's probability under the softmax of the set (inf if absent)."""
    hit = np.flatnonzero(ids == token)
    if hit.size == 0:
        return math.inf
    m = float(_max(logits))
    lse = m + math.log(float(_sum(np.exp(logits - m))))
    return -(float(logits[hit[0]]) - lse) / math.log(2.0)
