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
`render_text` prints it.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from typing import Any

from .usage import Usage, scan

WIDTH = 100


# ---------------------------------------------------------------- classification


def is_llama(kind: str, name: str, body: Any = None) -> bool:
    """Whether an entry belongs to the llama API (else ggml/gguf internals)."""
    bare = name.split(" ", 1)[-1] if kind == "records" else name
    if kind == "enums" and name.startswith("<anonymous enum "):
        bare = name[len("<anonymous enum "):]
    return bare.lower().startswith("llama_")


def version_label(stamp: dict | None) -> str:
    if not stamp:
        return "(no previous manifest)"
    build = stamp.get("build_number")
    return (f"b{build}" if build else "build ?") + f" ({stamp.get('flavor')} {stamp.get('commit')}" \
        + (f", sdist {stamp['sdist']})" if stamp.get("sdist") else ")")


def short_label(stamp: dict, other: dict) -> str:
    """b6170, or the flavor when both sides share a build number (mainline / turboquant)."""
    a, b = stamp.get("build_number"), other.get("build_number")
    if a and a != b:
        return f"b{a}"
    return stamp.get("flavor") or str(stamp.get("commit"))


def ordered(a: dict, b: dict) -> tuple[dict, dict]:
    """(older, newer): by build number when both are known, else in the order given."""
    na, nb = a["stamp"].get("build_number") or 0, b["stamp"].get("build_number") or 0
    return (b, a) if na and nb and na > nb else (a, b)


# ---------------------------------------------------------------- comparing


