"""Tokenizing any text in time linear in its size, with llama.cpp's own results.

llama_tokenize first splits the text at special tokens (`tokenizer_st_partition` in
llama-vocab.cpp) at a cost of (special tokens) x (text) plus (matches)^2: with Gemma 3's
6,249 control tokens, 16 KB of `<` took 2.7 s and 20,000 empty chat turns 50 s. `tokenize`
makes the same split here (tokens longest first, each taking its leftmost non-overlapping
occurrences in text no earlier token took, with LSTRIP / RSTRIP; a token is searched for only
when an 8-byte prefix of it occurs, its occurrences found with numpy over the bytes), then
hands each raw fragment to llama_tokenize alone with parse_special off, as llama.cpp does
after its split, so the ids are the same (tests/test_pretokenize.py checks them against
llama_tokenize on mixed texts) and no Python loop holds the GIL the engine thread needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# llama.h enum llama_token_attr
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED = 1 << 1, 1 << 3, 1 << 4
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
SPACES = b" \t\n\v\f\r"  # C isspace in the "C" locale
PREFIX = 8
TAKEN, DROPPED = 1, 2


class TooMany(ValueError):
    """The text has at least `n` tokens, more than the caller can use."""

    def __init__(self, n: int) -> None:
        super().__init__(f"at least {n} tokens")
        self.n = n


@dataclass(frozen=True)
class Special:
    id: int
    text: bytes
    attr: int


class Vocab:
    """The special tokens of one model, in llama.cpp's search order, and its BOS/EOS
    framing (what add_special puts around the text)."""

    def __init__(self, model) -> None:
        self.model = model
        lib, ffi, vocab = model.nat.lib, model.nat.ffi, model.vocab
        kinds = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        found = []
        longest = 0
        for t in range(model.n_vocab):
            attr = int(lib.llama_vocab_get_attr(vocab, t))
            text = ffi.string(lib.llama_vocab_get_text(vocab, t))
            longest = max(longest, len(text))
            if attr & kinds:
                found.append(Special(t, text, attr))
        self.longest_text = longest  # bytes; a token's piece is never longer (accounting.py)
        # llama.cpp: std::sort by text length, longest first (ties unspecified; ids here)
        found.sort(key=lambda s: (-len(s.text), s.id))
        self.all = tuple(s for s in found if s.text)
        self.user_defined = tuple(s for s in self.all if not s.attr & (ATTR_CONTROL | ATTR_UNKNOWN))
        self.head, self.tail = self._framing()

    def _framing(self) -> tuple[list[int], list[int]]:
        """The tokens add_special adds before and after a text (BOS, EOS, CLS/SEP...)."""
        core = list(self._raw(b"a"))
        both = list(self.model.tokenize(b"a", add_special=True, parse_special=False))
        for i in range(len(both) - len(core) + 1):
            if both[i:i + len(core)] == core:
                return both[:i], both[i + len(core):]
        return [], []  # pragma: no cover - a vocabulary that rewrites "a" when framed

    def _raw(self, data: bytes) -> np.ndarray:
        return self.model.tokenize(data, add_special=False, parse_special=False)

    def split(self, data: bytes, parse_special: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, token ids) of every special token llama.cpp would split out, by
        position, and a byte mask of what they (and stripped whitespace) cover."""
        specials = self.all if parse_special else self.user_defined
        n = len(data)
        arr = np.frombuffer(data, dtype=np.uint8)
        marks = np.zeros(n, dtype=np.uint8)
        starts: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        present: dict[bytes, bool] = {}
        for s in specials:
            key = s.text[:PREFIX]
            ok = present.get(key)
            if ok is None:
                ok = present[key] = key in data
            if not ok:
                continue
            first = data.find(s.text)
            if first < 0:
                continue
            if s.attr & (ATTR_LSTRIP | ATTR_RSTRIP):
                got = _take_one_by_one(data, marks, s, first)
            else:
                got = _take_all(arr, marks, s.text, first)
            if got.size:
                starts.append(got)
                ids.append(np.full(got.size, s.id, dtype=np.int32))
        if not starts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), marks
        st, tid = np.concatenate(starts), np.concatenate(ids)
        order = np.argsort(st, kind="stable")
        return st[order], tid[order], marks

    def tokenize(self, text: str | bytes, add_special: bool, parse_special: bool,
                 at_most: int | None = None) -> np.ndarray:
        """What llama_tokenize(text, add_special, parse_special) returns. Thread-safe:
        the reader threads of several clients call it at once. With `at_most`, TooMany
        as soon as the special tokens alone make more (before the fragments' work)."""
        data = encode(text)
        st, tid, marks = self.split(data, parse_special)
        if at_most is not None:
            least = st.size + (len(self.head) + len(self.tail) if add_special else 0)
            if least > at_most:
                raise TooMany(least)
        # raw fragments: the runs of untaken bytes
        free = np.concatenate(([0], (marks == 0).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(free))
        r_start, r_end = edges[0::2], edges[1::2]
        memo: dict[bytes, np.ndarray] = {}
        raw = []
        for a, b in zip(r_start.tolist(), r_end.tolist()):
            frag = data[a:b]
            toks = memo.get(frag)
            if toks is None:
                toks = memo[frag] = self._raw(frag)
            raw.append(toks)
        # fragments and special tokens in text order
        pieces: list[np.ndarray] = [np.asarray(self.head, dtype=np.int32)] if add_special else []
        if raw and st.size:
            where = np.concatenate((r_start, st))
            is_raw = np.concatenate((np.ones(len(raw), bool), np.zeros(st.size, bool)))
            idx = np.concatenate((np.arange(len(raw)), np.arange(st.size)))
            order = np.argsort(where, kind="stable")
            singles = [tid[i:i + 1] for i in range(st.size)]
            pieces += [raw[i] if r else singles[i] for r, i in zip(is_raw[order].tolist(), idx[order].tolist())]
        elif raw:
            pieces += raw
        elif st.size:
            pieces.append(tid)
        if add_special:
            pieces.append(np.asarray(self.tail, dtype=np.int32))
        if not pieces:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(pieces).astype(np.int32, copy=False)


def _take_all(arr: np.ndarray, marks: np.ndarray, text: bytes, first: int) -> np.ndarray:
    """The starts a token (no strip attributes) takes: its leftmost non-overlapping
    occurrences lying wholly in untaken bytes; marks them taken."""
    size, n = len(text), arr.size
    head = slice(first, n - size + 1)
    pos = np.flatnonzero((arr[head] == text[0]) & (marks[head] == 0)) + first
    for k in range(1, size):
        if pos.size == 0:
            return pos
        pos = pos[(arr[pos + k] == text[k]) & (marks[pos + k] == 0)]
    if pos.size == 0:
        return pos
    if pos.size > 1 and (np.diff(pos) < size).any():  # overlapping free occurrences: leftmost first
        keep, end = [], -1
        for p in pos.tolist():
            if p >= end:
                keep.append(p)
                end = p + size
        pos = np.asarray(keep, dtype=np.int64)
    if size == 1:
        marks[pos] = TAKEN
    else:
        marks[(pos[:, None] + np.arange(size)).ravel()] = TAKEN
    return pos


def _take_one_by_one(data: bytes, marks: np.ndarray, s: Special, start: int) -> np.ndarray:
    """As _take_all, for a token that also drops the whitespace beside it (LSTRIP/RSTRIP),
    following llama.cpp's loop match by match."""
    n, size, out = len(data), len(s.text), []
    while True:
        p = data.find(s.text, start)
        if p < 0:
            break
        busy = np.flatnonzero(marks[p:p + size])
        if busy.size:
            q = p + int(busy[0])
            free = np.flatnonzero(marks[q:] == 0)
            start = q + int(free[0]) if free.size else n  # every start in [p, q] covers q
            continue
        marks[p:p + size] = TAKEN
        out.append(p)
        end = p + size
        if s.attr & ATTR_LSTRIP:
            i = p
            while i > 0 and marks[i - 1] == 0 and data[i - 1] in SPACES:
                i -= 1
                marks[i] = DROPPED
        if s.attr & ATTR_RSTRIP:
            while end < n and marks[end] == 0 and data[end] in SPACES:
                marks[end] = DROPPED
                end += 1
        start = end
    return np.asarray(out, dtype=np.int64)


def encode(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)
