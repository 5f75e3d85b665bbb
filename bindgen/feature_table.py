"""The feature table of the upgrade report: clickpaca/llama/features.py evaluated on manifests.

Per version, each feature works, falls back (nothing refused, something done instead) or
is refused (the request option, or init itself), with the names it lacks. From the
manifests alone, so `python -m bindgen.versions --features` needs no build.
"""

from __future__ import annotations

import textwrap

from clickpaca.llama import features

from .apidiff import version_label

WIDTH = 100


def rows(manifest: dict) -> list[dict]:
    return features.table(features.for_manifest(manifest))


def _short(row: dict) -> str:
    if row["status"] == "works":
        return "works"
    lacks = ", ".join(row["missing"][:2]) + (", ..." if len(row["missing"]) > 2 else "")
    if row["status"] == "refused":
        return f"{row['refused']} refused (lacks {lacks})"
    return f"fallback, {row['instead']} (lacks {lacks})"


def render_pair(table: dict, old: dict, new: dict) -> list[str]:
    """The report's block (table: {"from": rows, "to": rows}, old and new: the stamps): one
    line per version on which a feature does not work."""
    # a patched flavor's feature (Feature.build) that neither side has is no upgrade's change
    pairs = [(x, y) for x, y in zip(table["from"], table["to"])
             if not (features.BY_NAME[x["feature"]].build and x["status"] == y["status"] != "works")]
    both = sum(x["status"] == y["status"] == "works" for x, y in pairs)
    lines = [f"features (clickpaca/llama/features.py): {both} of {len(pairs)} work on both"]
    for x, y in pairs:
        if x["status"] == y["status"] == "works":
            continue
        for label, r in ((version_label(old).split(" ")[0], x), (version_label(new).split(" ")[0], y)):
            if r["status"] != "works":
                lines += textwrap.wrap(f"{r['feature']} on {label}: {_short(r)}", WIDTH,
                                       initial_indent="  ", subsequent_indent="      ",
                                       break_on_hyphens=False)
    return lines


def markdown(manifests: dict[str, dict]) -> str:
    """version -> manifest: one row per feature, one column per version (docs/UPGRADING.md)."""
    versions = list(manifests)
    table = {v: rows(m) for v, m in manifests.items()}
    head = ["feature", *[f"{v} (b{manifests[v]['stamp']['build_number']})" for v in versions]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict[str, int] = {}
    for i, f in enumerate(features.FEATURES):
        cells = [f"`{f.name}`: {f.what}"]
        for v in versions:
            r = table[v][i]
            if r["status"] == "works":
                cells.append("works")
                continue
            why = (f"lacks {', '.join(r['missing'])}; "
                   + (f"{r['refused']} refused" if r["status"] == "refused" else r["instead"]))
            n = notes.setdefault(why, len(notes) + 1)
            cells.append(f"{'**refused**' if r['status'] == 'refused' else 'fallback'} ({n})")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out += [f"({n}) {why}" + "  " for why, n in notes.items()]
    return "\n".join(out)
