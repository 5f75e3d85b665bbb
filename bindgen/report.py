"""The change report between two manifests, for a person who is upgrading llama.cpp.

Order of importance, which is the order of the report:
1. what clickpaca's own code uses (found by bindgen/usage.py in the code itself) that is
   absent, renamed or changed in either version, each with where our code uses it and what
   to do;
2. the rest of the llama API: functions, records, enums (and callbacks, constants);
3. one line each for ggml/gguf internals and for fields that only moved (the generated
   bindings follow offsets by themselves), listed one by one with `full`.

The report always runs from the older version to the newer one (by build number), whichever
of the two was given as the baseline. `build_report` returns plain data (the JSON form);
`render_text` prints it. The differences come from bindgen/apidiff.py, what they mean for
our code from bindgen/impact.py.
"""

from __future__ import annotations

import textwrap
from typing import Any

from . import feature_table
from .apidiff import compare, ordered, version_label
from .impact import ours
from .usage import Usage, scan

WIDTH = 100


def build_report(old: dict | None, new: dict, usage: Usage | None = None) -> dict[str, Any]:
    """The report as plain data (what --json prints)."""
    if old is None:
        return {"from": None, "to": new["stamp"], "ours": [], "checked": {}, "api": None}
    old, new = ordered(old, new)
    usage = usage or scan()
    mine, counts = ours(old, new, usage)
    return {"from": old["stamp"], "to": new["stamp"], "ours": mine, "checked": counts,
            "features": {"from": feature_table.rows(old), "to": feature_table.rows(new)},
            "api": compare(old, new)}


def group_names(names: list[str], min_group: int = 2) -> list[str]:
    """llama_batch_ext_add, llama_batch_ext_free, ... -> llama_batch_ext_{add, free, ...}:
    names sharing their first three (else two) words, when at least `min_group` do."""
    out, rest = [], sorted(names)
    for words in (3, 2):
        groups: dict[str, list[str]] = {}
        for n in rest:
            parts = n.split("_")
            key = "_".join(parts[:words]) + "_" if len(parts) > words else None
            groups.setdefault(key or n, []).append(n)
        rest = []
        for key, members in groups.items():
            if key.endswith("_") and len(members) >= min_group:
                out.append(key + "{" + ", ".join(m[len(key):] for m in members) + "}")
            else:
                rest.extend(members)
    return sorted(out + rest, key=lambda x: x.replace("{", ""))


def _wrap(head: str, names: list[str], indent: str = "    ") -> list[str]:
    text = f"{head} ({len(names)}): " + ", ".join(group_names(names))
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)


def _count(area: dict) -> dict[str, int]:
    f = area["functions"]
    moved = sum(len(r["fields_moved"]) for r in area["records"]["changed"])
    n = {"added": sum(len(area[k]["added"]) for k in area),
         "removed": sum(len(area[k]["removed"]) for k in area),
         "renamed": len(f["renamed"]),
         "changed": len(f["changed"]) + sum(len(area[k]["changed"]) for k in area if k != "functions")}
    n["moved"] = moved
    return n


