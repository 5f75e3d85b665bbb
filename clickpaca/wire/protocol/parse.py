"""A request line to its typed request: `parse_line` decodes and bounds the line,
`validate` walks the request's field table (declare.py), refusing unknown fields with a
hint for a misspelt one, and runs its type's checks across fields; anything refused is a
`ProtocolError` naming the wire field and the reason.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, dataclass
from typing import Any

import orjson

from ...base.fieldcheck import show as _show
from ...sampling.params import misspellings
from .declare import REQUEST_TYPES, REQUESTS, Request, with_params
from .events import error_event


MAX_LINE_BYTES = 16 * 1024 * 1024  # a line longer than this is refused (and skipped)
# Nesting of arrays/objects in one request line. Requests are at most 3 deep (logit_bias);
# a deeper line is refused before anything walks it recursively (repr of a 1,000-deep
# value raised RecursionError and ended the reader thread).
MAX_JSON_DEPTH = 32


@dataclass
class ProtocolError(Exception):
    """A request that cannot be served; becomes an `error` event."""

    message: str
    seq_id: int = -1
    request: str | None = None

    def __str__(self) -> str:
        return self.message

    def event(self) -> dict:
        return error_event(self.message, self.seq_id, self.request)


def json_depth(obj: Any, limit: int) -> int:
    """Nesting depth of arrays/objects, without recursion; stops counting past `limit`."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _did_you_mean(name: str, spec: dict) -> str:
    """A hint for a misspelt field: another server's name for it (llama-server's top_k),
    else the closest field of this request, ignoring case."""
    guess = misspellings().get(name)
    if guess is None:
        lowered = {f.lower(): f for f in spec}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.8)
        guess = lowered[close[0]] if close else None
    return f" (did you mean {guess}?)" if guess in spec else ""


def validate(obj: Any) -> Request:
    """A typed request (defaults filled in) or ProtocolError naming the field."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"request must be a JSON object, got {type(obj).__name__}")
    seq_id = obj.get("seq_id", -1)
    seq_id = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else -1
    kind = obj.get("type", MISSING)
    if kind is MISSING:
        raise ProtocolError("type: missing (one of " + ", ".join(REQUESTS) + ")", seq_id)
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise ProtocolError(f"type: unknown request type {_show(kind)} (one of "
                            + ", ".join(REQUESTS) + ")", seq_id)
    spec = REQUESTS[kind]
    for name in obj:
        if name != "type" and name not in spec:
            raise ProtocolError(f"{name}: unknown field for {kind}{_did_you_mean(name, spec)}",
                                seq_id, kind)
    values: dict[str, Any] = {}
    for name, (check, default) in spec.items():
        if check is with_params:
            continue
        if name in obj:
            try:
                values[name] = check(name, obj[name])
            except ValueError as e:  # a check names its field; one from deeper down (int()) gets it here
                msg = str(e)
                raise ProtocolError(msg if msg.startswith(name) else f"{name}: {msg}", seq_id, kind) from None
        elif default is MISSING:
            raise ProtocolError(f"{name}: missing (required for {kind})", seq_id, kind)
        else:
            values[name] = default
    cls = REQUEST_TYPES[kind]
    try:
        cls.check_across(obj, values)
    except ValueError as e:
        raise ProtocolError(str(e), seq_id, kind) from None
    return cls(**values)


def parse_line(line: bytes) -> Request:
    """Decode and validate one request line into its typed request."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line too long: {len(line)} bytes (limit {MAX_LINE_BYTES})")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"not valid JSON: {e}") from None
    # cheap first: a line with few brackets cannot be deep
    if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        seq_id = obj.get("seq_id", -1) if isinstance(obj, dict) else -1
        seq_id = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else -1
        kind = obj.get("type") if isinstance(obj, dict) else None
        raise ProtocolError(f"request nested deeper than {MAX_JSON_DEPTH} levels of arrays/objects",
                            seq_id, kind if isinstance(kind, str) and kind in REQUESTS else None)
    return validate(obj)
