"""Tokenizing any text in time linear in its size, with llama.cpp's own results.

llama_tokenize first splits the text at special tokens (control, user-defined and
unknown tokens; `tokenizer_st_partition` in llama-vocab.cpp): for each special token,
longest first, it searches every raw fragment left, and every match walks the fragment
list from its head. The cost is (special tokens) x (text) plus (matches)^2: with the
default Gemma 3 vocabulary (6,249 control tokens, all starting with `<`, and 165
user-defined ones) 16 KB of `<` took 2.7 s and 20,000 empty chat turns 50 s (issue 30).

`tokenize` makes the same split here, then hands each raw fragment to llama_tokenize
alone with parse_special off. That is what llama.cpp does after its split (each raw
fragment goes to the tokenizer session by itself, with the space prefix of a fragment
that starts the text or follows a special token), so the ids are the same;
tests/test_pretokenize.py checks that against llama_tokenize on mixed texts.

The split: tokens in llama.cpp's order (longest text first), each taking its leftmost
non-overlapping occurrences that lie wholly in text no earlier token took (and
dropping the whitespace next to it when its attributes say LSTRIP / RSTRIP). Each
occurrence is found with bytes.find, skipping past text already taken, and a token is
searched for only when an 8-byte prefix of it occurs in the text at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# llama.h enum llama_token_attr
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED = 1 << 1, 1 << 3, 1 << 4
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
SPACES = b" \t\n\v\f\r"  # C isspace in the "C" locale
PREFIX = 8
TAKEN, DROPPED = 1, 2
_RAW = re.compile(rb"\x00+")


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
        for t in range(model.n_vocab):
            attr = int(lib.llama_vocab_get_attr(vocab, t))
            if attr & kinds:
                found.append(Special(t, ffi.string(lib.llama_vocab_get_text(vocab, t)), attr))
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

    def split(self, data: bytes, parse_special: bool) -> tuple[list[tuple[int, int, int]], bytearray]:
        """(start, end, token id) of every special token llama.cpp would split out, by
        position; a byte array marks what they (and stripped whitespace) cover."""
        specials = self.all if parse_special else self.user_defined
        n = len(data)
        marks = bytearray(n)
        taken: list[tuple[int, int, int]] = []
        present: dict[bytes, bool] = {}
        for s in specials:
            key = s.text[:PREFIX]
            ok = present.get(key)
            if ok is None:
                ok = present[key] = key in data
            if not ok:
                continue
            text, size, start = s.text, len(s.text), 0
            while True:
                p = data.find(text, start)
                if p < 0:
                    break
                busy = _first_busy(marks, p, p + size)
                if busy >= 0:
                    start = _next_free(marks, busy, n)  # every start in [p, busy] covers busy
                    continue
                marks[p:p + size] = b"\x01" * size
                taken.append((p, p + size, s.id))
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
        taken.sort()
        return taken, marks

    def tokenize(self, text: str | bytes, add_special: bool, parse_special: bool) -> np.ndarray:
        """What llama_tokenize(text, add_special, parse_special) returns. Thread-safe:
        the reader threads of several clients call it at once."""
        data = encode(text)
        taken, marks = self.split(data, parse_special)
        pieces: list[np.ndarray | list[int]] = [self.head] if add_special else []
        memo: dict[bytes, np.ndarray] = {}
        runs = [(m.start(), m.end()) for m in _RAW.finditer(marks)]
        ri = ti = 0
        while ri < len(runs) or ti < len(taken):
            if ti >= len(taken) or (ri < len(runs) and runs[ri][0] < taken[ti][0]):
                frag = data[runs[ri][0]:runs[ri][1]]
                toks = memo.get(frag)
                if toks is None:
                    toks = memo[frag] = self._raw(frag)
                pieces.append(toks)
                ri += 1
            else:
                pieces.append([taken[ti][2]])
                ti += 1
        if add_special:
            pieces.append(self.tail)
        if not pieces:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])


def _first_busy(marks: bytearray, lo: int, hi: int) -> int:
    """The first byte in [lo, hi) some token (or its stripped whitespace) took, or -1."""
    i = marks.find(b"\x01", lo, hi)
    j = marks.find(b"\x02", lo, hi)
    if i < 0:
        return j
    return i if j < 0 else min(i, j)


def _next_free(marks: bytearray, i: int, n: int) -> int:
    j = marks.find(b"\x00", i)
    return n if j < 0 else j


def encode(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)
