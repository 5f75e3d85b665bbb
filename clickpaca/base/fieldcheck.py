"""The checks of a request's fields, and the one style of their error messages.

A check is a function (name, value) -> the value to use, or ``FieldError`` naming the
field: ``FIELD: must be ..., got VALUE``, the value rendered as JSON (``got "x"``,
``got [1, 2]``, ``got null``; ``show``), as the client wrote it. The protocol's request
fields (wire/protocol/) and the sampler steps' parameters (sampling/registry.py, and a
user step's own checks) are built from these, so the same mistake reads the same
whatever the field.

One rule for numbers: an integer field takes an integer only (a JSON number written
with a fraction or an exponent, ``40.0`` or ``4e1``, is refused whatever its value); a
real field takes any finite number; true and false are never numbers.

Imports nothing from clickpaca: every layer may use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import orjson

__all__ = ["FieldError", "Check", "show", "is_int", "is_real", "to_float", "integer", "real", "boolean",
           "string", "optional", "one_of", "string_list", "choice_strings"]

#: A field check: (field name, value) -> the value to use, or FieldError.
Check = Callable[[str, Any], Any]


class FieldError(ValueError):
    """A bad field: ``field`` is its wire name, ``reason`` the why; str() is
    "field: reason", the text of the error event."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def show(v: Any) -> str:
    """A short rendering of a value for an error message, as JSON; never raises."""
    try:
        text = orjson.dumps(v).decode() if not isinstance(v, float) or math.isfinite(v) else str(v)
    except TypeError:  # e.g. an int beyond 64 bits, or nesting orjson refuses
        text = repr(v) if isinstance(v, int) and not isinstance(v, bool) else f"a {type(v).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # numpy's bool is no number either


def is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not _is_bool(v)


def is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not _is_bool(v)


def to_float(v: numbers.Real) -> float:
    """float(v); an integer beyond the float range (only in-process: JSON numbers that
    large arrive as inf and are refused by the parser) becomes +-inf, not OverflowError."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    """An integer in [lo, hi] (either bound may be None), returned as int."""
    def check(name: str, v: Any) -> int:
        if not is_int(v):
            raise FieldError(name, f"must be an integer, got {show(v)}")
        x = int(v)
        if lo is not None and x < lo:
            raise FieldError(name, f"must be >= {lo}, got {x}")
        if hi is not None and x > hi:
            raise FieldError(name, f"must be <= {hi}, got {x}")
        return x
    return check


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Check:
    """A finite number in [lo, hi] (or (lo, hi] with lo_open; either bound may be None),
    returned as float. ``check.range`` is (lo, hi, lo_open), for a docs table."""
    def check(name: str, v: Any) -> float:
        if not is_real(v):
            raise FieldError(name, f"must be a number, got {show(v)}")
        x = to_float(v)
        if not math.isfinite(x):
            raise FieldError(name, f"must be finite, got {show(x)}")
        bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
        if bad_lo and hi is None:
            raise FieldError(name, f"must be {'>' if lo_open else '>='} {lo:g}, got {show(x)}")
        if bad_lo or (hi is not None and x > hi):
            lo_s = "-inf" if lo is None else f"{lo:g}"
            raise FieldError(name, f"must be in {'(' if lo_open else '['}{lo_s}, {hi:g}], got {show(x)}")
        return x
    check.range = (lo, hi, lo_open)
    return check


def boolean(name: str, v: Any) -> bool:
    """true or false (not 0 / 1)."""
    if not _is_bool(v):
        raise FieldError(name, f"must be true or false, got {show(v)}")
    return bool(v)


def string(nonempty: bool = False, max_bytes: int | None = None) -> Check:
    """A string (non-empty when asked), at most ``max_bytes`` bytes of UTF-8."""
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str):
            raise FieldError(name, f"must be a string, got {show(v)}")
        if nonempty and not v:
            raise FieldError(name, "must not be empty")
        if max_bytes is not None and len(v) * 4 > max_bytes:  # UTF-8: at most 4 bytes a char
            n = len(v.encode("utf-8", "surrogatepass"))
            if n > max_bytes:
                raise FieldError(name, f"{n} bytes, the limit is {max_bytes}")
        return v
    return check


def optional(check: Check) -> Check:
    """``check``, or None for null."""
    return lambda name, v: None if v is None else check(name, v)


def one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or v not in choices:
            raise FieldError(name, f"must be one of {', '.join(choices)}, got {show(v)}")
        return v
    return check


def string_list(name: str, v: Any) -> list[str]:
    """A list of non-empty strings."""
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise FieldError(name, f"must be a list of strings, got {show(v)}")
    if any(not s for s in v):
        raise FieldError(name, "strings must not be empty")
    return v


def choice_strings(max_n: int, max_len: int) -> Check:
    """A list (or tuple) of at most max_n non-empty strings of at most max_len characters,
    returned as a tuple (hashable)."""
    def check(name: str, v: Any) -> tuple[str, ...]:
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise FieldError(name, f"must be a list of strings, got {show(v)}")
        if len(v) > max_n:
            raise FieldError(name, f"at most {max_n} strings, got {len(v)}")
        for s in v:
            if not isinstance(s, str) or not s:
                raise FieldError(name, f"entries must be non-empty strings, got {show(s)}")
            if len(s) > max_len:
                raise FieldError(name, f"entries must be at most {max_len} characters, got {len(s)}")
        return tuple(v)
    return check
