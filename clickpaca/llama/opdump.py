"""Every graph node's output for one token, and where two runs of it part.

llama.cpp's eval callback (`cb_eval` in llama_context_params) sees each node of the
compute graph after it is computed. `OpRecorder` copies the float outputs of every node
of every graph evaluation (one per micro-batch); `compare` pairs the nodes of two
evaluations, takes the slice that belongs to one token in each (the dimension that holds
the micro-batch's tokens), and reports which nodes differ, and which of them are
*sources*: nodes that differ although every input recorded in the same graph is
identical. A source is a kernel whose result for a token depends on something other than
that token's data (the batch shape, the cell a value sits in, a kernel path).

This is a measuring instrument (docs/DETERMINISM.md was written with it), not part of
serving: the callback makes the scheduler compute node by node, which also turns off
ggml's op fusion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .native import Native


@dataclass
class Node:
    name: str
    op: str
    ne: tuple[int, int, int, int]
    data: np.ndarray | None  # [ne3, ne2, ne1, ne0] float32, None for non-float outputs
    srcs: list[int]  # indices (in the same evaluation) of the inputs computed in it


@dataclass
class Evaluation:
    """One graph evaluation (one micro-batch): its nodes in the order computed."""

    nodes: list[Node] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # tensor address -> node index


class OpRecorder:
    """Records the nodes of every graph evaluation while `armed`; pass `callback` to
    core.Context(eval_callback=...)."""

    def __init__(self, nat: Native, keep: tuple[str, ...] = ()) -> None:
        self.nat = nat
        self.keep = keep  # name prefixes to copy (empty: all)
        self.evals: list[Evaluation] = []
        self.armed = False
        self._first: str | None = None
        lib = nat.lib
        self._float = {int(lib.GGML_TYPE_F32): np.float32, int(lib.GGML_TYPE_F16): np.float16}
        self.callback = nat.ffi.callback("ggml_backend_sched_eval_callback", self._cb)

    def clear(self) -> None:
        self.evals = []

    def _cb(self, t: Any, ask: bool, user_data: Any) -> bool:
        if ask:
            return self.armed
        try:
            self._record(t)
        except Exception as e:  # noqa: BLE001 - never raise into C
            print(f"opdump: {e!r}")
        return True

    def _record(self, t: Any) -> None:
        ffi, lib = self.nat.ffi, self.nat.lib
        name = ffi.string(t.name).decode("utf-8", "replace")
        if self._first is None:
            self._first = name
        if name == self._first or not self.evals:
            self.evals.append(Evaluation())
        ev = self.evals[-1]
        ne = tuple(int(t.ne[i]) for i in range(4))
        data = None
        dtype = self._float.get(int(t.type))
        if dtype is not None and t.data != ffi.NULL and (not self.keep or name.startswith(self.keep)):
            nb = [int(t.nb[i]) for i in range(4)]
            span = sum((n - 1) * b for n, b in zip(ne, nb)) + np.dtype(dtype).itemsize
            raw = np.frombuffer(ffi.buffer(ffi.cast("char *", t.data), span), dtype=dtype)
            view = np.lib.stride_tricks.as_strided(raw, shape=ne[::-1], strides=nb[::-1])
            data = view.astype(np.float32, copy=True)
        srcs = []
        for i in range(len(t.src)):
            s = t.src[i]
            if s == ffi.NULL:
                continue
            j = ev.index.get(int(ffi.cast("uintptr_t", s)))
            if j is not None:
                srcs.append(j)
        op = ffi.string(lib.ggml_op_desc(t)).decode()
        ev.index[int(ffi.cast("uintptr_t", t))] = len(ev.nodes)
        ev.nodes.append(Node(name, op, ne, data, srcs))


def token_slice(node: Node, dim: int, row: int, limits: tuple[int, int, int, int]) -> np.ndarray:
    """The node's values for the token at `row` of dimension `dim` (ggml order), other
    dimensions cut to `limits` (the overlap with the node it is compared with)."""
    idx: list[Any] = [slice(0, limits[d]) for d in range(4)]
    idx[dim] = row
    return node.data[tuple(idx[::-1])]


@dataclass
class Diff:
    index: int
    name: str
    op: str
    status: str  # "same" | "differs" | "source" | "skipped"
    max_abs: float = 0.0


#: Nodes whose first dimension is the KV cells (FA off): compared at the sequence's own cells.
CELL_NODES = ("kq-", "kq_soft_max-")


def compare(a: Evaluation, n_a: int, row_a: int, b: Evaluation, n_b: int, row_b: int,
            cells_a: list[int] | None = None, cells_b: list[int] | None = None) -> list[Diff]:
    """Node by node: the token at row_a of a micro-batch of n_a tokens against the token
    at row_b of one of n_b. The graphs must have the same nodes in the same order.
    `cells_a`/`cells_b`: the token's sequence's KV cells in position order in each run;
    attention scores are then compared cell for cell of the sequence (other cells hold
    other sequences' scores, masked later)."""
    out: list[Diff] = []
    differs: set[int] = set()
    for i, (x, y) in enumerate(zip(a.nodes, b.nodes)):
        if x.name != y.name:
            raise ValueError(f"node {i}: {x.name!r} against {y.name!r}: not the same graph")
        dim = _token_dim(x.ne, n_a, y.ne, n_b)
        if x.data is None or y.data is None or dim is None or x.name.startswith("cache_"):
            # (views of a whole KV cache buffer hold every sequence's cells: not one token's)
            out.append(Diff(i, x.name, x.op, "skipped"))
            continue
        limits = tuple(min(p, q) for p, q in zip(x.ne, y.ne))
        if cells_a is not None and x.name.startswith(CELL_NODES):
            u = np.take(token_slice(x, dim, row_a, (x.ne[0], *limits[1:])), cells_a, axis=-1)
            v = np.take(token_slice(y, dim, row_b, (y.ne[0], *limits[1:])), cells_b, axis=-1)
        else:
            u, v = token_slice(x, dim, row_a, limits), token_slice(y, dim, row_b, limits)
        same = np.array_equal(u, v, equal_nan=True)
        if same:
            out.append(Diff(i, x.name, x.op, "same"))
            continue
        differs.add(i)
        with np.errstate(invalid="ignore"):
            d = np.abs(u - v)
        mx = float(np.nanmax(d)) if np.isfinite(d).any() else float("inf")
        source = not any(s in differs for s in x.srcs)
        out.append(Diff(i, x.name, x.op, "source" if source else "differs", mx))
    return out


def _token_dim(ne_a, n_a: int, ne_b, n_b: int) -> int | None:
    """The dimension that holds the micro-batch's tokens: sized n_a in one and n_b in the
    other; else one sized n_a in both (per-sequence streams: a stream's own tokens)."""
    for want_b in (n_b, n_a):
        for d in (1, 2, 3, 0):
            if ne_a[d] == n_a and ne_b[d] == want_b:
                return d
    return None


def summary(diffs: list[Diff], limit: int = 12) -> str:
    """The sources (in graph order, first `limit`), then counts."""
    lines = []
    src = [d for d in diffs if d.status == "source"]
    for d in src[:limit]:
        lines.append(f"  source  #{d.index:4d} {d.name:24s} {d.op:14s} max|d| {d.max_abs:.3g}")
    n = {s: sum(1 for d in diffs if d.status == s) for s in ("same", "differs", "source", "skipped")}
    ops = sorted({f"{d.op} ({d.name.rsplit('-', 1)[0] if d.name[-1:].isdigit() else d.name})" for d in src})
    lines.append(f"  nodes: {n['same']} same, {n['source']} sources, {n['differs']} differ downstream, "
                 f"{n['skipped']} skipped; source ops: {', '.join(ops) or 'none'}")
    return "\n".join(lines)
