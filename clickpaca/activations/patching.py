"""Write rows into graph nodes during a decode: activation patching through the eval callback.

The same live callback that reads nodes (capture.py) writes them. In the ask phase it says
yes to each node a patch names, so llama.cpp's scheduler computes the graph up to that node,
synchronises and hands it over; in the call that follows, `Writer.on_node` writes the patch
rows into the node's tensor at the batch rows of the patched sequence's positions (numpy on
host memory, ggml_backend_tensor_get / _set where the buffer is a device's), replacing
them or adding to them, before any later node runs. The later nodes then read the written
values from the tensor's memory, as they would have read the computed ones.

A decode with nothing armed asks for no node: a server whose requests do not patch runs its
graph in one piece (engine/readout.py sets the callback only for decodes that read or write).

Rows map to the batch as capture.py maps them: the k-th evaluation of a node is micro-batch
k (capture.micro_batches predicts the split), and the last layer's nodes after llama.cpp's
`inp_out_ids` selection hold only the rows with logits. A row that cannot be found, a node
evaluated more times than predicted, or a row never written fails that key alone (`errors`
after the decode); the keys' rows are disjoint, so one key's failure writes nothing of
another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

MODES = ("replace", "add")


@dataclass(frozen=True)
class Write:
    """One patch of one key in one decode: `values[i]` goes to batch row `rows[i]` of node
    `node` (float32 [len(rows), elements of the node's row])."""

    node: str
    rows: np.ndarray
    values: np.ndarray
    mode: str = "replace"


class Writer:
    """The writing half of the eval callback (capture.Capture calls it: `wants` in the ask
    phase, `on_node` after the node is computed). Unarmed, it wants no node."""

    def __init__(self, nat: Any) -> None:
        self.nat = nat
        lib = nat.lib
        self._float = {int(lib.GGML_TYPE_F32): np.float32, int(lib.GGML_TYPE_F16): np.float16}
        self.disarm()

    def arm(self, writes: dict[Hashable, list[Write]], ubatches: list[np.ndarray], has_logits: np.ndarray) -> None:
        """The next decode's writes, key -> its Writes; `ubatches` the batch rows of each
        micro-batch (capture.micro_batches), `has_logits` the batch's logits flags."""
        self._writes = {k: list(ws) for k, ws in writes.items() if ws}
        self.names = frozenset(w.node.encode() for ws in self._writes.values() for w in ws)
        self._ubatches = [np.asarray(u, dtype=np.int64) for u in ubatches]
        self._has_logits = np.asarray(has_logits, bool)
        self._count: dict[str, int] = {}
        self._done: dict[Hashable, int] = {k: 0 for k in self._writes}
        self.errors: dict[Hashable, str] = {}

    def disarm(self) -> None:
        self._writes: dict[Hashable, list[Write]] = {}
        self.names: frozenset[bytes] = frozenset()
        self._ubatches: list[np.ndarray] = []
        self._has_logits = np.zeros(0, bool)
        self._count, self._done = {}, {}
        self.errors = {}

    @property
    def armed(self) -> bool:
        return bool(self._writes)

    def settle(self) -> dict[Hashable, str]:
        """After the decode: key -> why its patch was not applied in full (every row of
        every Write written exactly once), for the keys that failed."""
        for k, ws in self._writes.items():
            want = sum(len(w.rows) for w in ws)
            if k not in self.errors and self._done.get(k, 0) != want:
                absent = sorted({w.node for w in ws if w.node not in self._count})
                self.errors[k] = (f"patch: nodes {absent} were not evaluated in this decode" if absent else
                                  f"patch: {self._done.get(k, 0)} of its {want} rows were written: llama.cpp "
                                  "split the batch otherwise than predicted; not guessed")
        return dict(self.errors)

    def fail(self, name: str, why: str) -> None:
        """Every key that writes node `name` fails with `why`."""
        for key, ws in self._writes.items():
            if any(w.node == name for w in ws):
                self.errors.setdefault(key, why)

    # ---------------------------------------------------------------- the callback's half

    def on_node(self, t: Any, name: str) -> None:
        """Write the armed rows of node `t` (named `name`) for this evaluation."""
        k = self._count.get(name, 0)
        self._count[name] = k + 1
        mine = [(key, w) for key, ws in self._writes.items() if key not in self.errors
                for w in ws if w.node == name]
        if not mine:
            return
        if k >= len(self._ubatches):
            for key, _ in mine:
                self.errors[key] = (f"patch: node {name!r} was evaluated {k + 1} times in one decode, more than "
                                    f"the {len(self._ubatches)} micro-batches expected; not guessed")
            return
        rows = self._ubatches[k]
        out_rows = rows[self._has_logits[rows]]
        ne = [int(t.ne[i]) for i in range(4)]
        nb = [int(t.nb[i]) for i in range(4)]
        tok = max((d for d in range(1, 4) if ne[d] != 1), default=1)
        if ne[tok] == len(rows):
            dim_rows = rows
        elif ne[tok] == len(out_rows):
            dim_rows = out_rows
        else:
            for key, _ in mine:
                self.errors[key] = f"patch: node {name!r} (shape {ne}) has no dimension of the batch's tokens"
            return
        dtype = self._float.get(int(t.type))
        at = {int(r): i for i, r in enumerate(dim_rows)}
        in_ub = set(rows.tolist())
        for key, w in mine:
            sel = [i for i, r in enumerate(w.rows) if int(r) in in_ub]
            if not sel:
                continue
            lost = [int(w.rows[i]) for i in sel if int(w.rows[i]) not in at]
            if lost:
                self.errors[key] = (f"patch: node {name!r} holds only the rows with logits; batch rows "
                                    f"{lost} have none")
                continue
            if dtype is None or t.data == self.nat.ffi.NULL:
                self.errors[key] = f"patch: node {name!r} is not a float tensor"
                continue
            elems = int(np.prod(ne[:tok]))
            if w.values.shape[1] != elems:
                self.errors[key] = f"patch: node {name!r} has {elems} numbers a row, the patch {w.values.shape[1]}"
                continue
            try:
                self._write(t, ne, nb, tok, dtype, [at[int(w.rows[i])] for i in sel], w.values[sel], w.mode)
            except Exception as e:  # noqa: BLE001 - never raise into C
                self.errors[key] = f"patch: writing node {name!r} failed: {e!r}"
                continue
            self._done[key] = self._done.get(key, 0) + len(sel)

    def _write(self, t: Any, ne: list[int], nb: list[int], tok: int, dtype: Any, index: list[int],
               values: np.ndarray, mode: str) -> None:
        ffi, lib = self.nat.ffi, self.nat.lib
        itemsize = np.dtype(dtype).itemsize
        shape = ne[tok - 1::-1]  # one row, outermost first
        if t.buffer == ffi.NULL or bool(lib.ggml_backend_buffer_is_host(t.buffer)):
            span = sum((n - 1) * b for n, b in zip(ne, nb)) + itemsize
            raw = np.frombuffer(ffi.buffer(ffi.cast("char *", t.data), span), dtype=dtype)
            view = np.lib.stride_tricks.as_strided(raw, shape=ne[tok::-1], strides=nb[tok::-1])
            for i, v in zip(index, values):
                v = v.reshape(shape)
                view[i] = v if mode == "replace" else view[i].astype(np.float32) + v
            return
        # device memory: one row at a time through the bus, contiguous rows only
        size = int(np.prod(shape)) * itemsize
        if nb[0] != itemsize or any(nb[d] != nb[d - 1] * ne[d - 1] for d in range(1, tok)):
            raise ValueError("a non-contiguous row in device memory")
        for i, v in zip(index, values):
            row = v.astype(np.float32)
            if mode == "add":
                buf = ffi.new("char[]", size)
                lib.ggml_backend_tensor_get(t, buf, i * nb[tok], size)
                row = np.frombuffer(ffi.buffer(buf, size), dtype=dtype).astype(np.float32) + row
            data = np.ascontiguousarray(row.astype(dtype))
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(data), i * nb[tok], size)
