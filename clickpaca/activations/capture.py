"""Copy the requested graph nodes' rows of the batch out of a decode.

llama.cpp's eval callback (`cb_eval`) is asked, node by node, whether the caller wants
that node's output (the ask phase); a yes makes the scheduler compute up to that node,
synchronise and hand it over. `Capture` answers no to every node it was not asked for, so
a decode with nothing requested computes its graph in one piece as without a callback
(the Python call per node is the remaining cost: docs/ACTIVATIONS.md measures it), and it
copies only the rows of the batch each caller named, so a job takes only its own
sequence's rows.

Rows map to the batch in batch order, which holds when the decode is one micro-batch
split in order (n_ubatch >= the batch, the way core.Batch fills sequences one after
another). A node evaluated twice in one decode (several micro-batches) or with a token
dimension that is neither the batch nor its output rows is an error, never a guess.
The last layer's nodes after llama.cpp's `inp_out_ids` selection hold only the output
rows (the tokens with logits on): those are mapped through the batch's logits flags.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any, Hashable

import numpy as np

from ..native import Native


class CaptureError(ValueError):
    """A capture request that cannot be met; `field` names the request field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class Capture:
    """Pass `callback` to core.Context(eval_callback=...); `arm` before a decode, `take`
    after it. Unarmed, every node is declined."""

    def __init__(self, nat: Native) -> None:
        self.nat = nat
        lib = nat.lib
        self._float = {int(lib.GGML_TYPE_F32): np.float32, int(lib.GGML_TYPE_F16): np.float16}
        self._names: frozenset[bytes] = frozenset()
        self._rows: dict[Hashable, np.ndarray] = {}
        self._n = 0
        self._out_rows: np.ndarray = np.zeros(0, np.int64)
        self._got: dict[str, dict[int, np.ndarray]] = {}
        self._error: str | None = None
        self._evaluated: set[str] = set()
        self.seen: list[str] | None = None  # when a list: every node name asked (graph_nodes)
        self.callback = nat.ffi.callback("ggml_backend_sched_eval_callback", self._cb)

    def arm(self, names, rows: dict[Hashable, Any], batch: Any) -> None:
        """Copy nodes `names` at the batch rows `rows[key]` of the next decode of `batch`
        (a core.Batch, filled)."""
        self._names = frozenset(n.encode() for n in names)
        self._rows = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
        self._n = int(batch.n)
        self._out_rows = np.flatnonzero(batch.logits[:batch.n])
        for k, r in self._rows.items():
            if r.size and (r.min() < 0 or r.max() >= self._n):
                raise CaptureError("captureTokens", f"rows {r.tolist()} of {k!r} outside the batch of {self._n}")
        self._got, self._error, self._evaluated = {}, None, set()

    def take(self) -> dict[Hashable, dict[str, np.ndarray]]:
        """key -> node name -> [len(rows[key]), *row shape] float32 (a copy); disarms."""
        got, error, rows, names = self._got, self._error, self._rows, self._names
        self._names, self._rows, self._got, self._error = frozenset(), {}, {}, None
        if error:
            raise CaptureError("capture", error)
        absent = sorted(n.decode() for n in names if n.decode() not in got)
        if absent:
            raise CaptureError("capture", f"nodes {absent} were not evaluated in this decode")
        return {k: {name: np.stack([data[int(i)] for i in r]) if len(r) else np.zeros((0,), np.float32)
                    for name, data in got.items()} for k, r in rows.items()}

    # ---------------------------------------------------------------- callback

    def _cb(self, t: Any, ask: bool, user_data: Any) -> bool:
        if ask:
            if self.seen is not None:
                self.seen.append(self.nat.ffi.string(t.name).decode())
                return False
            return bool(self._names) and self.nat.ffi.string(t.name) in self._names
        try:
            self._copy(t)
        except Exception as e:  # noqa: BLE001 - never raise into C
            self._error = f"copying a node failed: {e!r}"
        return True

    def _copy(self, t: Any) -> None:
        ffi = self.nat.ffi
        name = ffi.string(t.name).decode()
        if name in self._evaluated:  # takes precedence over what the first part said
            self._error = (f"node {name!r} was evaluated twice in one decode: the batch ran as "
                           f"several micro-batches; capture needs one (nUbatch >= the batch)")
            return
        self._evaluated.add(name)
        dtype = self._float.get(int(t.type))
        if dtype is None or t.data == ffi.NULL:
            self._error = f"node {name!r} is not a float tensor in host memory"
            return
        ne = [int(t.ne[i]) for i in range(4)]
        nb = [int(t.nb[i]) for i in range(4)]
        tok = max((d for d in range(1, 4) if ne[d] != 1), default=1)  # the outermost dimension
        if ne[tok] == self._n:
            dim_rows = None  # rows are batch rows
        elif ne[tok] == len(self._out_rows):
            dim_rows = self._out_rows  # rows are the output rows, in batch order
        else:
            self._error = (f"node {name!r} (shape {ne}) has no dimension of the batch's "
                           f"{self._n} tokens or {len(self._out_rows)} output rows outermost: "
                           f"not a per-token node")
            return
        span = sum((n - 1) * b for n, b in zip(ne, nb)) + np.dtype(dtype).itemsize
        raw = np.frombuffer(ffi.buffer(ffi.cast("char *", t.data), span), dtype=dtype)
        view = np.lib.stride_tricks.as_strided(raw, shape=ne[tok::-1], strides=nb[tok::-1])
        want = np.unique(np.concatenate([r for r in self._rows.values()] or [np.zeros(0, np.int64)]))
        if dim_rows is not None:
            missing = np.setdiff1d(want, dim_rows)
            if missing.size:
                self._error = (f"node {name!r} holds only the output rows; rows {missing.tolist()} "
                               f"have no logits requested")
                return
            idx = np.searchsorted(dim_rows, want)
        else:
            idx = want
        self._got[name] = dict(zip(want.tolist(), view[idx].astype(np.float32)))


