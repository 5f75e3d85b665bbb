"""What differs between two manifests: functions, records, enums, callbacks, constants,
each split into the llama API and ggml/gguf internals (plain data for bindgen/report.py).

Functions are compared by signature without parameter names; a removed and an added
function with the same signature and a similar name are taken for a rename; spellings of
the same ABI type (int / int32_t, a dropped const) are told apart from real changes. Record
fields are added, removed, retyped or only moved (offsets the generated bindings follow).
"""

from __future__ import annotations

import difflib
from typing import Any


def is_llama(kind: str, name: str) -> bool:
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


def _similar(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _sig_params(sig: str) -> str:
    return sig[sig.find("("):] if "(" in sig else sig


def _after_first_param(sig: str) -> str:
    inner = _sig_params(sig)
    return inner.split(",", 1)[1] if "," in inner else ""


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


def _common_prefix(names: list[str]) -> str:
    """The longest common prefix ending at an underscore (LLAMA_FLASH_ATTN_TYPE_)."""
    first, last = min(names), max(names)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:first.rfind("_", 0, n + 1) + 1] if n else ""
