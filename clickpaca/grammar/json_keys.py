"""No JSON object repeats a key: the tokens that would close a key already present are banned.

A JSON schema's default ``additionalProperties`` (and ``patternProperties``) lets
llguidance write any key, also one the object already holds; a parser then keeps one of
the two values and drops the other in silence. llguidance does not track keys, so this
module does, beside its mask:

- `KeyTracker` follows one sequence's output, byte by byte, as a JSON lexer: the stack of
  open objects and arrays, each object's keys (decoded: ``"\\u0061"`` is the key ``a``),
  and the string being written (a key or a value, its raw bytes so far). Tokens are
  queued by `push` (the engine thread, O(1)) and read when the next mask is made.
- `KeyIndex` indexes the vocabulary's tokens that hold a double quote, once per model (as
  the DRY breaker index does for breakers): by the text before their first quote (a token
  that ends the key being written) and by every complete quoted string in them (a token
  that writes a whole key, ``"id":``, also after closing a value, ``", "id``).
- `KeyTracker.ban` clears, in a mask row, each token that would close a key equal to one
  the object holding it already has: "the key text as it would stand after this token,
  closed, equals an existing key at that level". Tokens that finish the key being written
  come straight from the index (the keys of this object that start with what is written;
  a key split inside a UTF-8 character or an escape is checked against every quoted
  token: milliseconds, and rare); a token that writes a whole key, or closes objects first (``}, "a"``), is
  checked by running the lexer over it from the present state.

grammars/ applies the ban after llguidance's mask, where masks are made (on the
mask-ahead worker during the decode). When the ban leaves nothing, the tracker says so
(`exhausted`) and the request ends with ``stop_reason: "repeated_key"``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Sequence

import numpy as np

__all__ = ["KeyIndex", "KeyTracker", "decode_key", "repeated_keys"]

_Q, _BS = 0x22, 0x5C  # '"', '\\'
_CONTROL = re.compile(rb"[\x00-\x1f]")  # not allowed unescaped in a JSON string
_EMPTY = np.empty(0, dtype=np.int64)


def decode_key(raw: bytes) -> str | None:
    """The key a JSON string's raw content (between its quotes) means; None if invalid."""
    if b"\\" not in raw and b'"' not in raw:  # no escape: the bytes are the text
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
        return None if _CONTROL.search(raw) else text
    try:
        return json.loads(b'"' + bytes(raw) + b'"')
    except ValueError:
        return None


def _quoted(piece: bytes, inside: bool) -> tuple[bytes | None, list[tuple[bytes, bool]]]:
    """Scan a token's bytes starting inside a string (or not): the raw bytes before the
    first closing quote (None: none, or starting outside), and the raw contents of the
    complete quoted strings after it, each with whether it may be a key (a ',' or '{'
    came after the string before it; the first, starting outside, may always be)."""
    head, done, cur, in_str, pending = None, [], bytearray(), inside, 0
    may_key = opened = not inside
    for b in piece:
        if in_str:
            if pending == -1:
                pending = 4 if b == 0x75 else 0
                cur.append(b)
            elif pending > 0:
                pending -= 1
                cur.append(b)
            elif b == _BS:
                pending = -1
                cur.append(b)
            elif b == _Q:
                in_str, opened = False, False
                if inside and head is None:
                    head = bytes(cur)
                else:
                    done.append((bytes(cur), may_key))
                cur = bytearray()
            else:
                cur.append(b)
        elif b == _Q:
            in_str, cur, may_key = True, bytearray(), opened
        elif b in b",{":
            opened = True
    if inside and head is None:
        return None, []
    return head, done


