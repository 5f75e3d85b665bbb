"""What differs between two versions in what clickpaca's own code uses (bindgen/usage.py),
with where it is used and what to do: the head of the change report.

For a function one version lacks, the proposal is the other name the header's own
DEPRECATED(..., "use X instead") hints give, else the closest name with the same signature
(or the same parameters after the first); each candidate is proposed for one name only.
A use under a hasattr() check counts as handled.
"""

from __future__ import annotations

import re
from typing import Any

from .apidiff import (_after_first_param, _common_prefix, _similar, abi_form, param_diff,
                      short_label, signatures)
from .usage import Usage


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
            f"{places_text(places)}: do not offer {'them' if len(values) > 1 else 'it'} there",
            values=sorted(values))

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
    by_features(out, {ol: old, nl: new}, ol, nl, usage)
    return out, counts


def by_features(entries: list[dict], manifests: dict[str, dict], ol: str, nl: str, usage: Usage) -> None:
    """Mark as handled what the feature table (clickpaca/llama/features.py) covers on the version
    that differs, where our code checks that feature (usage.features): a name a feature
    needs, where the feature is refused or falls back (the code using the name never runs
    there), and a name only a feature's fallback uses, where the feature is available."""
    from clickpaca.llama import features

    def checked(f) -> bool:
        return f.name in usage.features or (f.refuses and "check_init" in usage.features)

    have = {label: features.for_manifest(m) for label, m in manifests.items()}
    for o in entries:
        if o["handled"]:
            continue
        side = nl if o["status"].endswith(f" in {nl}") or f" in {nl} " in o["status"] else ol
        names = o.get("values") or [o["name"]]
        rows = [features.row_of(n) for n in names]
        need, back = rows[0]
        if need is not None and all(r[0] is need for r in rows) and checked(need) \
                and features.lacking(need, have[side]):
            o["handled"], o["proposal"] = True, o["action"]  # (kept: a fallback to add instead)
            o["action"] = (f"features.py {need.name!r}: {need.refused} refused on {side}" if need.refuses
                           else f"features.py {need.name!r}: on {side}, {need.without}")
        elif back is not None and all(r[1] is back for r in rows) and checked(back) \
                and not features.lacking(back, have[side]):
            o["handled"] = True
            o["action"] = f"features.py {back.name!r}: used only where that feature is absent"
