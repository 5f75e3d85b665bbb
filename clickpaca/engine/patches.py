"""Activation patching through the jobs: which rows of a tick's batch each job writes.

`for_request` turns a request's `patch` (activations/patch_wire.py) into a `JobPatch`: the
build checked (features.py `patch`: the live eval callback; refused elsewhere naming the
build that has it), each node checked against the model's graph (a node that cannot be
patched is refused with the ones that can), a file source read from the client's namespace
of the state directory, the rows' shape checked against the node, and the positions against
the tokens the request feeds. Before each decode engine/readout.py asks each job for its
`writes` of that feed; the callback writes them (activations/patching.py).

A patched sequence's cells hold what the patch made of them, so no other request's prompt
reuses them as a prefix (Sequence.altered).
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..activations import capture as C
from ..activations.patch_wire import PatchSpec, finite
from ..activations.patching import Write
from ..llama import features
from ..wire.protocol import ProtocolError
from . import statedir
from .plan import Feed, Want

_UNNAMED = re.compile(r"^node_\d+$")  # ggml's name for a node llama.cpp left unnamed
#: the patch rows one request may hold (float32, all entries together)
MAX_PATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class Entry:
    node: str
    positions: np.ndarray  # int64, the sequence's positions
    values: np.ndarray  # float32 [len(positions), elements of a row]
    mode: str
    output_rows_only: bool  # the node holds only rows with logits (the last layer's after inp_out_ids)


@dataclass(eq=False)
class JobPatch:
    """One request's patch: what it writes into each feed of its sequence."""

    entries: tuple[Entry, ...]

    def writes(self, f: Feed) -> list[Write]:
        """The Writes of this feed: each entry's positions among those fed, at their batch rows."""
        out = []
        for e in self.entries:
            sel = np.flatnonzero((e.positions >= f.pos) & (e.positions < f.pos + f.count))
            if len(sel):
                out.append(Write(e.node, f.at + e.positions[sel] - f.pos, e.values[sel], e.mode))
        return out

    def widen(self, w: Want) -> Want:
        """The Want with logits rows at the positions it writes into a node that holds only
        rows with logits (so those rows exist when the node is computed)."""
        pos = [int(p) for e in self.entries if e.output_rows_only for p in e.positions
               if w.n_past <= p < w.n_tokens]
        if not pos:
            return w
        lo, hi = min(pos), max(pos)
        if w.out_from <= w.out_to:
            lo, hi = min(lo, w.out_from), max(hi, w.out_to)
        w.out_from, w.out_to = lo, hi
        return w


def refusal(build: str, missing: list[str]) -> str:
    """Why `patch` is refused on a build without the live eval callback (features.py
    `eval-callback-live`, whose only other use, capture, falls back instead of refusing)."""
    f = features.BY_NAME["eval-callback-live"]
    return (f"patch: build {build!r} lacks {', '.join(missing)} (a patch is written through the eval "
            f"callback set for the decodes that patch), so patch is refused there; build {f.build!r} "
            f"has it (make {f.build})")


def patchable(g: C.Graph) -> list[str]:
    """The nodes a patch may name: the named nodes capture reads (one node per name, a
    dimension of the tokens outermost), without views and unnamed nodes."""
    return [n for n in g.names if " (" not in n and not _UNNAMED.match(n)]


def for_request(rt: Any, req: Any, namespace: str | None, first: int, end: int) -> JobPatch | None:
    """The request's JobPatch (None without `patch`); `first`..`end - 1` are the positions
    it feeds that a patch may name. ProtocolError naming the field."""
    if req.patch is None:
        return None
    seq_id, kind = req.seq_id, req.type
    nat = rt.model.nat
    missing = features.lacking("eval-callback-live", features.for_native(nat))
    if missing:
        raise ProtocolError(refusal(nat.name, missing), seq_id, kind)
    fa = {True: "on", False: "off"}.get(rt.ctx.flash_attn, "auto")
    g = C.graph(rt.model, fa)
    can = patchable(g)
    have = set(can)
    entries, total = [], 0
    for i, spec in enumerate(req.patch):
        name = f"patch: [{i}]"
        if spec.node not in have:
            why = (f"is not patched: {g.excluded[spec.node]}" if spec.node in g.excluded
                   else "is a view or an unnamed node" if spec.node in g.names else "is not in this model's graph")
            raise ProtocolError(f"{name}.node: {spec.node!r} {why}; nodes that can be patched: "
                                f"{C.describe(can)}", seq_id, kind)
        bad = [p for p in spec.positions if not first <= p < end]
        if bad:
            raise ProtocolError(f"{name}.positions: {bad[:5]} outside the positions this request feeds "
                                f"({first}..{end - 1})", seq_id, kind)
        values = _source(rt, spec, namespace, f"{name}.source", seq_id, kind)
        elems = g.row_elems.get(spec.node, rt.model.n_embd)
        if values.shape[0] != len(spec.positions) or int(np.prod(values.shape[1:])) != elems:
            raise ProtocolError(f"{name}.source: shape {list(values.shape)} does not match {len(spec.positions)} "
                                f"positions of {spec.node!r} ({elems} numbers a row): "
                                f"[{len(spec.positions)}, {elems}] expected", seq_id, kind)
        total += values.size * 4
        if total > MAX_PATCH_BYTES:
            raise ProtocolError(f"patch: its rows exceed the {MAX_PATCH_BYTES >> 20} MiB a request may hold",
                                seq_id, kind)
        entries.append(Entry(spec.node, np.asarray(spec.positions, np.int64),
                             np.ascontiguousarray(values.reshape(len(spec.positions), elems), np.float32),
                             spec.mode, spec.node in g.output_rows_only))
    return JobPatch(tuple(entries))


def _source(rt: Any, spec: PatchSpec, namespace: str | None, name: str, seq_id: int, kind: str) -> np.ndarray:
    """The entry's rows: inline, or the .npy file in the client's namespace."""
    if spec.file is None:
        return spec.values()
    states = rt.states
    where = states.root / namespace if namespace else states.root
    head, base = os.path.split(spec.file)
    if head and os.path.normpath(head) != os.path.normpath(str(where)):
        raise ProtocolError(f"{name}: {spec.file[:200]!r} is not in this client's namespace of the state "
                            f"directory ({where}); name a file a capture wrote there", seq_id, kind)
    try:
        dir_fd = states.namespace_dir(namespace)
        try:
            data = statedir.read_file(dir_fd, base, repr(base))
        finally:
            os.close(dir_fd)
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (statedir.StatePathError, OSError, ValueError) as e:
        raise ProtocolError(f"{name}: {e}", seq_id, kind) from None
    if arr.dtype.kind != "f":
        raise ProtocolError(f"{name}: the file holds {arr.dtype}, not floats", seq_id, kind)
    try:
        return finite(name, np.asarray(arr, np.float32))
    except ValueError as e:
        raise ProtocolError(str(e), seq_id, kind) from None
