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
as llama.cpp bounds them (at most 40 characters each; 64 of them), and making their
table is bounded per breaker (`make_table`).

A request's table is made when the request is prepared, off the engine thread
(engine/prepare.py), and its sampler holds it for the request's life (`StepContext
.prepared`); requests with the same set share it, and the tables alive together are
bounded (`Tables`, MAX_TABLE_BYTES). The context is the sequence's whole history
(prompt included), which held, forked and loaded sequences carry: DRY keeps no state of
its own.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

__all__ = ["Breakers", "breakers", "make_table", "dry_penalties", "apply"]

MAX_TAIL = 20  # tokens of a breaker after its head, as llama.cpp
_BYTES_OBJ = 33 + 8  # a bytes object's header and its list slot (64-bit CPython)
MAX_BREAKERS, MAX_BREAKER_CHARS = 64, 40  # drySequenceBreakers (sampling/table.py checks them)
FLOAT_MAX_LOG = 88.7228391  # log of the largest float32: caps the exponent

_EMPTY_I = np.empty(0, np.int32)
_EMPTY_F = np.empty(0, np.float64)


#: A table's fixed share (the object, its six arrays' headers), counted with its arrays.
TABLE_OVERHEAD = 1024


def make_table(vocab: Any, strings: tuple[str, ...]) -> "Breakers":
    """The breaker table of one set: for each token that starts a breaker, the tails
    (token tuples) that must follow it; an empty tail means the token alone is a breaker.

    Bounded per breaker, whatever its text: the tokens whose piece holds it are found in
    all pieces joined into one bytes string (one scan), and for each of its proper
    prefixes the tokens whose piece ends with it by a binary search among the reversed
    pieces, sorted once per vocabulary; a tail is tokenized once per prefix that has
    such a token. The pairs (token, tail) are sorted and made unique in numpy, so the
    cost does not grow with a Python loop over them (the 64 breakers of 40 characters
    of tests/test_sampling_dry_bound.py touch most of the vocabulary)."""
    index = index_of(vocab)
    n = len(index.order)
    alone = np.zeros(n, bool)  # tokens whose piece holds a breaker: the empty tail
    tails: dict[tuple[int, ...], int] = {(): 0}  # each distinct tail once; 0: the token alone
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
                tail = tuple(vocab.tokenize(b[k:])[:MAX_TAIL])
                heads.append(h)
                ids.append(np.full(h.size, tails.setdefault(tail, len(tails)), np.int64))
    first = np.flatnonzero(alone)
    heads.append(first)
    ids.append(np.zeros(first.size, np.int64))
    nt = len(tails)
    key = _sorted_unique(np.concatenate(heads).astype(np.int64) * nt + np.concatenate(ids))  # each pair once
    toks = key // nt
    at = np.flatnonzero(np.concatenate(([True], toks[1:] != toks[:-1])))
    head = toks[at]
    flat = [t for tail in tails for t in tail]
    lens = np.fromiter((len(t) for t in tails), np.int64, nt)
    return Breakers(tuple(strings), head.astype(np.int32),
                    np.append(at, key.size).astype(np.int32), (key % nt).astype(np.uint16),
                    np.array(flat, np.int32), np.concatenate(([0], np.cumsum(lens))).astype(np.int32))


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hashing unique took 1.6 s for 1.3 M pairs; this 0.1 s)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a


class Breakers:
    """One breaker set's table, as a few flat arrays (a dict of tuples took 120 bytes per
    token, 28 MiB for a set that touches most of the vocabulary; this takes about 10):
    `heads` the sorted tokens that start a breaker, `starts` where each one's tail ids
    begin in `tail_ids` (sorted: id 0, the empty tail, first), and the distinct tails
    one after another in `tail_tokens` (tail i is tail_tokens[tail_at[i]:tail_at[i + 1]]).
    A value: nothing changes it once made, so requests share it across threads."""

    __slots__ = ("strings", "heads", "starts", "tail_ids", "tail_tokens", "tail_at", "nbytes", "__weakref__")

    def __init__(self, strings: tuple[str, ...], heads: np.ndarray, starts: np.ndarray, tail_ids: np.ndarray,
                 tail_tokens: np.ndarray, tail_at: np.ndarray) -> None:
        self.strings = strings
        self.heads, self.starts, self.tail_ids = heads, starts, tail_ids
        self.tail_tokens, self.tail_at = tail_tokens, tail_at
        self.nbytes = TABLE_OVERHEAD + sum(a.nbytes for a in (heads, starts, tail_ids, tail_tokens, tail_at))

    @classmethod
    def from_mapping(cls, table: dict, strings: tuple[str, ...] = ()) -> "Breakers":
        """From {head token: tails} (the form llama.cpp's own test cases are written in)."""
        tails: dict[tuple[int, ...], int] = {(): 0}
        pairs = sorted({(int(t), tails.setdefault(tuple(tail), len(tails))) for t, v in table.items() for tail in v})
        toks = np.array([t for t, _ in pairs], np.int64)
        head, at = np.unique(toks, return_index=True)
        flat = [t for tail in tails for t in tail]
        lens = np.fromiter((len(t) for t in tails), np.int64, len(tails))
        return cls(strings, head.astype(np.int32), np.append(at, len(pairs)).astype(np.int32),
                   np.array([i for _, i in pairs], np.uint16), np.array(flat, np.int32),
                   np.concatenate(([0], np.cumsum(lens))).astype(np.int32))

    def __len__(self) -> int:
        return int(self.heads.size)

    def tails(self, token: int) -> tuple[tuple[int, ...], ...]:
        """The tails that follow `token` to make a breaker (() when it starts none)."""
        i = int(np.searchsorted(self.heads, token))
        if i == self.heads.size or self.heads[i] != token:
            return ()
        at, flat = self.tail_at, self.tail_tokens
        return tuple(tuple(flat[at[j]:at[j + 1]].tolist()) for j in self.tail_ids[self.starts[i]:self.starts[i + 1]])

    def found(self, tokens: np.ndarray) -> np.ndarray:
        """Whether each of `tokens` starts a breaker."""
        if self.heads.size == 0:
            return np.zeros(tokens.size, bool)
        i = np.minimum(np.searchsorted(self.heads, tokens), self.heads.size - 1)
        return self.heads[i] == tokens

    def alone(self, tokens: np.ndarray) -> np.ndarray:
        """Whether each of `tokens` is a breaker by itself (its tail ids start with 0)."""
        if self.heads.size == 0:
            return np.zeros(tokens.size, bool)
        i = np.minimum(np.searchsorted(self.heads, tokens), self.heads.size - 1)
        return (self.heads[i] == tokens) & (self.tail_ids[self.starts[i]] == 0)

    def mapping(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """{head token: tails}: the table written out (tests)."""
        return {t: self.tails(t) for t in self.heads.tolist()}


NO_BREAKERS = Breakers((), np.empty(0, np.int32), np.zeros(1, np.int32), np.empty(0, np.uint16),
                       np.empty(0, np.int32), np.zeros(1, np.int32))

#: The tables alive at once (held by requests, or kept as recent), together: a reader
#: thread that would go past it waits until requests end (one table alone may pass it).
#: The probe's sets (64 random breakers of 40 characters) took 2-4 MiB each.
MAX_TABLE_BYTES = 256 << 20
#: breaker sets kept after the requests that used them end, the most recently used (the
#: default set, sent by every DRY request that names none, is then not made again)
MAX_BREAKER_SETS = 4


def index_of(vocab: Any) -> "_Index":
    return vocab.memo("dry-index", lambda: _Index(vocab.pieces()))


def tables(vocab: Any) -> "Tables":
    """The vocabulary's breaker tables (made once per vocabulary)."""
    return vocab.memo("dry-tables", Tables)


def breakers(vocab: Any, strings: tuple[str, ...], where: str = "engine") -> Breakers:
    """The table of a breaker set, shared with every request that uses the same set
    (Tables.get); `where` it is made when none is alive: "reader" (a request's
    preparation, engine/prepare.py) or "engine" (the engine thread: counted, never waits)."""
    if not strings:
        return NO_BREAKERS
    return tables(vocab).get(vocab, tuple(strings), where)


class Tables:
    """The breaker tables alive for one vocabulary: each set's table is made once, off
    the engine thread (a request's preparation), and held by the requests that use it
    (their samplers) for their lives; a second request with the same set shares it, and
    the MAX_BREAKER_SETS most recent sets stay after their requests end.

    Bounded: the tables alive together take at most MAX_TABLE_BYTES (a table's bytes are
    its arrays', exact); a reader that would go past it drops kept sets, then waits for
    requests to end (one table alone may exceed it). One table is made at a time, so at
    most one more is in the making. The engine thread never waits (it would wait on
    itself): a table it must make (no reader prepared the request: in-process use) is
    counted in `builds["engine"]`, which a server's readers keep at 0."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # an RLock: a table freed while it is held re-enters
        self._making = threading.Lock()
        self._live: "weakref.WeakValueDictionary[tuple[str, ...], Breakers]" = weakref.WeakValueDictionary()
        self._recent: OrderedDict = OrderedDict()
        self.bytes = 0  # of the live tables
        self.builds = {"reader": 0, "engine": 0}
        self.waits = 0  # makings that waited for requests to end

    def get(self, vocab: Any, key: tuple[str, ...], where: str) -> Breakers:
        table = self._alive(key)
        if table is not None:
            return table
        if where == "engine":
            return self._admit(key, make_table(vocab, key), where, wait=False)
        with self._making:
            table = self._alive(key)  # made by another reader meanwhile
            if table is not None:
                return table
            return self._admit(key, make_table(vocab, key), where, wait=True)

    def _alive(self, key: tuple[str, ...]) -> Breakers | None:
        with self._cond:
            table = self._live.get(key)
            if table is not None:
                self._keep(key, table)
            return table

    def _admit(self, key: tuple[str, ...], table: Breakers, where: str, wait: bool) -> Breakers:
        with self._cond:
            waited = False
            while self.bytes and self.bytes + table.nbytes > MAX_TABLE_BYTES:
                if self._recent:  # a kept set no request holds is freed at once
                    self._recent.popitem(last=False)
                    continue
                if not wait:
                    break
                waited = True
                self._cond.wait(0.5)
            self.waits += waited
            self.bytes += table.nbytes
            weakref.finalize(table, self._freed, table.nbytes)
            self._live[key] = table
            self._keep(key, table)
            self.builds[where] += 1
        return table

    def _keep(self, key: tuple[str, ...], table: Breakers) -> None:
        self._recent[key] = table
        self._recent.move_to_end(key)
        while len(self._recent) > MAX_BREAKER_SETS:
            self._recent.popitem(last=False)

    def _freed(self, nbytes: int) -> None:
        with self._cond:
            self.bytes -= nbytes
            self._cond.notify_all()

    def held(self) -> tuple[int, int, int]:
        """(tables alive, their bytes, of them kept as recent)."""
        with self._cond:
            return len(self._live), self.bytes, len(self._recent)


def table_max_bytes(vocab: Any, index: "_Index") -> int:
    """The most one table can take for this vocabulary: every token a head (its `heads`
    and `starts` entries), 64 breakers each with a tail for every token that ends with
    one of its prefixes (at most `index.suffix_run` tokens per prefix length), and
    every tail distinct and of 20 tokens."""
    n_tails = 1 + MAX_BREAKERS * (MAX_BREAKER_CHARS * 4 - 1)
    pairs = vocab.n_vocab + MAX_BREAKERS * index.suffix_run
    return TABLE_OVERHEAD + 8 * vocab.n_vocab + 4 + 2 * pairs + 4 * MAX_TAIL * n_tails + 4 * (n_tails + 1)


def held(vocab: Any, longest_piece: int) -> dict:
    """What DRY keeps for a vocabulary (engine/accounting.py, `stats`): its breaker
    tables alive now, the index once built (~21 MiB here), and the bound: MAX_TABLE_BYTES
    (or one table alone, when larger) plus one in the making, plus the index. `builds`
    counts the tables made by readers and by the engine thread; `kept` the recent sets."""
    t = vocab.peek("dry-tables")
    n, b, kept = t.held() if t is not None else (0, 0, 0)
    index = vocab.peek("dry-index")
    index_max = vocab.n_vocab * (2 * longest_piece + _BYTES_OBJ + 33)
    one = table_max_bytes(vocab, index) if index is not None else 0
    return {"entries": n, "maxEntries": MAX_TABLE_BYTES // TABLE_OVERHEAD + 1,
            "bytes": b + (index.nbytes if index is not None else 0),
            "maxBytes": max(MAX_TABLE_BYTES, one) + one + index_max,
            "kept": kept, "builds": dict(t.builds) if t is not None else {"reader": 0, "engine": 0},
            "waits": t.waits if t is not None else 0}


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
        self.suffix_run = _suffix_runs(self.rev_sorted, MAX_BREAKER_CHARS * 4 - 1)

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


def _suffix_runs(rev_sorted: list[bytes], longest: int) -> int:
    """The sum over k = 1..longest of the most tokens whose pieces end with one same k
    bytes: the most (token, tail) pairs one breaker can add to a table (a prefix of k
    bytes gives a tail to the tokens that end with it). Those tokens are a run of the
    sorted reversed pieces whose neighbours share at least k bytes."""
    if len(rev_sorted) < 2:
        return longest * len(rev_sorted)
    common = np.fromiter((len(os.path.commonprefix((a, b))) for a, b in zip(rev_sorted, rev_sorted[1:])),
                         np.int64, len(rev_sorted) - 1)
    lens = np.fromiter((len(r) for r in rev_sorted), np.int64, len(rev_sorted))
    total = 0
    for k in range(1, longest + 1):
        if not (lens >= k).any():
            break
        edges = np.diff(np.concatenate(([0], (common >= k).view(np.int8), [0])))
        runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
        total += int(runs.max()) + 1 if runs.size else 1
    return total


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
                  brk: "Breakers | dict") -> tuple[np.ndarray, np.ndarray]:
    """(ids sorted int32, penalty float64) for the next token, from the context. `brk`:
    the set's table (or {head token: tails}, as llama.cpp's test cases write it)."""
    if not isinstance(brk, Breakers):
        brk = Breakers.from_mapping(brk)
    n = len(history) if last_n < 0 else min(len(history), last_n)
    if multiplier == 0 or n <= allowed:
        return _EMPTY_I, _EMPTY_F
    rev = history[::-1][:n]  # rev[i]: the i-th token from the end
    rep_limit = n
    if len(brk):
        for i in np.flatnonzero(brk.found(np.array(rev, np.int64))).tolist():
            longest = -1
            for tail in brk.tails(rev[i]):
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
    if not best:
        return _EMPTY_I, _EMPTY_F
    ids = np.fromiter(best.keys(), np.int32, len(best))
    exp = np.fromiter(best.values(), np.float64, len(best)) - allowed
    keep = ~brk.alone(ids)  # a token that alone is a breaker is never penalised
    if not keep.all():
        ids, exp = ids[keep], exp[keep]
        if ids.size == 0:
            return _EMPTY_I, _EMPTY_F
    max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    if max_exp > 0:
        exp = np.minimum(exp, max_exp)
    pen = multiplier * np.power(base, exp)
    o = np.argsort(ids)
    return ids[o], pen[o]


_last: list = [None, None]  # one-entry memo: touches() and run() of the same call share it


def penalties_for(p: Any, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    """The penalties for these params and this context (memoised for one call). The
    breaker table is the one the request's preparation made (`ctx.prepared["dry"]`);
    without one (in-process use) it is made here, on the calling thread, and counted."""
    n = len(ctx.history) if p.dry_penalty_last_n < 0 else min(len(ctx.history), p.dry_penalty_last_n)
    key = (p, tuple(ctx.history[len(ctx.history) - n:]))
    if _last[0] != key:
        brk = NO_BREAKERS
        if p.dry_sequence_breakers:
            brk = ctx.prepared.get("dry") if ctx.prepared else None
            if brk is None or brk.strings != p.dry_sequence_breakers:
                if ctx.vocab is None:
                    raise ValueError("drySequenceBreakers: DRY's sequence breakers need the model's vocabulary")
                brk = breakers(ctx.vocab, p.dry_sequence_breakers, "engine")
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