class KeyIndex:
    """The vocabulary's quote-holding tokens, by what they write (module doc)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        closing: dict[str, list[int]] = defaultdict(list)
        whole: dict[str, list[int]] = defaultdict(list)
        quoted, twice, more = [], [], []
        self.heads: dict[int, bytes] = {}  # token -> its bytes before the quote that ends a string
        self.escaped_heads: dict[int, bytes] = {}  # those holding an escape
        self.closing_raw: dict[bytes, list[int]] = {}  # the others, by their raw bytes
        for t, p in enumerate(self.pieces):
            if b'"' not in p or p.startswith(b"\xff"):
                continue  # special tokens (b"\xff" prefix) write no text
            quoted.append(t)
            head, rest = _quoted(p, True)
            if head is not None:
                self.heads[t] = head
                if b"\\" in head:
                    self.escaped_heads[t] = head
                else:
                    self.closing_raw.setdefault(head, []).append(t)
                if any(may for _, may in rest):
                    more.append(t)  # ends a string, then writes a whole key: `", "id"`
                key = decode_key(head)
                if key is not None:
                    closing[key].append(t)
            _, rest_out = _quoted(p, False)  # from outside: every complete string
            for raw, _ in {*rest, *rest_out}:
                key = decode_key(raw)
                if key is not None:
                    whole[key].append(t)
            if any(may and any(decode_key(r) == decode_key(raw) for r, _ in strings[:i])
                   for strings in (rest, rest_out) for i, (raw, may) in enumerate(strings)):
                twice.append(t)  # may write one key twice by itself: `{"a": 1, "a"`
        self.closing = {k: np.array(v, dtype=np.int64) for k, v in closing.items()}
        self.whole = {k: tuple(sorted(set(v))) for k, v in whole.items()}
        self.quoted = np.array(quoted, dtype=np.int64)
        self.twice = tuple(twice)
        self.more = tuple(more)


class _Frame:
    __slots__ = ("obj", "keys", "want_key")

    def __init__(self, obj: bool) -> None:
        self.obj = obj
        self.keys: set[str] = set()
        self.want_key = obj  # right after '{' or ',' in an object

    def copy(self) -> "_Frame":
        f = _Frame(self.obj)
        f.keys, f.want_key = set(self.keys), self.want_key
        return f


class _State:
    """The lexer's state: open containers, the string being written and its escape."""

    __slots__ = ("stack", "in_str", "is_key", "raw", "pending", "repeats", "version")

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.in_str = False
        self.is_key = False
        self.raw = bytearray()
        self.pending = 0  # -1: after a backslash; n > 0: hex digits of \\u left
        self.repeats = 0  # keys closed that their object already had
        self.version = 0  # changes whenever an object opens, closes or gains a key

    def copy(self) -> "_State":
        s = _State()
        s.stack = [f.copy() for f in self.stack]
        s.in_str, s.is_key, s.raw, s.pending = self.in_str, self.is_key, bytearray(self.raw), self.pending
        s.repeats = self.repeats
        return s

    def feed(self, data: bytes) -> str | None:
        """Advance over bytes; the first key closed that its object already has (it is
        not added again), or None."""
        repeat = None
        for b in data:
            if self.in_str:
                if self.pending == -1:
                    self.pending = 4 if b == 0x75 else 0
                elif self.pending > 0:
                    self.pending -= 1
                elif b == _BS:
                    self.pending = -1
                elif b == _Q:
                    self.in_str = False
                    if self.is_key:
                        key = decode_key(self.raw)
                        frame = self.stack[-1]
                        key = key if key is not None else repr(bytes(self.raw))
                        if key in frame.keys:
                            repeat = repeat if repeat is not None else key
                            self.repeats += 1
                        frame.keys.add(key)
                        frame.want_key = False
                        self.version += 1
                    continue
                if self.is_key:
                    self.raw.append(b)
            elif b == _Q:
                top = self.stack[-1] if self.stack else None
                self.in_str, self.pending = True, 0
                self.is_key = top is not None and top.obj and top.want_key
                self.raw = bytearray()
            elif b == 0x7B:  # {
                self.stack.append(_Frame(True))
                self.version += 1
            elif b == 0x5B:  # [
                self.stack.append(_Frame(False))
            elif b in (0x7D, 0x5D):  # } ]
                if self.stack:
                    self.version += self.stack.pop().obj
            elif b == 0x2C and self.stack and self.stack[-1].obj:  # ,
                self.stack[-1].want_key = True
        return repeat

    def would_repeat(self, data: bytes) -> bool:
        """Whether these bytes, from the present state, close a key its object already
        holds (`feed` without changing anything: the frames they open, close or add keys
        to are kept aside)."""
        stack = self.stack
        in_str, is_key, pending = self.in_str, self.is_key, self.pending
        raw = bytearray(self.raw) if in_str and is_key else bytearray()
        depth = len(stack)          # stack[:depth] are still open
        extra: list[_Frame] = []    # frames these bytes opened
        added: dict[int, set] = {}  # keys these bytes gave to stack[i]
        want: dict[int, bool] = {}  # want_key these bytes set on stack[i]
        for b in data:
            if in_str:
                if pending == -1:
                    pending = 4 if b == 0x75 else 0
                elif pending > 0:
                    pending -= 1
                elif b == _BS:
                    pending = -1
                elif b == _Q:
                    in_str = False
                    if is_key:
                        key = decode_key(raw)
                        key = key if key is not None else repr(bytes(raw))
                        if extra:
                            if key in extra[-1].keys:
                                return True
                            extra[-1].keys.add(key)
                            extra[-1].want_key = False
                        else:
                            i = depth - 1
                            mine = added.setdefault(i, set())
                            if key in stack[i].keys or key in mine:
                                return True
                            mine.add(key)
                            want[i] = False
                    continue
                if is_key:
                    raw.append(b)
            elif b == _Q:
                in_str, pending, raw = True, 0, bytearray()
                if extra:
                    is_key = extra[-1].obj and extra[-1].want_key
                else:
                    is_key = depth > 0 and stack[depth - 1].obj and want.get(depth - 1, stack[depth - 1].want_key)
            elif b == 0x7B or b == 0x5B:  # { [
                extra.append(_Frame(b == 0x7B))
            elif b in (0x7D, 0x5D):  # } ]
                if extra:
                    extra.pop()
                elif depth:
                    depth -= 1
            elif b == 0x2C:  # ,
                if extra:
                    extra[-1].want_key = extra[-1].obj
                elif depth and stack[depth - 1].obj:
                    want[depth - 1] = True
        return False


