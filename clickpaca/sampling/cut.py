"""Cutting one raw logits row down to a small candidate set, exactly.

Every truncating step (top-k, min-p, top-p, greedy) keeps an *upper set* of the current
distribution: all tokens at or above some logit. So the chain never needs the whole row
sorted: it needs the raw tokens at or above a threshold, found through column maxima.

The row is viewed as R x C (32 x 8192 at 262k vocab) plus a short tail. One pass gives
the C column maxima. The k-th largest of them, t, is a threshold with at least k raw
tokens >= t (each of the k columns holds one), and all tokens >= t live in columns whose
maximum is >= t: gathering those columns yields exactly {i : row[i] >= t} from about
k*R values instead of V. Ties are all included, so tie-breaking stays exact.

The row is only read, never written (it is a view of llama.cpp's memory).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .bitmask import allows

__all__ = ["RowView", "isin_sorted", "upper_ids", "scratch"]

_tls = threading.local()


def scratch(n: int) -> np.ndarray:
    """A per-thread float32 work buffer of n values (reused, so no 1 MB allocation per token)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(n, np.float32)
        _tls.buf = buf
    return buf[:n]


def default_cols(n: int) -> int:
    """About 32 rows: each column gathered costs ~R scattered cache lines, while the
    k-th largest of C column maxima costs O(C); R = 32 balances the two at 262k."""
    if n >= 4096:
        return min(8192, 1 << int(math.log2(n / 32)))
    return max(2, 1 << (int(math.log2(max(n, 2))) // 2))


def isin_sorted(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """bool[n]: ids in ``keys`` (sorted, unique)."""
    if keys.size == 0:
        return np.zeros(ids.size, bool)
    k = np.searchsorted(keys, ids)
    k[k == keys.size] = 0
    return keys[k] == ids


class RowView:
    """Read-only access to a raw logits row with lazily computed column maxima."""

    __slots__ = ("row", "n", "cols", "rows", "head", "tail0", "dense_frac", "_colmax", "_cand", "_max", "_first")

    def __init__(self, row: np.ndarray, cols: int | None = None, dense_frac: float = 0.25):
        """``cols``: columns of the R x C view (default 8192 at 262k). ``ge`` scans the
        whole row instead of gathering columns once more than ``dense_frac`` of the
        columns qualify (tests raise it to exercise the column path on tiny rows)."""
        self.row = row
        self.dense_frac = dense_frac
        self.n = n = row.shape[0]
        self.cols = c = cols or default_cols(n)
        self.rows = r = n // c
        self.tail0 = r * c
        self.head = row[: r * c].reshape(r, c)
        self._colmax = None
        self._cand = None
        self._max = None
        self._first = None

    def first(self) -> int:
        """The canonical first token (the largest logit, the smallest id among ties) from
        one argmax pass, or -1 when the row's largest value is NaN or -inf (argmax would
        pick a NaN, or a token that is no better than the rest): callers fall back to the
        column maxima then. ``batch`` may hand it in precomputed for a whole tick."""
        if self._first is None:
            i = int(self.row.argmax()) if self.n else -1
            v = self.row[i] if i >= 0 else np.nan
            self._first = i if v > -np.inf else -1  # NaN compares False too
        return self._first

    @property
    def colmax(self) -> np.ndarray:
        if self._colmax is None:
            # fmax ignores NaN, so a NaN cannot hide the rest of its column.
            self._colmax = np.fmax.reduce(self.head, axis=0) if self.rows else np.empty(0, self.row.dtype)
        return self._colmax

    def _candidates(self) -> np.ndarray:
        """Column maxima plus the tail values: a set of distinct row elements."""
        if self._cand is None:
            tail = self.row[self.tail0:]
            self._cand = np.concatenate((self.colmax, tail)) if tail.size else self.colmax
        return self._cand

    def max(self) -> float:
        if self._max is None:
            self._max = float(np.fmax.reduce(self._candidates()))
        return self._max

    def threshold(self, k: int) -> float:
        """A threshold t for about k tokens >= t: guaranteed at least k when k is at most
        the number of columns (+ tail); beyond that an estimate from a strided sample,
        which callers verify. -inf when k >= n (everything)."""
        if k >= self.n:
            return -math.inf
        cand = self._candidates()
        if k <= cand.size:
            return float(np.partition(cand, cand.size - k)[cand.size - k])
        step = max(1, self.n // 16384)
        sub = self.row[::step]
        j = min(sub.size, max(1, int(1.5 * k / step) + 1))
        return float(np.partition(sub, sub.size - j)[sub.size - j])

    def ge(self, t: float) -> np.ndarray:
        """int64 ids of all tokens with row[i] >= t, ascending."""
        if t == -math.inf or not self.rows:
            return np.flatnonzero(self.row >= t)
        cols = np.flatnonzero(self.colmax >= t)
        if cols.size > self.dense_frac * self.cols:
            return np.flatnonzero(self.row >= t)
        flat = np.flatnonzero(self.head.take(cols, axis=1) >= t)
        r, c = np.divmod(flat, cols.size)
        ids = r * self.cols + cols[c]
        if self.tail0 < self.n:
            tail = np.flatnonzero(self.row[self.tail0:] >= t)
            if tail.size:
                ids = np.concatenate((ids, tail + self.tail0))
        return ids


def upper_ids(view: RowView, need: int, words: np.ndarray | None = None, frac: float = 1.0,
              exclude: np.ndarray | None = None) -> np.ndarray:
    """ids of an upper set of the allowed, non-excluded raw tokens with at least ``need``
    members (all of them if fewer exist): every such token outside it has a lower raw
    logit than every token in it. ``frac`` is the allowed fraction of the vocabulary
    (sizes the first guess); ``exclude`` is sorted."""
    n_ex = 0 if exclude is None else exclude.size
    if need == 1 and words is None:
        # One argmax pass instead of the column maxima: the canonical first token alone is
        # an upper set of one unless it ties; a tie is no better, so every truncation that
        # keeps one token (top-k 1, greedy) and every use of the best value still sees
        # exactly what the full upper set would give it.
        i = view.first()
        if i >= 0 and not (n_ex and isin_sorted(np.array([i]), exclude)[0]):
            return np.array([i], np.int64)
    k = need + n_ex
    if words is not None:
        k = int(k / max(frac, 1e-9) * 1.25) + 16
    while True:
        t = view.threshold(k)
        ids = view.ge(t)
        if words is not None and ids.size:
            ids = ids[allows(words, ids)]
        if n_ex and ids.size:
            ids = ids[~isin_sorted(ids, exclude)]
        if ids.size >= need or t == -math.inf:
            return ids
        k *= 4
