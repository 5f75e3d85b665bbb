"""The set a chain leaves to sample from, explicit or (when nothing truncates) implicit.

When no step truncates (say temperature-only sampling), the set is the whole allowed
vocabulary. Listing 262k ids as int32 + float64 and sorting them by id would cost
milliseconds, so the untouched part stays implicit: "every allowed raw token outside
``exclude``, with logit row/tau", and is sampled through float32 block sums instead.
"""

from __future__ import annotations

import math

import numpy as np

from . import steps as S
from .bitmask import allowed_ids, allows
from .cut import RowView, isin_sorted, scratch, upper_ids

__all__ = ["Candidates", "Dense", "block_of", "dense_exp", "dense_terms", "gather", "index_in_block", "raw_logprobs"]

_BLOCK = 1024


def block_of(blocks: np.ndarray, cb: np.ndarray, target: float) -> int:
    """A dense draw's first half: the block where ``target`` (u x the total) lands among
    the float64 block masses ``blocks`` (``cb``: their running sum), the last with mass
    at or before it. The host's dense draw (`Candidates`) and the pre-selected one
    (fastpath.py) both take it from here; fastpath_dense.py does the same on matrices."""
    b = min(int(np.searchsorted(cb, target, side="right")), cb.size - 1)
    while blocks[b] <= 0:  # rounding at the very end: step back to a block with mass
        b -= 1
    return b


def index_in_block(chunk: np.ndarray, cb: np.ndarray, b: int, target: float) -> int:
    """A dense draw's second half: the index in block b (its masses ``chunk``) where
    ``target`` lands, the running sum taken on from the blocks before it."""
    within = np.add.accumulate(chunk, dtype=np.float64)
    within += float(cb[b - 1]) if b else 0.0
    j = int(np.searchsorted(within, target, side="right"))
    if j >= chunk.size:
        j = int(np.flatnonzero(chunk > 0)[-1])
    return j


def gather(row: np.ndarray, ids: np.ndarray, tau: float = 1.0) -> np.ndarray:
    """float64 row[ids] / tau; NaN (a broken model row) becomes -inf so it is never drawn."""
    v = np.fmax(row[ids], -np.inf, dtype=np.float64)
    return v / tau if tau != 1.0 else v


def dense_terms(view: RowView, tau: float, words: np.ndarray | None, exclude: np.ndarray,
                ref: float) -> np.ndarray:
    """float32 masses exp(row/tau - ref) of the allowed tokens outside ``exclude`` (0
    elsewhere) in a reused scratch buffer; NaN where the row has NaN."""
    buf = scratch(view.n)
    np.subtract(view.row, ref * tau, out=buf, casting="unsafe")
    if tau != 1.0:
        np.multiply(buf, 1.0 / tau, out=buf)
    np.exp(buf, out=buf)
    if words is not None:
        flags = np.unpackbits(words.astype("<u4", copy=False).view(np.uint8), bitorder="little")
        np.multiply(buf, flags[: view.n], out=buf, casting="unsafe")
    if exclude.size:
        buf[exclude] = 0.0
    return buf


def dense_exp(view: RowView, tau: float, words: np.ndarray | None, exclude: np.ndarray,
              ref: float) -> tuple[np.ndarray, float]:
    """(buf, total): ``dense_terms`` with NaN and +inf masses set to 0 when there are any,
    and their float64 sum."""
    buf = dense_terms(view, tau, words, exclude, ref)
    total = float(np.add.reduce(buf, dtype=np.float64))
    if not math.isfinite(total):  # NaN logits in the row
        np.nan_to_num(buf, copy=False, nan=0.0, posinf=0.0)
        total = float(np.add.reduce(buf, dtype=np.float64))
    return buf, total


