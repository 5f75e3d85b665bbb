"""The API manifest of one build, and the change report between two manifests.

The manifest is what a researcher reads after an upgrade: every function with its
prototype, every record with its size and field offsets (as cffi lays them out, which
the layout proof checks against the compiler), every enum with its values.
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
        entry = {"name": fname, "type": f.type.cname, "offset": f.offset}
        if f.bitsize != -1:
            entry["bits"] = f.bitsize
            entry["bit_shift"] = f.bitshift
        fields.append(entry)
    return {"size": size, "fields": fields}


def build_manifest(ffi: Any, decls: Declarations, stamp: dict[str, Any]) -> dict[str, Any]:
    records = {}
    for name in decls.records:
        layout = record_layout(ffi, name)
        if layout is not None:
            records[name] = layout
    return {
        "stamp": stamp,
        "functions": dict(sorted(decls.functions.items())),
        "records": dict(sorted(records.items())),
        "enums": dict(sorted(decls.enums.items())),
        "callbacks": dict(sorted(decls.callbacks.items())),
        "constants": dict(sorted(decls.constants.items())),
        "skipped": dict(sorted(decls.skipped.items())),
    }


def diff_manifests(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable lines: added / removed / changed functions, fields, enum values."""
    lines: list[str] = []

    def section(kind: str, a: dict, b: dict, describe) -> None:
        for k in sorted(b.keys() - a.keys()):
            lines.append(f"+ {kind} {k}")
        for k in sorted(a.keys() - b.keys()):
            lines.append(f"- {kind} {k}")
        for k in sorted(a.keys() & b.keys()):
            if a[k] != b[k]:
                lines.extend(describe(k, a[k], b[k]))

    def fn(k, a, b):
        return [f"~ function {k}: {a}  ->  {b}"]

    def rec(k, a, b):
        out = []
        if a["size"] != b["size"]:
            out.append(f"~ {k}: size {a['size']} -> {b['size']}")
        fa = {f["name"]: f for f in a["fields"]}
        fb = {f["name"]: f for f in b["fields"]}
        # sorted: set order changes from one process to the next (string hashing)
        for n in sorted(fb.keys() - fa.keys()):
            out.append(f"+ field {k}.{n} ({fb[n]['type']} at {fb[n]['offset']})")
        for n in sorted(fa.keys() - fb.keys()):
            out.append(f"- field {k}.{n}")
        for n in sorted(fa.keys() & fb.keys()):
            if fa[n] != fb[n]:
                out.append(f"~ field {k}.{n}: {fa[n]['type']} at {fa[n]['offset']} -> "
                           f"{fb[n]['type']} at {fb[n]['offset']}")
        order_a = [f["name"] for f in a["fields"] if f["name"] in fb]
        order_b = [f["name"] for f in b["fields"] if f["name"] in fa]
        if order_a != order_b:
            out.append(f"~ {k}: fields reordered")
        return out

    def enum(k, a, b):
        out = []
        for n in sorted(b.keys() - a.keys()):
            out.append(f"+ enum value {k}.{n} = {b[n]}")
        for n in sorted(a.keys() - b.keys()):
            out.append(f"- enum value {k}.{n}")
        for n in sorted(a.keys() & b.keys()):
            if a[n] != b[n]:
                out.append(f"~ enum value {k}.{n}: {a[n]} -> {b[n]}")
        return out

    def simple(kind):
        return lambda k, a, b: [f"~ {kind} {k}: {a} -> {b}"]

    section("function", old.get("functions", {}), new.get("functions", {}), fn)
    section("record", old.get("records", {}), new.get("records", {}), rec)
    section("enum", old.get("enums", {}), new.get("enums", {}), enum)
    section("callback", old.get("callbacks", {}), new.get("callbacks", {}), simple("callback"))
    section("constant", old.get("constants", {}), new.get("constants", {}), simple("constant"))
    return lines


def format_report(old_stamp: dict | None, new_stamp: dict, lines: list[str]) -> str:
    def who(s: dict | None) -> str:
        if not s:
            return "(no previous manifest)"
        return f"{s.get('flavor')} commit {s.get('commit')} build {s.get('build_number')}"

    head = f"API change report: {who(old_stamp)}  ->  {who(new_stamp)}"
    if not lines:
        return head + "\n  no changes"
    counts = {c: sum(1 for ln in lines if ln.startswith(c)) for c in "+-~"}
    summary = f"  {counts['+']} added, {counts['-']} removed, {counts['~']} changed"
    return "\n".join([head, summary, *("  " + ln for ln in lines)])
