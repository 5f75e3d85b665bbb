"""DRY ("don't repeat yourself"): penalise the tokens that would extend a repetition.

As llama.cpp defines it (from koboldcpp): look at the last N context tokens; for every
earlier place where the context's current suffix also occurs, the token that followed
it there would extend the repetition. A token whose longest such repetition has
length L >= allowed_length loses multiplier * base^(L - allowed_length) of its logit
(the exponent capped so the power stays below the float range). A sequence breaker
(a string) limits how far back a repetition may reach: the scan stops at the latest
occurrence of a breaker in the context, and a token that alone is a breaker is never
penalised. Breakers are matched on token text, so they need the vocabulary: the
tokens whose piece contains the string, and the tokens whose piece ends with a prefix
of it followed by the tokens of the rest (at most 20).

The context is the sequence's whole history (prompt included), which held, forked and
loaded sequences carry: DRY keeps no state of its own.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

__all__ = ["breakers", "dry_penalties", "apply"]

MAX_TAIL = 20  # tokens of a breaker after its head, as llama.cpp
FLOAT_MAX_LOG = 88.7228391  # log of the largest float32: caps the exponent

_EMPTY_I = np.empty(0, np.int32)
_EMPTY_F = np.empty(0, np.float64)


def breakers(vocab: Any, strings: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """head token -> the tails (token tuples) of the breakers starting with it; an empty
    tail means the head token alone is a breaker. Computed once per vocabulary and
    breaker set (vocab.memo), by searching all pieces joined into one bytes string."""
    def make() -> dict[int, tuple[tuple[int, ...], ...]]:
        pieces = vocab.pieces()
        blob, starts = vocab.memo("dry-blob", lambda: _blob(pieces))
        out: dict[int, list[tuple[int, ...]]] = {}
        for s in strings:
            b = s.encode("utf-8")
            if b"\x00" in b:  # the separator: search piece by piece instead
                _slow(out, pieces, b, vocab)
                continue
            inside = set(_owners(starts, blob, b).tolist())
            for tok in sorted(inside):
                _add(out, tok, ())
            for k in range(len(b) - 1, 0, -1):  # a piece ending with b[:k]: the rest follows
                tail = None
                for tok in _owners(starts, blob, b[:k] + b"\x00").tolist():
                    if tok in inside:
                        continue
                    if tail is None:
                        tail = tuple(vocab.tokenize(b[k:])[:MAX_TAIL])
                    _add(out, tok, tail)
        return {t: tuple(v) for t, v in out.items()}
    return vocab.memo(("dry-breakers", strings), make)


def _blob(pieces: list[bytes]) -> tuple[bytes, np.ndarray]:
    """Every piece followed by a NUL, and where each piece starts."""
    lens = np.fromiter((len(p) + 1 for p in pieces), np.int64, len(pieces))
    return b"\x00".join(pieces) + b"\x00", np.concatenate(([0], np.cumsum(lens)[:-1]))


def _owners(starts: np.ndarray, blob: bytes, needle: bytes) -> np.ndarray:
    """The distinct tokens whose piece holds an (overlapping) occurrence of needle (which
    has no NUL, or ends with the one after the piece)."""
    pos = np.fromiter((m.start() for m in re.finditer(b"(?=" + re.escape(needle) + b")", blob)), np.int64)
    return np.unique(np.searchsorted(starts, pos, side="right") - 1)


def _slow(out: dict, pieces: list[bytes], b: bytes, vocab: Any) -> None:
    for tok, word in enumerate(pieces):
        if b in word:
            _add(out, tok, ())
            continue
        for k in range(min(len(b) - 1, len(word)), 0, -1):
            if word.endswith(b[:k]):
                _add(out, tok, tuple(vocab.tokenize(b[k:])[:MAX_TAIL]))


def _add(out: dict, tok: int, tail: tuple[int, ...]) -> None:
    tails = out.setdefault(tok, [])
    if tail not in tails:
        tails.append(tail)


def _z_reversed(s: list[int]) -> list[int]:
    """Z-array of s: z[k] = length of the longest common prefix of s and s[k:]."""
    n = len(s)
    z = [0] * n
    lt = rt = 0
    for k in range(1, n):
        if k <= rt and z[k - lt] < rt - k + 1:
            z[k] = z[k - lt]
            continue
        i = max(rt + 1, k)
        while i < n and s[i] == s[i - k]:
            i += 1
        z[k] = i - k
        if i - 1 >= k:
            lt, rt = k, i - 1
    return z


def dry_penalties(history: list[int], multiplier: float, base: float, allowed: int, last_n: int,
                  brk: dict[int, tuple[tuple[int, ...], ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids sorted int32, penalty float64) for the next token, from the context."""
    n = len(history) if last_n < 0 else min(len(history), last_n)
    if multiplier == 0 or n <= allowed:
        return _EMPTY_I, _EMPTY_F
    rev = history[::-1][:n]  # rev[i]: the i-th token from the end
    rep_limit = n
    for i, tok in enumerate(rev):
        tails = brk.get(tok)
        if not tails:
            continue
        longest = -1
        for tail in tails:
            L = len(tail)
            if longest < L <= i and all(tail[o] == rev[i - o - 1] for o in range(L)):
                longest = L
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return _EMPTY_I, _EMPTY_F
    z = _z_reversed(rev)
    best: dict[int, int] = {}
    for k in range(1, n):
        r = min(z[k], rep_limit)
        if r >= allowed:
            tok = rev[k - 1]
            if best.get(tok, -1) < r:
                best[tok] = r
    for tok in [t for t in best if () in brk.get(t, ())]:
        del best[tok]  # a token that alone is a breaker is never penalised
    if not best:
        return _EMPTY_I, _EMPTY_F
    max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    ids = np.fromiter(best.keys(), np.int32, len(best))
    exp = np.fromiter(best.values(), np.float64, len(best)) - allowed
    if max_exp > 0:
        exp = np.minimum(exp, max_exp)
    pen = multiplier * np.power(base, exp)
    o = np.argsort(ids)
    return ids[o], pen[o]


_last: list = [None, None]  # one-entry memo: touches() and run() of the same call share it


def penalties_for(p: Any, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    """The penalties for these params and this context (memoised for one call)."""
    n = len(ctx.history) if p.dry_penalty_last_n < 0 else min(len(ctx.history), p.dry_penalty_last_n)
    key = (p, tuple(ctx.history[len(ctx.history) - n:]))
    if _last[0] != key:
        if p.dry_sequence_breakers and ctx.vocab is None:
            raise ValueError("drySequenceBreakers: DRY's sequence breakers need the model's vocabulary")
        brk = breakers(ctx.vocab, p.dry_sequence_breakers) if p.dry_sequence_breakers else {}
        _last[1] = dry_penalties(ctx.history, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                 p.dry_penalty_last_n, brk)
        _last[0] = key
    return _last[1]


def apply(ids: np.ndarray, logits: np.ndarray, pen_ids: np.ndarray, pen: np.ndarray):
    """Subtract the penalties from the listed candidates."""
    if pen_ids.size == 0 or ids.size == 0:
        return ids, logits
    k = np.searchsorted(pen_ids, ids)
    k[k == pen_ids.size] = 0
    pos = np.flatnonzero(pen_ids[k] == ids)
    if pos.size == 0:
        return ids, logits
    out = logits.copy()
    out[pos] -= pen[k[pos]]
    return ids, out