def repeated_keys(text: str | bytes) -> int:
    """How many keys of a JSON text (complete or cut short) repeat one their object
    already has (for counting outputs, e.g. a peer's)."""
    state = _State()
    state.feed(text.encode() if isinstance(text, str) else text)
    return state.repeats


class KeyTracker:
    """One sequence's keys (module doc): `push` tokens as they are accepted, `ban` them
    from a mask row before the next token is drawn."""

    __slots__ = ("index", "state", "queued", "history", "acted", "exhausted", "repeats", "_whole")

    def __init__(self, index: KeyIndex) -> None:
        self.index = index
        self.state = _State()
        self.queued: list[int] = []
        self.history: list[int] = []  # every token pushed (a rollback replays them)
        self.acted = 0        # masks the ban narrowed
        self.exhausted = False  # the last ban left nothing
        self.repeats = 0      # keys repeated anyway (the ban missed one: never expected)
        self._whole: tuple[int, frozenset] = (-1, frozenset())  # (state version, whole-key candidates)

    def push(self, token: int) -> None:
        self.queued.append(int(token))
        self.history.append(int(token))

    def rollback(self, n: int) -> None:
        """Undo the last n pushed tokens (replays the rest)."""
        keep = self.history[:max(0, len(self.history) - int(n))]
        self.state, self.queued, self.history = _State(), [], []
        for t in keep:
            self.push(t)

    def fork(self) -> "KeyTracker":
        k = KeyTracker(self.index)
        k.state, k.queued, k.history = self.state.copy(), list(self.queued), list(self.history)
        k.acted, k.repeats = self.acted, self.repeats
        return k

    def _catch_up(self) -> None:
        pieces = self.index.pieces
        for t in self.queued:
            if t < len(pieces) and not pieces[t].startswith(b"\xff"):
                if self.state.feed(pieces[t]) is not None:
                    self.repeats += 1
        self.queued = []

    def banned(self) -> np.ndarray:
        """The tokens that would close a key already present at its level (ascending)."""
        self._catch_up()
        s, idx = self.state, self.index
        found: list[np.ndarray] = []  # banned, straight from the index
        check: set[int] = set(idx.twice)  # candidates, run through the lexer
        out: list[int] = []
        if s.in_str and s.is_key:
            keys = s.stack[-1].keys
            if keys and s.pending != 0:  # inside an escape: every quoted token
                check.update(idx.quoted.tolist())
            elif keys:
                written = decode_key(s.raw)
                if written is not None:
                    found += [idx.closing[k[len(written):]] for k in keys
                              if k.startswith(written) and k[len(written):] in idx.closing]
                else:
                    out += self._inside_character(keys)
            check.update(idx.more)  # the key it ends may come again in the same token
        version, whole = self._whole
        if version != s.version:  # the tokens writing a present key whole, kept until keys change
            whole = frozenset(t for f in s.stack if f.obj for k in f.keys for t in idx.whole.get(k, ()))
            self._whole = (s.version, whole)
        if check or whole:
            pieces = idx.pieces
            out += [t for t in check.union(whole) if s.would_repeat(pieces[t])]
        if out:
            found.append(np.array(out, dtype=np.int64))
        if not found:
            return _EMPTY
        return np.unique(np.concatenate(found)) if len(found) > 1 or out else found[0]

    def _inside_character(self, keys: set[str]) -> list[int]:
        """Closing tokens when the key written so far ends inside a UTF-8 character: the
        rest of each candidate key's bytes looked up by raw head, the few heads holding
        an escape decoded one by one."""
        raw, idx = bytes(self.state.raw), self.index
        cut = len(raw)
        while cut > 0 and len(raw) - cut < 3 and raw[cut - 1] & 0xC0 == 0x80:
            cut -= 1
        cut -= 1 if cut > 0 and raw[cut - 1] >= 0xC0 else 0
        clean, tail = decode_key(raw[:cut]), raw[cut:]
        if clean is None:  # not a split character after all: every closing token
            return [t for t, head in idx.heads.items() if decode_key(raw + head) in keys]
        out = [t for t, head in idx.escaped_heads.items() if decode_key(raw + head) in keys]
        for k in keys:
            if k.startswith(clean):
                need = k[len(clean):].encode("utf-8")
                if need.startswith(tail) and need[len(tail):] in idx.closing_raw:
                    out += idx.closing_raw[need[len(tail):]]
        return out

    def ban(self, row: np.ndarray) -> None:
        """Clear the banned tokens' bits in one mask row (int32 words, llguidance's
        layout); counts the masks it narrowed and notes when it left nothing."""
        ids = self.banned()
        self.exhausted = False
        if ids.size == 0:
            return
        words = row.view(np.uint32)
        ids = ids[ids < 32 * words.size]
        bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
        hit = (words[ids >> 5] & bits) != 0
        if not hit.any():
            return
        self.acted += 1
        np.bitwise_and.at(words, ids[hit] >> 5, ~bits[hit])
        self.exhausted = not words.any()
