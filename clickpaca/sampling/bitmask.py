"""llguidance-style token bitmasks: int32 words, bit j of word i = token 32*i + j allowed.

Helpers never expand the mask over the whole vocabulary unless they must: testing a few
candidate ids costs O(candidates), counting costs one popcount over V/32 words.
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_words", "allows", "count_allowed", "allowed_ids"]

_BIT = np.arange(32, dtype=np.uint32)


def as_words(bitmask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The mask as uint32 words (a view when possible); checks it covers n_vocab tokens.

    Accepts the [1, W] rows llguidance's numpy helpers fill as well as flat arrays."""
    m = np.asarray(bitmask)
    if m.ndim == 2 and m.shape[0] == 1:
        m = m[0]
    m = np.ascontiguousarray(m)
    if m.ndim != 1 or m.dtype.itemsize != 4 or m.dtype.kind not in "iu":
        raise ValueError(f"grammar bitmask must be a 1-D array of 32-bit words, got {m.dtype} {m.shape}")
    need = (n_vocab + 31) // 32
    if m.shape[0] < need:
        raise ValueError(f"grammar bitmask has {m.shape[0]} words, needs {need} for {n_vocab} tokens")
    if not m.dtype.isnative:
        m = m.astype(m.dtype.newbyteorder("="))
    w = m.view(np.uint32) if m.dtype != np.uint32 else m
    return w[:need]


def allows(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """bool[n]: whether each id's bit is set. O(n)."""
    ids = np.asarray(ids)
    return ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _tail_fix(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """Copy of the words with bits for ids >= n_vocab cleared (only if there are any)."""
    r = n_vocab & 31
    if r == 0 or not words[-1] >> np.uint32(r):
        return words
    w = words.copy()
    w[-1] &= np.uint32((1 << r) - 1)
    return w


def count_allowed(words: np.ndarray, n_vocab: int) -> int:
    """Number of allowed tokens below n_vocab (one popcount over V/32 words)."""
    return int(np.bitwise_count(_tail_fix(words, n_vocab)).sum(dtype=np.int64))


def allowed_ids(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """int32 ids of allowed tokens, ascending. Expands only non-zero words when the mask
    is sparse (the usual grammar state); unpacks bits when dense."""
    w = _tail_fix(words, n_vocab)
    nz = np.flatnonzero(w)
    if nz.size * 4 <= w.size:
        bits = (w[nz, None] >> _BIT) & 1
        r, c = np.nonzero(bits)
        return (nz[r] * 32 + c).astype(np.int32)
    flags = np.unpackbits(w.astype("<u4", copy=False).view(np.uint8), bitorder="little")[:n_vocab]
    return np.flatnonzero(flags).astype(np.int32)