# -------------------------------------------------------------------- node names


def graph_nodes(model: Any, flash_attn: str = "auto") -> list[str]:
    """The node names of the model's decode graph, in graph order (one token decoded on a
    throw-away context whose callback declines every node while listing it). Attention's
    inner nodes differ with flash attention, so pass the serving context's setting."""
    cache = model.__dict__.setdefault("_graph_nodes", {})
    if flash_attn in cache:
        return cache[flash_attn]
    from .. import core

    cap = Capture(model.nat)
    cap.seen = []
    ctx = core.Context(model, n_ctx=64, n_batch=8, n_seq_max=1, flash_attn=flash_attn,
                       eval_callback=cap.callback)
    try:
        batch = core.Batch(model.nat, 8)
        batch.add([model.bos], 0, 0)
        if ctx.decode(batch) != 0:
            raise RuntimeError("decoding one token to list the graph failed")
    finally:
        ctx.close()
    cache[flash_attn] = names = list(dict.fromkeys(cap.seen))
    return names


_LAYERED = re.compile(r"^(.*)-(\d+)$")
_INTERNAL = re.compile(r"^node_\d+$")


def describe(names: list[str]) -> str:
    """Names grouped by layer for an error: 'l_out-{0..17}, result_norm, ...'."""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    hidden = 0
    for n in names:
        if " (" in n or _INTERNAL.match(n):  # views and unnamed nodes: valid, not listed
            hidden += 1
            continue
        m = _LAYERED.match(n)
        if m:
            groups.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            plain.append(n)
    parts = [f"{base}-{{{min(ls)}..{max(ls)}}}" if len(ls) > 1 else f"{base}-{ls[0]}"
             for base, ls in groups.items()]
    return ", ".join(parts + plain) + (f" (and {hidden} unnamed nodes and views)" if hidden else "")


def validate(names, valid: list[str]) -> list[str]:
    """The requested names, checked against the graph's; CaptureError listing valid ones."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise CaptureError("capture", "must be a list of graph node names")
    have = set(valid)
    bad = [n for n in names if n not in have]
    if bad:
        raise CaptureError("capture", f"unknown node {', '.join(map(repr, bad))}; this model's "
                                      f"graph has: {describe(valid)}")
    return list(dict.fromkeys(names))


# -------------------------------------------------------------------- encoding

DTYPES = {"float16": np.float16, "float32": np.float32}


def encode(arr: np.ndarray, dtype: str = "float16") -> dict[str, Any]:
    """An array for the event stream: base64 of its little-endian bytes, with shape."""
    if dtype not in DTYPES:
        raise CaptureError("captureDtype", f"must be one of {sorted(DTYPES)}, got {dtype!r}")
    a = np.ascontiguousarray(arr, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"))
    return {"dtype": dtype, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def decode(payload: dict[str, Any]) -> np.ndarray:
    """The inverse of `encode`."""
    dt = np.dtype(DTYPES[payload["dtype"]]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(payload["data"]), dtype=dt).reshape(payload["shape"])


def write_npy(arr: np.ndarray, path: str | Path, dtype: str = "float16") -> dict[str, Any]:
    """A large capture as an .npy file; the reference that goes in the event instead."""
    if dtype not in DTYPES:
        raise CaptureError("captureDtype", f"must be one of {sorted(DTYPES)}, got {dtype!r}")
    a = np.asarray(arr, dtype=DTYPES[dtype])
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, a)
    p.write_bytes(buf.getvalue())
    return {"dtype": dtype, "shape": list(a.shape), "file": str(p)}


def payload(arr: np.ndarray, dtype: str, npy_path: str | Path | None = None,
            max_inline_bytes: int = 1 << 20) -> dict[str, Any]:
    """Inline base64 up to `max_inline_bytes`, else an .npy file at `npy_path`."""
    size = arr.size * np.dtype(DTYPES.get(dtype, np.float32)).itemsize
    if size > max_inline_bytes and npy_path is not None:
        return write_npy(arr, npy_path, dtype)
    return encode(arr, dtype)