class Dense:
    """The implicit part of a candidate set: allowed raw tokens outside ``exclude``,
    logit row[i] / tau."""

    __slots__ = ("view", "tau", "words", "frac", "exclude", "count")

    def __init__(self, view: RowView, tau: float, words, frac: float, exclude: np.ndarray, count: int):
        self.view, self.tau, self.words, self.frac, self.exclude = view, tau, words, frac, exclude
        self.count = count

    def ids(self) -> np.ndarray:
        w, ex = self.words, self.exclude
        ids = allowed_ids(w, self.view.n) if w is not None else np.arange(self.view.n, dtype=np.int32)
        return ids[~isin_sorted(ids, ex)] if ex.size else ids

    def best(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """An upper set of at least n members (ids, logits), not sorted."""
        ids = upper_ids(self.view, n, self.words, self.frac, self.exclude).astype(np.int32)
        return ids, gather(self.view.row, ids, self.tau)


class Candidates:
    """Candidates to sample from: explicit ``ids``/``logits``, plus an implicit ``dense``
    rest when nothing truncated. ``empty_step`` names the step that removed the last
    candidate (None when there is one)."""

    __slots__ = ("ids", "logits", "empty_step", "dense", "_lse")

    def __init__(self, ids: np.ndarray, logits: np.ndarray, empty_step: str | None = None,
                 dense: Dense | None = None):
        self.ids, self.logits, self.empty_step, self.dense = ids, logits, empty_step, dense
        self._lse = None

    def materialize(self) -> tuple[np.ndarray, np.ndarray]:
        """Every candidate explicitly (ids, logits): slow for a dense set; for tests."""
        if self.dense is None:
            return self.ids, self.logits
        d = self.dense
        ids = d.ids()
        return (np.concatenate((ids, self.ids)),
                np.concatenate((gather(d.view.row, ids, d.tau), self.logits)))

    @property
    def size(self) -> int:
        if self.dense is None:
            return int(self.ids.size)
        return int(self.dense.count + self.ids.size)

    def _ref(self) -> float:
        """The largest logit among the candidates (the shift for exp)."""
        top_ids, top_v = self.dense.best(1)
        ref = float(top_v.max()) if top_v.size else -math.inf
        if self.logits.size:
            ref = max(ref, float(self.logits.max()))
        return ref

    def sample(self, u: float) -> int:
        """``steps.sample`` over the set: inverse CDF in id order (-1 if nothing can be drawn).
        For a dense set the masses are float32 and summed by blocks, which moves the CDF
        boundaries by ~1e-7 relative: the same token except when u lands that close."""
        if self.dense is None:
            return S.sample(self.ids, self.logits, u)
        ref = self._ref()
        if not ref > -math.inf:
            return -1
        d = self.dense
        n = d.view.n
        # The block sums straight from dense_terms, without dense_exp's whole-row total (a
        # pass over the row): here it would only say whether a mass is NaN or inf, which
        # the block sums say too (a float64 sum of at most 262,144 finite float32 values is
        # finite). Only then are the masses made again as dense_exp makes them (NaN -> 0),
        # so every block sum is what it was.
        for buf in (dense_terms(d.view, d.tau, d.words, d.exclude, ref), None):
            if buf is None:
                buf, _ = dense_exp(d.view, d.tau, d.words, d.exclude, ref)
            if self.ids.size:
                buf[self.ids] = np.exp(self.logits - ref)
            blocks = np.add.reduceat(buf, np.arange(0, n, _BLOCK), dtype=np.float64)
            cb = np.add.accumulate(blocks)
            total = float(cb[-1])
            if math.isfinite(total):
                break
        if not total > 0 or not math.isfinite(total):
            return -1
        self._lse = ref + math.log(total)
        target = u * total
        b = block_of(blocks, cb, target)
        lo = b * _BLOCK
        return lo + index_in_block(buf[lo: lo + _BLOCK], cb, b, target)

    def _log_norm(self) -> float:
        if self._lse is None:
            if self.dense is None:
                m = float(self.logits.max())
                self._lse = m + math.log(float(np.exp(self.logits - m).sum())) if math.isfinite(m) else math.inf
            else:
                ref = self._ref()
                d = self.dense
                _, total = dense_exp(d.view, d.tau, d.words, d.exclude, ref)
                if self.logits.size:
                    total += float(np.exp(self.logits - ref).sum())
                self._lse = ref + math.log(total) if total > 0 else math.inf
        return self._lse

    def logprob(self, token: int) -> float:
        """log-probability of a candidate under the softmax of the set."""
        hit = np.flatnonzero(self.ids == token)
        if hit.size:
            v = float(self.logits[hit[0]])
        else:
            d = self.dense
            tok = np.array([token])
            if (d is None or isin_sorted(tok, d.exclude)[0]
                    or (d.words is not None and not allows(d.words, tok)[0])):
                return -math.inf
            v = float(gather(d.view.row, tok, d.tau)[0])
        return v - self._log_norm()

    def top(self, n: int) -> tuple[tuple[int, float], ...]:
        """Up to n best (token, logprob), canonical order, zero-probability tokens left out."""
        ids, logits = self.ids, self.logits
        if self.dense is not None:
            b_ids, b_v = self.dense.best(n)
            ids, logits = np.concatenate((b_ids, ids)), np.concatenate((b_v, logits))
        ids, logits = S.top_n(ids, logits, n)
        lse = self._log_norm()
        return tuple((int(i), float(v) - lse) for i, v in zip(ids, logits) if v > -math.inf)


def raw_logprobs(view: RowView, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(logprob of token, n best (token, logprob)) under the log-softmax of the raw row
    at temperature 1. One exp pass over the row (float32 terms, float64 sum)."""
    m = view.max()
    if not math.isfinite(m):
        return -math.inf, ()
    _, total = dense_exp(view, 1.0, None, np.empty(0, np.int32), m)
    lse = m + math.log(total)
    lp = float(view.row[token]) - lse
    top: tuple = ()
    if n > 0:
        ids = upper_ids(view, n).astype(np.int32)
        ids, vals = S.top_n(ids, gather(view.row, ids), n)
        top = tuple((int(i), float(v) - lse) for i, v in zip(ids, vals))
    return lp, top