def _similar(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _sig_params(sig: str) -> str:
    return sig[sig.find("("):] if "(" in sig else sig


def _after_first_param(sig: str) -> str:
    inner = _sig_params(sig)
    return inner.split(",", 1)[1] if "," in inner else ""


def _words(name: str) -> set[str]:
    return set(name.split("_"))


def _score(name: str, sig: str | None, cand: str, csig: str | None) -> tuple[float, str] | None:
    """How likely `cand` does what `name` did, or None below the bar. Name similarity
    (characters and words) counts; a matching signature lowers the bar."""
    score = _similar(name, cand) + len(_words(name) & _words(cand)) / len(_words(name) | _words(cand)) / 2
    if sig and csig == sig:
        return (score, "same signature") if score >= 0.9 else None
    if sig and csig and _after_first_param(sig) and _after_first_param(csig) == _after_first_param(sig):
        return (score, "same parameters after the first") if score >= 0.9 else None
    return (score, "similar name") if score >= 1.3 else None


def _hinted(text: str) -> set[str]:
    return set(re.findall(r"\b(?:llama|ggml|gguf)_\w+", text))


def suggest(names: list[str], sigs: dict[str, str], there: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """For functions our code uses that the manifest `there` lacks: the function of `there`
    to use instead, and why. The header's own deprecation hints first ("use X instead", from
    either version), then the closest name (each candidate given to one name only)."""
    fns, tsig = there.get("functions", {}), there.get("signatures", {})
    out: dict[str, tuple[str, str]] = {}
    hints = [(k, v) for k, v in there.get("deprecated", {}).items()]
    hints += [(k[5:], v) for k, v in sigs.items() if k.startswith("hint:")]
    for name in names:
        for other, hint in hints:
            if name in _hinted(hint) and other in fns:
                out[name] = (other, f"deprecated for {name}")
        for replacement in _hinted(sigs.get(f"hint:{name}", "")):
            if replacement in fns:
                out[name] = (replacement, "the replacement the header names")
    scored = []
    for name in names:
        if name in out:
            continue
        for cand in fns:
            got = _score(name, sigs.get(name), cand, tsig.get(cand))
            if got:
                scored.append((got[0], name, cand, got[1]))
    taken = {c for c, _ in out.values()}
    for _, name, cand, why in sorted(scored, reverse=True):
        if name not in out and cand not in taken:
            out[name] = (cand, why)
            taken.add(cand)
    return out


def _renames(removed: list[str], added: list[str], old_sig: dict, new_sig: dict) -> list[list[str]]:
    """Pairs (old, new) of a removed and an added function that are most likely one renamed:
    the same signature and a similar name, or a very similar name."""
    pairs = []
    for r in removed:
        for a in added:
            same = old_sig.get(r) is not None and old_sig.get(r) == new_sig.get(a)
            score = _similar(r, a)
            if (same and score >= 0.6) or score >= 0.85:
                pairs.append((score + (0.3 if same else 0), r, a))
    out, used = [], set()
    for _, r, a in sorted(pairs, reverse=True):
        if r not in used and a not in used:
            out.append([r, a])
            used.update((r, a))
    return sorted(out)


# Spellings of one ABI type on the platforms we build for (LP64): a change between them
# (or of a `const`) changes no call.
ABI_SAME = {"int": "int32_t", "unsigned int": "uint32_t", "long": "int64_t", "unsigned long": "uint64_t",
            "_Bool": "bool"}


def split_params(sig: str) -> list[str]:
    """Top-level parameters of `ret name(params)` (function-pointer parameters kept whole)."""
    inner = sig[sig.find("(") + 1:sig.rfind(")")] if "(" in sig else ""
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += (ch == "(") - (ch == ")")
        cur += ch
    if cur.strip() and cur.strip() != "void":
        out.append(cur.strip())
    return out


def abi_form(sig: str) -> str:
    """A signature with the spellings that do not change the ABI made equal."""
    words = sig.replace("*", " * ").replace("(", " ( ").replace(")", " ) ").replace(",", " , ").split()
    words = [w for w in words if w != "const"]
    text = " ".join(words)
    for a, b in ABI_SAME.items():
        text = (" " + text + " ").replace(f" {a} ", f" {b} ").strip()
    return text


def param_diff(old_proto: str, new_proto: str) -> str:
    """A short account of how a prototype changed: return type, parameters added, removed
    or retyped (matched by name)."""
    def name_type(p: str) -> tuple[str, str]:
        words = p.replace("*", " * ").split()
        if "(" in p or len(words) < 2:
            return p, p
        return words[-1].split("[")[0], " ".join(words[:-1]).replace(" *", "*")
    ret_o = old_proto[:old_proto.find("(")].rsplit(None, 1)[0] if "(" in old_proto else ""
    ret_n = new_proto[:new_proto.find("(")].rsplit(None, 1)[0] if "(" in new_proto else ""
    po = dict(name_type(p) for p in split_params(old_proto))
    pn = dict(name_type(p) for p in split_params(new_proto))
    parts = []
    if ret_o.replace(" ", "") != ret_n.replace(" ", ""):
        parts.append(f"returns {ret_n.strip()} (was {ret_o.strip()})")
    parts += [f"+{n} ({t})" for n, t in pn.items() if n not in po]
    parts += [f"-{n}" for n in po if n not in pn]
    parts += [f"{n}: {po[n]} -> {pn[n]}" for n in po if n in pn and po[n] != pn[n]]
    if list(n for n in po if n in pn) != list(n for n in pn if n in po):
        parts.append("parameters reordered")
    return ", ".join(parts) or f"{old_proto} -> {new_proto}"


def signatures(old: dict, new: dict) -> tuple[dict, dict]:
    """Prototypes to compare: without parameter names when both manifests have them (a
    manifest from bindgen version 1 has only full prototypes)."""
    if "signatures" in old and "signatures" in new:
        return old["signatures"], new["signatures"]
    return old.get("functions", {}), new.get("functions", {})


def compare_functions(old: dict, new: dict) -> dict[str, list]:
    of, nf = old.get("functions", {}), new.get("functions", {})
    osig, nsig = signatures(old, new)
    added, removed = sorted(nf.keys() - of.keys()), sorted(of.keys() - nf.keys())
    renamed = _renames(removed, added, osig, nsig)
    gone = {r for r, _ in renamed} | {a for _, a in renamed}
    changed, params, spelling = [], [], []
    for k in sorted(of.keys() & nf.keys()):
        if of[k] == nf[k]:
            continue
        if k in osig and k in nsig and osig[k] == nsig[k]:
            params.append(k)  # only parameter names differ
        elif abi_form(osig.get(k, of[k])) == abi_form(nsig.get(k, nf[k])):
            spelling.append(k)  # int -> int32_t, const added or dropped: same ABI
        else:
            changed.append({"name": k, "from": of[k], "to": nf[k], "how": param_diff(of[k], nf[k])})
    return {"added": [a for a in added if a not in gone], "removed": [r for r in removed if r not in gone],
            "renamed": renamed, "changed": changed, "parameter_names_only": params,
            "same_abi_spelling": spelling}


def compare_record(name: str, a: dict, b: dict) -> dict[str, Any]:
    fa = {f["name"]: f for f in a["fields"]}
    fb = {f["name"]: f for f in b["fields"]}
    out: dict[str, Any] = {"name": name}
    if a["size"] != b["size"]:
        out["size"] = [a["size"], b["size"]]
    out["fields_added"] = [{"name": n, "type": fb[n]["type"], "offset": fb[n]["offset"]}
                           for n in sorted(fb.keys() - fa.keys())]
    out["fields_removed"] = [{"name": n, "type": fa[n]["type"]} for n in sorted(fa.keys() - fb.keys())]
    out["fields_changed"] = [{"name": n, "from": fa[n]["type"], "to": fb[n]["type"]}
                             for n in sorted(fa.keys() & fb.keys()) if fa[n]["type"] != fb[n]["type"]]
    out["fields_moved"] = [{"name": n, "from": fa[n]["offset"], "to": fb[n]["offset"]}
                           for n in sorted(fa.keys() & fb.keys())
                           if fa[n]["type"] == fb[n]["type"] and fa[n]["offset"] != fb[n]["offset"]]
    return out


def compare_dicts(kind: str, old: dict, new: dict) -> dict[str, list]:
    o, n = old.get(kind, {}), new.get(kind, {})
    out: dict[str, list] = {"added": sorted(n.keys() - o.keys()), "removed": sorted(o.keys() - n.keys()),
                            "changed": []}
    for k in sorted(o.keys() & n.keys()):
        if o[k] == n[k]:
            continue
        if kind == "records":
            out["changed"].append(compare_record(k, o[k], n[k]))
        elif kind == "enums":
            out["changed"].append({
                "name": k, "prefix": _common_prefix([*o[k], *n[k]]),
                "added": {v: n[k][v] for v in sorted(n[k].keys() - o[k].keys())},
                "removed": sorted(o[k].keys() - n[k].keys()),
                "changed": {v: [o[k][v], n[k][v]] for v in sorted(o[k].keys() & n[k].keys())
                            if o[k][v] != n[k][v]}})
        else:
            out["changed"].append({"name": k, "from": o[k], "to": n[k]})
    return out


def compare(old: dict, new: dict) -> dict[str, dict]:
    """Every difference, grouped by area (llama / internals) and kind."""
    areas: dict[str, dict] = {"llama": {}, "internals": {}}
    diffs = {"functions": compare_functions(old, new)}
    for kind in ("records", "enums", "callbacks", "constants"):
        diffs[kind] = compare_dicts(kind, old, new)
    for kind, d in diffs.items():
        for area in areas:
            want = area == "llama"
            part = {}
            for key, items in d.items():
                part[key] = [x for x in items if is_llama(kind, _entry_name(x)) == want]
            areas[area][kind] = part
    return areas


def _entry_name(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return x[1]
    return x["name"]


# ---------------------------------------------------------------- what our code uses


def _enum_index(m: dict) -> dict[str, tuple[str, int]]:
    return {v: (e, val) for e, vals in m.get("enums", {}).items() for v, val in vals.items()}


def _record_key(m: dict, name: str) -> str | None:
    recs = m.get("records", {})
    for k in (name, f"struct {name}", f"union {name}"):
        if k in recs:
            return k
    return None


def used_records(m: dict, usage: Usage, functions: set[str]) -> set[str]:
    """Records our code names, or reaches through the functions it calls, and the records
    nested in those."""
    found = {k for t in usage.types for k in [_record_key(m, t)] if k}
    words = set()
    for f in functions:
        words.update(m.get("signatures", {}).get(f, m.get("functions", {}).get(f, ""))
                     .replace("*", " ").replace("(", " ").replace(")", " ").replace(",", " ").split())
    found |= {k for w in words for k in [_record_key(m, w)] if k}
    todo = list(found)
    while todo:
        for f in m["records"][todo.pop()]["fields"]:
            k = _record_key(m, f["type"].replace("*", " ").split("[")[0].strip().replace("const ", ""))
            if k and k not in found:
                found.add(k)
                todo.append(k)
    return found


def places_text(places: list[str], limit: int = 4) -> str:
    """core.py:294, core.py:295, grammars.py:12 -> core.py:294,295 grammars.py:12"""
    files: dict[str, list[str]] = {}
    for p in places:
        where, _, line = p.rpartition(":")
        files.setdefault(where, []).append(line)
    text = " ".join(f"{w}:{','.join(lines[:limit])}{',...' if len(lines) > limit else ''}"
                    for w, lines in files.items())
    return text


def _common_prefix(names: list[str]) -> str:
    """The longest common prefix ending at an underscore (LLAMA_FLASH_ATTN_TYPE_)."""
    first, last = min(names), max(names)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:first.rfind("_", 0, n + 1) + 1] if n else ""


def ours(old: dict, new: dict, usage: Usage) -> tuple[list[dict], dict[str, int]]:
    """What our code uses that differs between the versions: one entry per name, with the
    places it is used and what to do. Also the counts of what was checked."""
    oe, ne = _enum_index(old), _enum_index(new)
    ol, nl = short_label(old["stamp"], new["stamp"]), short_label(new["stamp"], old["stamp"])
    of, nf = old.get("functions", {}), new.get("functions", {})
    osig, nsig = signatures(old, new)
    oc, nc = old.get("constants", {}), new.get("constants", {})
    out: list[dict] = []
    counts = {"functions": 0, "enum values": 0, "constants": 0, "records": 0, "fields": 0, "callbacks": 0}

    def add(kind: str, name: str, status: str, places: list[str], action: str,
            handled: bool = False, **extra) -> None:
        guarded = bool(places) and all(p in usage.guarded for p in places)
        if guarded and "absent" in status:
            action = f"handled at {places_text(places)} (under hasattr)"
        out.append({"kind": kind, "name": name, "status": status, "used_at": places,
                    "action": action, "handled": handled or (guarded and "absent" in status), **extra})

    def absent_action(name: str, places: list[str], label: str) -> str:
        near = (suggest_old if label == ol else suggest_new).get(name)
        where = places_text(places)
        if near:
            return f"{where}: fall back to {near[0]} ({near[1]}) or refuse by name"
        return f"{where}: refuse this capability on {label}, naming {name}"

    def lookup(m: dict) -> dict[str, str]:
        out = dict(m.get("signatures", {}))
        out.update({f"hint:{k}": v for k, v in m.get("deprecated", {}).items()})
        return out

    fn_used = [n for n in usage.symbols if n in of or n in nf]
    suggest_old = suggest([n for n in fn_used if n not in of], lookup(new), old)
    suggest_new = suggest([n for n in fn_used if n not in nf], lookup(old), new)

    functions_used = set()
    absent_values: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for name, places in sorted(usage.symbols.items()):
        in_o = name in of or name in oe or name in oc
        in_n = name in nf or name in ne or name in nc
        if name in of or name in nf or (not in_o and not in_n and name[0].islower()):
            kind = "function"
            counts["functions"] += in_o or in_n
            functions_used.add(name)
            if name in of and name in nf:
                if abi_form(osig[name]) != abi_form(nsig[name]):
                    add(kind, name, "signature changed: " + param_diff(of[name], nf[name]), places,
                        f"update the calls at {places_text(places)}", **{"from": of[name], "to": nf[name]})
            elif name in nf:
                add(kind, name, f"absent in {ol}", places, absent_action(name, places, ol))
            elif name in of:
                add(kind, name, f"removed in {nl}", places, absent_action(name, places, nl))
            continue  # in neither version: not a change between them
        if name in oe or name in ne:
            counts["enum values"] += 1
            if name in oe and name in ne:
                if oe[name][1] != ne[name][1]:
                    add("enum value", name, f"{oe[name][1]} -> {ne[name][1]}", places,
                        "read from the bindings at run time, nothing to do", handled=True)
            else:
                enum, label = (ne[name][0], ol) if name in ne else (oe[name][0], nl)
                grouped = absent_values.setdefault((enum, label), ([], []))
                grouped[0].append(name)
                grouped[1].extend(places)
            continue
        if not in_o and not in_n:
            continue
        counts["constants"] += 1
        if name in oc and name in nc:
            if oc[name] != nc[name]:
                add("constant", name, f"value {oc[name]} -> {nc[name]}", places, "check the uses")
        else:
            label = ol if name in nc else nl
            add("constant", name, f"absent in {label}", places, f"{places_text(places)} must not rely on it")

    for (enum, label), (values, places) in sorted(absent_values.items()):
        whole = enum not in (old if label == ol else new).get("enums", {})
        places = sorted(set(places), key=lambda p: (p.rpartition(":")[0], int(p.rpartition(":")[2])))
        prefix = _common_prefix(values) if len(values) > 1 else ""
        add("enum value", f"{'enum ' if whole else ''}{enum} ({', '.join(v[len(prefix):] for v in values)})",
            f"absent in {label}", places,
            f"{places_text(places)}: do not offer {'them' if len(values) > 1 else 'it'} there")

    for name, places in sorted(usage.types.items()):
        if name in old.get("callbacks", {}) or name in new.get("callbacks", {}):
            counts["callbacks"] += 1
            a, b = old.get("callbacks", {}).get(name), new.get("callbacks", {}).get(name)
            if a != b:
                add("callback", name, "changed" if a and b else f"absent in {ol if b else nl}", places,
                    "the callback's Python signature must match", **{"from": a, "to": b})

    ro, rn = used_records(old, usage, functions_used), used_records(new, usage, functions_used)
    for rec in sorted(ro | rn):
        counts["records"] += 1
        a, b = old["records"].get(rec), new["records"].get(rec)
        fa = {f["name"]: f for f in (a or {}).get("fields", [])}
        fb = {f["name"]: f for f in (b or {}).get("fields", [])}
        for field in sorted((fa.keys() | fb.keys()) & usage.attrs.keys()):
            counts["fields"] += 1
            places = usage.attrs[field]
            full = f"{rec.split(' ', 1)[-1]}.{field}"
            if field in fa and field in fb:
                if fa[field]["type"] != fb[field]["type"]:
                    add("field", full, f"type {fa[field]['type']} -> {fb[field]['type']}", places,
                        f"check the values written at {places_text(places)}")
            elif b is not None and a is not None:
                label, there = (ol, fa) if field in fb else (nl, fb)
                near = max(there, key=lambda k: _similar(field, k), default=None)
                hint = (f" (it has {near})"
                        if near and _similar(field, near) >= 0.75 else "")
                add("field", full, f"absent in {label}{hint}", places,
                    f"{places_text(places)}: skip it there or refuse the option by name")
    return out, counts


# ---------------------------------------------------------------- the report


def build_report(old: dict | None, new: dict, usage: Usage | None = None) -> dict[str, Any]:
    """The report as plain data (what --json prints)."""
    if old is None:
        return {"from": None, "to": new["stamp"], "ours": [], "checked": {}, "api": None}
    old, new = ordered(old, new)
    usage = usage or scan()
    mine, counts = ours(old, new, usage)
    return {"from": old["stamp"], "to": new["stamp"], "ours": mine, "checked": counts,
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
    lines = [head, f"clickpaca/ uses {c['functions']} functions, {c['enum values']} enum values, "
             f"{c['records']} records, {c['fields']} fields: "
             + (f"{len(rep['ours'])} affected, {sum(o['handled'] for o in rep['ours'])} of them handled"
                if rep["ours"] else "nothing affected")]
    for o in sorted(rep["ours"], key=lambda o: o["handled"]):  # what needs doing first
        lines += textwrap.wrap(f"{'=' if o['handled'] else '!'} {o['name']}: {o['status']} -> {o['action']}",
                               WIDTH, initial_indent="  ", subsequent_indent="      ")
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
