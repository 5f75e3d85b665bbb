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
of it followed by the tokens of the rest (at most 20). The protocol bounds the breakers
as llama.cpp bounds them (at most 40 characters each; 64 of them), and their
preparation is bounded per breaker (`breakers`).

The context is the sequence's whole history (prompt included), which held, forked and
loaded sequences carry: DRY keeps no state of its own.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

__all__ = ["breakers", "dry_penalties", "apply"]

MAX_TAIL = 20  # tokens of a breaker after its head, as llama.cpp
_BYTES_OBJ = 33 + 8  # a bytes object's header and its list slot (64-bit CPython)
MAX_BREAKERS, MAX_BREAKER_CHARS = 64, 40  # drySequenceBreakers (sampling/table.py checks them)
FLOAT_MAX_LOG = 88.7228391  # log of the largest float32: caps the exponent

_EMPTY_I = np.empty(0, np.int32)
_EMPTY_F = np.empty(0, np.float64)


def breakers(vocab: Any, strings: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """head token -> the tails (token tuples) of the breakers starting with it; an empty
    tail means the head token alone is a breaker. Computed once per vocabulary and
    breaker set (vocab.memo).

    Bounded per breaker, whatever its text: the tokens whose piece holds it are found in
    all pieces joined into one bytes string (one scan), and for each of its proper
    prefixes the tokens whose piece ends with it by a binary search among the reversed
    pieces, sorted once per vocabulary; a tail is tokenized once per prefix that has
    such a token. The issue-43 line (64 breakers of 40 characters: llama.cpp's own caps
    on a breaker's length and tail, with a count of 64) took 35 s by scanning the
    joined pieces once per prefix; tests/test_sampling_dry_bound.py keeps the cost
    bounded and the result equal to the scan's."""
    def make() -> dict[int, tuple[tuple[int, ...], ...]]:
        index = vocab.memo("dry-index", lambda: _Index(vocab.pieces()))
        n = len(index.order)
        alone = np.zeros(n, bool)  # tokens whose piece holds a breaker: the empty tail
        tails: list[tuple[int, ...]] = []
        heads, ids = [], []  # (token, tail id) pairs, as arrays
        for s in dict.fromkeys(strings):  # each distinct breaker once
            b = s.encode("utf-8")
            if not b:
                continue
            inside = np.zeros(n, bool)
            inside[index.holding(b)] = True
            alone |= inside
            for k in range(len(b) - 1, 0, -1):  # a piece ending with b[:k]: the rest follows
                h = index.ending_with(b[:k])
                h = h[~inside[h]]
                if h.size:
                    heads.append(h)
                    ids.append(np.full(h.size, len(tails), np.int64))
                    tails.append(tuple(vocab.tokenize(b[k:])[:MAX_TAIL]))
        out = {t: [()] for t in np.flatnonzero(alone).tolist()}
        if heads:
            key = np.sort(np.concatenate(heads) * len(tails) + np.concatenate(ids))
            key = key[np.concatenate(([True], key[1:] != key[:-1]))]  # each pair once
            toks, tids = (key // len(tails)).tolist(), (key % len(tails)).tolist()
            for t, i in zip(toks, tids):
                out.setdefault(t, []).append(tails[i])
        return {t: tuple(v) for t, v in out.items()}
    return vocab.memo("dry-breaker-sets", _Recent).get(strings, make)


#: breaker sets kept per vocabulary, the most recently used (one took 28 MiB measured when
#: 64 breakers touched most of the vocabulary; the default set 0.14 MiB)
MAX_BREAKER_SETS = 4


class _Recent:
    """The breaker tables of the most recently used sets (least recently used dropped
    first), shared by the reader threads (which prepare them: engine/prepare.py) and
    the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: OrderedDict = OrderedDict()

    def get(self, key: tuple[str, ...], make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._sets:
                self._sets.move_to_end(key)
                return self._sets[key][0]
        value = make()  # outside the lock: two threads may both make it, the same table
        with self._lock:
            self._sets[key] = (value, table_bytes(value))
            self._sets.move_to_end(key)
            while len(self._sets) > MAX_BREAKER_SETS:
                self._sets.popitem(last=False)
        return value

    def held(self) -> tuple[int, int]:
        """(sets kept, their estimated bytes)."""
        with self._lock:
            return len(self._sets), sum(b for _, b in self._sets.values())


#: a table's bytes per token and per further tail, measured with tracemalloc (112-153
#: bytes per token over three sets, the worst 28 MiB for 194k tokens and 655k tails)
ENTRY_BYTES, TAIL_BYTES = 120, 16


def table_bytes(table: dict) -> int:
    return ENTRY_BYTES * len(table) + TAIL_BYTES * sum(len(v) - 1 for v in table.values())


def held(vocab: Any, longest_piece: int) -> dict:
    """What DRY keeps for a vocabulary (engine/accounting.py, `stats`): its breaker sets
    now, the index included once built (~21 MiB here), and the bound: every token in
    every kept set with a tail per breaker and prefix (loose: 28 MiB is the most seen)."""
    sets = vocab.peek("dry-breaker-sets")
    n, b = sets.held() if sets is not None else (0, 0)
    index = vocab.peek("dry-index")
    per_set = (ENTRY_BYTES + TAIL_BYTES * MAX_BREAKERS * (MAX_BREAKER_CHARS * 4 - 1)) * vocab.n_vocab
    index_max = vocab.n_vocab * (2 * longest_piece + _BYTES_OBJ + 33)
    return {"entries": n, "maxEntries": MAX_BREAKER_SETS,
            "bytes": b + (index.nbytes if index is not None else 0),
            "maxBytes": MAX_BREAKER_SETS * per_set + index_max}


class _Index:
    """The vocabulary's pieces arranged for breaker searches: joined into one bytes
    string (where each starts, how long each is), and reversed and sorted."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.lens = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
        self.starts = np.concatenate(([0], np.cumsum(self.lens + 1)[:-1]))
        self.blob = b"\x00".join(pieces) + b"\x00"
        rev = [p[::-1] for p in pieces]
        order = sorted(range(len(pieces)), key=rev.__getitem__)
        self.order = np.array(order, np.int64)
        self.rev_sorted = [rev[i] for i in order]
        self.pad = b"\xff" * (int(self.lens.max(initial=0)) + 1)
        self.nbytes = (len(self.blob) + sum(len(r) + _BYTES_OBJ for r in self.rev_sorted)
                       + self.lens.nbytes + self.starts.nbytes + self.order.nbytes)


    def holding(self, b: bytes) -> np.ndarray:
        """The tokens whose piece contains b."""
        blob = self.blob
        if len(b) == 1:
            pos = np.flatnonzero(np.frombuffer(blob, np.uint8) == b[0])
        else:
            found, at = [], blob.find(b)
            while at >= 0:
                found.append(at)
                at = blob.find(b, at + 1)
            pos = np.array(found, np.int64)
        owner = np.searchsorted(self.starts, pos, side="right") - 1
        fits = pos + len(b) <= self.starts[owner] + self.lens[owner]  # not across a separator
        return owner[fits]

    def ending_with(self, suffix: bytes) -> np.ndarray:
        """The tokens whose piece ends with suffix: those whose reversed piece starts with
        the reversed suffix, one run of the sorted list (two binary searches)."""
        r = suffix[::-1]
        lo = bisect.bisect_left(self.rev_sorted, r)
        hi = bisect.bisect_left(self.rev_sorted, r + self.pad, lo)  # past every piece r + rest
        return self.order[lo:hi]


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
