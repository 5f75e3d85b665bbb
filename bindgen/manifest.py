"""The API manifest of one build: what bindgen/report.py compares between versions.

Every function with its prototype (and its signature without parameter names), every
record with its size and field offsets (as cffi lays them out, which the layout proof
checks against the compiler), every enum with its values, callbacks and constants.
"""

from __future__ import annotations

from typing import Any

from .cparse import Declarations


def record_layout(ffi: Any, name: str) -> dict[str, Any] | None:
    """Size and fields of a complete struct/union; None for opaque ones."""
    try:
        t = ffi.typeof(name)
        size = ffi.sizeof(t)
    except Exception:  # noqa: BLE001 - cffi raises several types for incomplete types
        return None
    fields = []
    for fname, f in t.fields or []:
        entry = {"name": fname, "type": type_name(f.type.cname, name, fname), "offset": f.offset}
        if f.bitsize != -1:
            entry["bits"] = f.bitsize
            entry["bit_shift"] = f.bitshift
        fields.append(entry)
    return {"size": size, "fields": fields}


def type_name(cname: str, record: str, field: str) -> str:
    """cffi names anonymous types by a counter ("struct $1"), which shifts from one header
    version to the next; name them by where they sit instead."""
    if "$" not in cname:
        return cname
    kind = cname.split()[0] if cname.split()[0] in ("struct", "union", "enum") else "type"
    rest = cname.split("$", 1)[1].lstrip("0123456789")
    return f"{kind} (anonymous, in {record}.{field}){rest}"


def build_manifest(ffi: Any, decls: Declarations, stamp: dict[str, Any]) -> dict[str, Any]:
    records = {}
    for name in decls.records:
        layout = record_layout(ffi, name)
        if layout is not None:
            records[name] = layout
    return {
        "stamp": stamp,
        "functions": dict(sorted(decls.functions.items())),
        "signatures": dict(sorted(decls.signatures.items())),
        "records": dict(sorted(records.items())),
        "enums": dict(sorted(decls.enums.items())),
        "callbacks": dict(sorted(decls.callbacks.items())),
        "constants": dict(sorted(decls.constants.items())),
        "skipped": dict(sorted(decls.skipped.items())),
    }
