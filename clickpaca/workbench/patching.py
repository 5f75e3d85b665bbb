"""Activation patching in a few lines (`Workbench.activations`, `Workbench.patch`): numpy
rows in and out, the protocol's `capture` and `patch` underneath (docs/ACTIVATIONS.md).

A patch entry is the protocol's `{node, positions, source, mode}` with `source` also taken
as a numpy array (sent inline, float32), so a captured row goes back in unchanged:

    with Workbench.spawn(build="activations", nSeqMax=16) as wb:
        clean = wb.activations("The Colosseum is located in the city of", ["l_out-8"])
        n = len(clean["l_out-8"])
        gens = wb.patch("The Eiffel Tower is located in the city of",
                        [{"node": "l_out-8", "positions": list(range(n)), "source": clean["l_out-8"]}],
                        maxTokens=4, temperature=0)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..activations.capture import decode, encode

Entry = dict[str, Any]


def wire_entry(e: Entry) -> Entry:
    """An entry for the wire: an array `source` as an inline float32 payload."""
    src = e.get("source")
    if isinstance(src, np.ndarray):
        rows = src.reshape(len(e.get("positions", ())) or 1, -1) if src.ndim == 1 else src
        return {**e, "source": encode(np.asarray(rows, np.float32), "float32")}
    return dict(e)


def per_item(patches: Sequence[Entry] | Sequence[Sequence[Entry]], n: int) -> list[list[Entry]]:
    """One list of wire entries per item: `patches` is one list for every item, or a list
    of lists, one per item."""
    patches = list(patches)
    if patches and all(isinstance(p, (list, tuple)) for p in patches):
        if len(patches) != n:
            raise ValueError(f"{len(patches)} patch lists for {n} items")
        return [[wire_entry(e) for e in p] for p in patches]
    one = [wire_entry(e) for e in patches]
    return [one] * n


def rows_of(event: dict) -> dict[str, np.ndarray]:
    """node -> float32 rows of an end event's `capture` (inline or its .npy file)."""
    out = {}
    for name, ref in event["capture"]["nodes"].items():
        out[name] = (np.load(ref["file"]) if "file" in ref else decode(ref)).astype(np.float32)
    return out