def render_area(area: dict, full: bool) -> list[str]:
    lines: list[str] = []
    f = area["functions"]
    if f["added"]:
        lines += _wrap("+ functions", f["added"])
    if f["removed"]:
        lines += _wrap("- functions", f["removed"])
    if f["renamed"]:
        lines += _wrap("~ functions renamed", [f"{a} -> {b}" for a, b in f["renamed"]])
    for c in f["changed"]:
        lines += textwrap.wrap(f"~ {c['name']}: {c['how']}", WIDTH, initial_indent="    ",
                               subsequent_indent="        ")
    if f["same_abi_spelling"]:
        lines += _wrap("~ same ABI, respelled (int/int32_t, const)", f["same_abi_spelling"])
    if f["parameter_names_only"] and full:
        lines += _wrap("~ functions with renamed parameters only", f["parameter_names_only"])
    r = area["records"]
    if r["added"]:
        lines += _wrap("+ records", [x.split(" ", 1)[-1] for x in r["added"]])
    if r["removed"]:
        lines += _wrap("- records", [x.split(" ", 1)[-1] for x in r["removed"]])
    for c in r["changed"]:
        parts = []
        if "size" in c:
            parts.append(f"size {c['size'][0]} -> {c['size'][1]}")
        parts += [f"+{x['name']}" + (f" ({x['type']})" if full else "") for x in c["fields_added"]]
        parts += [f"-{x['name']}" for x in c["fields_removed"]]
        parts += [f"~{x['name']}" + (f" ({x['from']} -> {x['to']})" if full else " (retyped)")
                  for x in c["fields_changed"]]
        if full:
            parts += [f"{x['name']} @{x['from']}->{x['to']}" for x in c["fields_moved"]]
        elif c["fields_moved"] and len(parts) > ("size" in c):
            parts.append(f"{len(c['fields_moved'])} moved")
        if len(parts) > ("size" in c) or full:
            lines += textwrap.wrap(f"~ {c['name']}: " + ", ".join(parts), WIDTH,
                                   initial_indent="    ", subsequent_indent="        ")
    e = area["enums"]
    if e["added"]:
        lines += _wrap("+ enums", e["added"])
    if e["removed"]:
        lines += _wrap("- enums", e["removed"])
    enum_parts = []
    for c in e["changed"]:
        cut = len(c.get("prefix", ""))
        parts = [f"+{k[cut:]}={v}" for k, v in c["added"].items()] + [f"-{k[cut:]}" for k in c["removed"]] \
            + [f"{k[cut:]} {a}->{b}" for k, (a, b) in c["changed"].items()]
        enum_parts.append(f"{c['name']} " + " ".join(parts))
    if enum_parts:
        lines += textwrap.wrap("~ enums: " + "; ".join(enum_parts), WIDTH, initial_indent="    ",
                               subsequent_indent="        ")
    for kind in ("callbacks", "constants"):
        d = area[kind]
        if d["added"]:
            lines += _wrap(f"+ {kind}", d["added"])
        if d["removed"]:
            lines += _wrap(f"- {kind}", d["removed"])
        for c in d["changed"]:
            lines.append(f"    ~ {kind[:-1]} {c['name']}: {c['from']} -> {c['to']}")
    return lines


def render_text(rep: dict[str, Any], full: bool = False) -> str:
    """The report as text: what our code uses first, then the llama API, then one-liners."""
    head = f"Change report: {version_label(rep['from'])} -> {version_label(rep['to'])}"
    if rep["api"] is None:
        return head + "\n  no previous manifest to compare with"
    c = rep["checked"]
    lines = [head, *textwrap.wrap(
        f"clickpaca/ uses {c['functions']} functions, {c['enum values']} enum values, "
        f"{c['records']} records, {c['fields']} fields: "
        + (f"{len(rep['ours'])} affected, {sum(o['handled'] for o in rep['ours'])} of them handled"
           if rep["ours"] else "nothing affected"), WIDTH, subsequent_indent="  ")]
    # one entry per action: a feature's many names share one line of handling (each name
    # says its own status when theirs differ)
    groups: dict[tuple, list[dict]] = {}
    for o in sorted(rep["ours"], key=lambda o: o["handled"]):  # what needs doing first
        groups.setdefault((o["handled"], o["action"]), []).append(o)
    for (handled, action), entries in groups.items():
        statuses = {o["status"] for o in entries}
        if len(statuses) == 1:
            what = f"{', '.join(o['name'] for o in entries)}: {statuses.pop()}"
        else:
            what = ", ".join(f"{o['name']} ({o['status']})" for o in entries)
        lines += textwrap.wrap(f"{'=' if handled else '!'} {what} -> {action}",
                               WIDTH, initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False)
    lines += feature_table.render_pair(rep["features"], rep["from"], rep["to"])
    llama, internals = rep["api"]["llama"], rep["api"]["internals"]
    n = _count(llama)
    lines.append(f"llama API: {n['added']} added, {n['removed']} removed, {n['renamed']} renamed, "
                 f"{n['changed']} changed")
    lines += render_area(llama, full)
    moved = [(r["name"], len(r["fields_moved"])) for r in llama["records"]["changed"] if r["fields_moved"]]
    if moved and not full:
        lines += textwrap.wrap(
            f"offset-only moves: {sum(k for _, k in moved)} fields in {len(moved)} records "
            f"({', '.join(name.split(' ', 1)[-1] for name, _ in moved)}): the bindings follow "
            "them, --full lists them", WIDTH, initial_indent="  ", subsequent_indent="    ")
    m = _count(internals)
    if full:
        lines.append(f"ggml/gguf internals: {m['added']} added, {m['removed']} removed, "
                     f"{m['renamed']} renamed, {m['changed']} changed")
        lines += render_area(internals, full)
    else:
        lines.append(f"ggml/gguf internals: {m['added']} added, {m['removed']} removed, "
                     f"{m['renamed']} renamed, {m['changed']} changed, {m['moved']} fields moved "
                     f"(--full lists them)")
    return "\n".join(lines)
