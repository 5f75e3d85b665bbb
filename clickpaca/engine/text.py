"""Turning token bytes into valid text, and finding stop strings in it.

Tokens are byte strings; a multi-byte UTF-8 character may be split across tokens.
`Utf8Assembler` holds back an incomplete tail so every emitted piece is valid text
(the held bytes come out with the token that completes them). `StopMatcher` watches
the emitted text for any of the request's stop strings.
"""

from __future__ import annotations


def _incomplete_tail(data: bytes) -> int:
    """How many trailing bytes form the start of a UTF-8 character not yet complete."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0b1100_0000 == 0b1000_0000:  # continuation byte: keep looking back
            continue
        if b & 0b1000_0000 == 0:  # ASCII: complete
            return 0
        need = 2 if b & 0b1110_0000 == 0b1100_0000 else 3 if b & 0b1111_0000 == 0b1110_0000 \
            else 4 if b & 0b1111_1000 == 0b1111_0000 else 1
        return back if back < need else 0
    return 0


class Utf8Assembler:
    """Feed token bytes, get valid text; invalid bytes become U+FFFD, never an exception."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> str:
        data = self.pending + data
        keep = _incomplete_tail(data)
        if keep:
            self.pending = data[-keep:]
            data = data[:-keep]
        else:
            self.pending = b""
        return data.decode("utf-8", "replace")

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the end: replaced)."""
        data, self.pending = self.pending, b""
        return data.decode("utf-8", "replace")


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.keep = max((len(s) for s in self.stops), default=0)
        self.tail = ""

    def feed(self, piece: str) -> str | None:
        """Return the stop string that the text now contains, else None."""
        if not self.stops or not piece:
            return None
        window = self.tail + piece
        found = [(window.find(s), -len(s), s) for s in self.stops if s in window]
        if found:
            return min(found)[2]  # the one that appears first in the text (longest on a tie)
        self.tail = window[-(self.keep - 1):] if self.keep > 1 else ""
        return None
