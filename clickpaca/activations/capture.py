"""Copy the requested graph nodes' rows of the batch out of a decode.

llama.cpp's eval callback (`cb_eval`) is asked, node by node, whether the caller wants
that node's output (the ask phase); a yes makes the scheduler compute up to that node,
synchronise and hand it over. `Capture` answers no to every node it was not asked for, so
a decode with nothing requested computes its graph in one piece as without a callback
(the Python call per node is the remaining cost: docs/ACTIVATIONS.md measures it), and it
copies only the rows of the batch each caller named, so a job takes only its own
sequence's rows.

Rows map to the batch through the micro-batches llama.cpp splits it into (`micro_batches`
predicts them: one, in batch order, unless told otherwise): the k-th evaluation of a node
is micro-batch k. A node evaluated more or fewer times than predicted, or with a token
dimension that is neither its micro-batch's tokens nor their output rows, is an error,
never a guess.
The last layer's nodes after llama.cpp's `inp_out_ids` selection hold only the output
rows (the tokens with logits on): those are mapped through the batch's logits flags.
"""

from __future__ import annotations

import base64
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable

import numpy as np

from ..llama.native import Native


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
        self._wanted: dict[Hashable, frozenset[str]] = {}  # key -> the node names it asked for
        self._n = 0
        self._has_logits: np.ndarray = np.zeros(0, bool)
        self._ubatches: list[np.ndarray] = []
        self._got: dict[str, dict[int, np.ndarray]] = {}
        self._errors: dict[str, str] = {}  # node name -> why it could not be copied
        self._count: dict[str, int] = {}  # node name -> its evaluations in this decode
        self.seen: list[str] | None = None  # when a list: every node name asked (graph_nodes)
        self.shapes: dict[str, list[int]] = {}  # with `seen`: each node's ne (graph_nodes)
        self.writer: Any = None  # patching.Writer: the nodes written before later ones read them
        self.callback = nat.ffi.callback("ggml_backend_sched_eval_callback", self._cb)

    def arm(self, names, rows: dict[Hashable, Any], batch: Any) -> None:
        """Copy nodes `names` at the batch rows `rows[key]` of the next decode of `batch`
        (a core.Batch, filled)."""
        self.arm_each({k: (names, r) for k, r in rows.items()}, batch)

    def arm_each(self, wants: dict[Hashable, tuple[Any, Any]], batch: Any,
                 ubatches: list[list[int]] | None = None) -> None:
        """Like `arm`, each key with its own node names: key -> (names, batch rows). A
        node is copied at the rows of the keys that asked for it only, so one key's
        request (a last-layer node at a row without logits) cannot fail another's.
        `ubatches`: how llama.cpp will split the batch (`micro_batches`); None: in one."""
        self._wanted = {k: frozenset(names) for k, (names, _) in wants.items()}
        self._names = frozenset(n.encode() for ns in self._wanted.values() for n in ns)
        self._rows = {k: np.asarray(r, dtype=np.int64) for k, (_, r) in wants.items()}
        self._n = int(batch.n)
        self._has_logits = batch.logits[:batch.n] != 0
        self._ubatches = [np.asarray(u, dtype=np.int64) for u in (ubatches or [range(self._n)])]
        for k, r in self._rows.items():
            if r.size and (r.min() < 0 or r.max() >= self._n):
                raise CaptureError("captureTokens", f"rows {r.tolist()} of {k!r} outside the batch of {self._n}")
        self._got, self._errors, self._count = {}, {}, {}

    def take(self) -> dict[Hashable, dict[str, np.ndarray]]:
        """key -> node name -> [len(rows[key]), *row shape] float32 (a copy); disarms.
        CaptureError when any node could not be copied."""
        out = self.take_each()
        for got in out.values():
            if isinstance(got, CaptureError):
                raise got
        return out

    def take_each(self) -> dict[Hashable, dict[str, np.ndarray] | CaptureError]:
        """As `take`, but each key gets its own rows or the CaptureError of the first of
        its nodes that failed; disarms."""
        self.settle()
        try:
            return {k: self.take_one(k) for k in self.keys}
        finally:
            self.disarm()

    @property
    def keys(self) -> list[Hashable]:
        """The keys armed for the last decode."""
        return list(self._rows)

    def settle(self) -> None:
        """After the decode: a node evaluated other than once per micro-batch fails the
        keys that asked for it (before `take_one`)."""
        n_ub = len(self._ubatches)
        for name, k in self._count.items():
            if k != n_ub and name not in self._errors:
                self._errors[name] = (f"node {name!r} was evaluated {k} times in one decode, in "
                                      f"{'one micro-batch' if n_ub == 1 else f'{n_ub} micro-batches'} "
                                      f"expected: llama.cpp split the batch otherwise; not guessed")

    def take_one(self, k: Hashable) -> dict[str, np.ndarray] | CaptureError:
        """One key's rows (node -> [rows, ...], copies) or the CaptureError of the first
        of its nodes that failed (after `settle`, before `disarm`)."""
        got, errors, r = self._got, self._errors, self._rows[k]
        names = sorted(self._wanted.get(k, ()))
        bad = next((n for n in names if n in errors), None)
        absent = [n for n in names if n not in self._count]
        if bad is not None:
            return CaptureError("capture", errors[bad])
        if absent:
            return CaptureError("capture", f"nodes {absent} were not evaluated in this decode")
        if any(int(i) not in got.get(n, {}) for n in names for i in r):
            return CaptureError("capture", f"rows {r.tolist()} were not all in the nodes "
                                           f"{names} as evaluated: not guessed")
        return {n: np.stack([got[n][int(i)] for i in r]) if len(r) else np.zeros((0,), np.float32)
                for n in names}

    def disarm(self) -> None:
        """Forget the last decode's rows: every node is declined until the next arm."""
        self._names, self._rows, self._wanted, self._got, self._errors = frozenset(), {}, {}, {}, {}

    # ---------------------------------------------------------------- callback

    def _cb(self, t: Any, ask: bool, user_data: Any) -> bool:
        if ask:
            if self.seen is not None:
                name = self.nat.ffi.string(t.name).decode()
                self.seen.append(name)
                self.shapes.setdefault(name, [int(t.ne[i]) for i in range(4)])
                return False
            name = self.nat.ffi.string(t.name)
            w = self.writer
            return (bool(self._names) and name in self._names) or (w is not None and name in w.names)
        name = self.nat.ffi.string(t.name)
        if self.writer is not None and name in self.writer.names:  # written first: a capture reads what follows
            try:
                self.writer.on_node(t, name.decode())
            except Exception as e:  # noqa: BLE001 - never raise into C
                self.writer.fail(name.decode(), f"patch: writing a node failed: {e!r}")
        if name not in self._names:
            return True
        try:
            self._copy(t)
        except Exception as e:  # noqa: BLE001 - never raise into C
            self._errors[name.decode()] = f"copying a node failed: {e!r}"
        return True

    def _copy(self, t: Any) -> None:
        ffi = self.nat.ffi
        name = ffi.string(t.name).decode()
        k = self._count.get(name, 0)  # this is the node's evaluation in micro-batch k
        self._count[name] = k + 1
        if k >= len(self._ubatches):
            self._errors[name] = (f"node {name!r} was evaluated {k + 1} times in one decode: the batch "
                                  f"ran as more micro-batches than the {len(self._ubatches)} expected")
            return
        rows = self._ubatches[k]  # batch rows of this micro-batch, in its order
        out_rows = rows[self._has_logits[rows]]
        dtype = self._float.get(int(t.type))
        ne = [int(t.ne[i]) for i in range(4)]
        nb = [int(t.nb[i]) for i in range(4)]
        tok = max((d for d in range(1, 4) if ne[d] != 1), default=1)  # the outermost dimension
        if ne[tok] == len(rows):
            dim_rows = rows  # a per-token node
        elif ne[tok] == len(out_rows):
            dim_rows = out_rows  # the output rows only (after llama.cpp's inp_out_ids selection)
        else:
            self._errors[name] = (f"node {name!r} (shape {ne}) has no dimension of the batch's "
                                  f"{len(rows)} tokens or {len(out_rows)} output rows outermost: "
                                  f"not a per-token node")
            return
        want = [r for key, rs in self._rows.items() if name in self._wanted.get(key, ()) for r in rs]
        if dim_rows is out_rows:
            missing = sorted(set(want) & set(rows.tolist()) - set(out_rows.tolist()))
            if missing:
                self._errors[name] = (f"node {name!r} holds only the output rows; rows {missing} "
                                      f"have no logits requested")
                return
        at = {int(r): i for i, r in enumerate(dim_rows)}
        mine = sorted({int(r) for r in want if int(r) in at})
        if not mine:
            return
        if dtype is None or t.data == ffi.NULL:
            self._errors[name] = f"node {name!r} is not a float tensor"
            return
        if self.on_host(t):
            span = sum((n - 1) * b for n, b in zip(ne, nb)) + np.dtype(dtype).itemsize
            raw = np.frombuffer(ffi.buffer(ffi.cast("char *", t.data), span), dtype=dtype)
            view = np.lib.stride_tricks.as_strided(raw, shape=ne[tok::-1], strides=nb[tok::-1])
            got = view[[at[r] for r in mine]].astype(np.float32)
        else:
            got = self._device_rows(t, ne, nb, tok, [at[r] for r in mine], dtype)
        self._got.setdefault(name, {}).update(zip(mine, got))

    def on_host(self, t: Any) -> bool:
        """Whether a node's data is host memory (CPU backends) rather than a GPU's."""
        ffi, lib = self.nat.ffi, self.nat.lib
        return t.buffer == ffi.NULL or bool(lib.ggml_backend_buffer_is_host(t.buffer))

    def _device_rows(self, t: Any, ne: list[int], nb: list[int], tok: int, index: list[int],
                     dtype: Any) -> np.ndarray:
        """The wanted rows of a node in device memory, each copied to the host on its own
        (ggml_backend_tensor_get: only the rows asked for cross the bus)."""
        ffi, lib = self.nat.ffi, self.nat.lib
        size = row_bytes(ne, nb, tok, np.dtype(dtype).itemsize)
        out = []
        for i in index:
            buf = ffi.new("char[]", size)
            lib.ggml_backend_tensor_get(t, buf, i * nb[tok], size)
            raw = np.frombuffer(ffi.buffer(buf, size), dtype=dtype)
            out.append(np.lib.stride_tricks.as_strided(raw, shape=ne[tok - 1::-1], strides=nb[tok - 1::-1]))
        return np.stack(out).astype(np.float32)


def row_bytes(ne: list[int], nb: list[int], tok: int, itemsize: int) -> int:
    """The bytes one token's row of a node spans from its start: the lower dimensions'
    extents (a view's rows may be further apart than that, nb[tok])."""
    return sum((n - 1) * b for n, b in zip(ne[:tok], nb[:tok])) + itemsize


def micro_batches(seq_of_row: Any, n_ubatch: int, streams: bool) -> list[list[int]]:
    """How llama.cpp (b11312 llama_batch_allocr) splits a batch whose tokens carry one
    sequence id each into micro-batches: the batch rows of each, in its order.

    One KV stream (kvUnified): `split_simple`, consecutive runs of n_ubatch tokens. One
    stream per sequence: `split_equal(sequential)`, where a micro-batch takes sequences
    of consecutive ids in order of first appearance, the same number of tokens from each,
    concatenated sequence by sequence. Capture checks each node's evaluations against
    this (count and token dimension) and refuses rather than guesses when they differ."""
    seq = [int(s) for s in seq_of_row]
    n = len(seq)
    if not streams:
        return [list(range(i, min(i + n_ubatch, n))) for i in range(0, n, n_ubatch)]
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seq):
        rows_of.setdefault(s, []).append(i)
    used = [False] * n
    nxt = {s: 0 for s in rows_of}  # each sequence's first unused token (used in order)
    out: list[list[int]] = []
    while not all(used):
        sets: list[int] = []
        for i in range(n):
            if used[i] or seq[i] in sets or (sets and seq[i] != sets[-1] + 1):
                continue
            sets.append(seq[i])
            if len(sets) > n_ubatch:
                break
        take: dict[int, list[int]] = {s: [] for s in sets}
        while all(nxt[s] < len(rows_of[s]) for s in sets):
            for s in sets:
                r = rows_of[s][nxt[s]]
                take[s].append(r)
                used[r] = True
                nxt[s] += 1
            if (len(take[sets[0]]) + 1) * len(sets) > n_ubatch:
                break
        out.append([r for s in sets for r in take[s]])
    return out


# -------------------------------------------------------------------- node names


def graph_nodes(model: Any, flash_attn: str = "auto") -> list[str]:
    """The node names of the model's decode graph, in graph order (a decode on a
    throw-away context whose callback declines every node while listing it). Attention's
    inner nodes differ with flash attention, so pass the serving context's setting."""
    return graph(model, flash_attn).names


@dataclass(frozen=True)
class Graph:
    """What the listing decode saw: the names in graph order, and per name the elements
    of one token's row and whether the node holds only the rows with logits (the last
    layer's nodes after llama.cpp's `inp_out_ids` selection)."""

    names: list[str]
    row_elems: dict[str, int]
    output_rows_only: frozenset[str]
    #: names listed by the graph that cannot be captured, and why (not in `names`):
    #: a name llama.cpp gives to several nodes of one decode (Qcur-N, Kcur-N and Vcur-N
    #: before and after their reshape and RoPE, norm-N for each norm of a layer, the
    #: cache views), or a node whose outermost dimension is not the tokens' (the views of
    #: the KV cache's cells; attention scores per head, kq_soft_max-N without flash
    #: attention): Capture._copy refuses those at every decode, so they are not offered
    excluded: dict[str, str] = field(default_factory=dict)


LISTING_TOKENS = 3  # the listing decode: 3 tokens, logits on the last only


def graph(model: Any, flash_attn: str = "auto") -> Graph:
    """The model's decode graph (cached per model and flash-attention setting): one
    decode of LISTING_TOKENS tokens with logits on the last, so a node's token
    dimension tells a per-token node (3) from one of the output rows only (1)."""
    cache = model.__dict__.setdefault("_graph_nodes", {})
    if flash_attn in cache:
        return cache[flash_attn]
    from ..llama import core

    cap = Capture(model.nat)
    cap.seen = []
    ctx = core.Context(model, n_ctx=64, n_batch=8, n_seq_max=1, flash_attn=flash_attn,
                       eval_callback=cap.callback)
    try:
        from ..llama import features

        if features.available(model.nat, "steer-slots"):  # a gate's nodes (steer_proj-L, steer_gate-L): its trace
            model.nat.lib.llama_steer_set_slots(ctx.ptr, 1, True)
        batch = core.Batch(model.nat, 8)
        batch.add([model.bos] * LISTING_TOKENS, 0, 0)
        if ctx.decode(batch) != 0:
            raise RuntimeError("decoding the listing batch failed")
    finally:
        ctx.close()
    times = Counter(cap.seen)
    row_elems, only_out, excluded = {}, set(), {}
    for name, ne in cap.shapes.items():
        tok = max((d for d in range(1, 4) if ne[d] != 1), default=1)
        row_elems[name] = int(np.prod(ne[:tok]))
        if times[name] > 1:
            excluded[name] = (f"llama.cpp gives this name to {times[name]} nodes of one decode (e.g. before and "
                              "after a reshape or RoPE), so which one is meant cannot be told")
        elif ne[tok] not in (LISTING_TOKENS, 1):
            excluded[name] = (f"its outermost dimension is not the tokens' (shape {ne}: a view of the KV "
                              "cache's cells, or attention laid out per head)")
        elif ne[tok] == 1:
            only_out.add(name)
    names = [n for n in dict.fromkeys(cap.seen) if n not in excluded]
    cache[flash_attn] = g = Graph(names, row_elems, frozenset(only_out), excluded)
    return g


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


def validate(names, valid: list[str], excluded: dict[str, str] | None = None) -> list[str]:
    """The requested names, checked against the graph's; CaptureError listing valid ones
    (or saying why a name the graph has is not captured: Graph.excluded)."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise CaptureError("capture", "must be a list of graph node names")
    have = set(valid)
    bad = [n for n in names if n not in have]
    why = next((n for n in bad if excluded and n in excluded), None)
    if why is not None:
        raise CaptureError("capture", f"node {why!r} is not captured: {excluded[why]}; capturable nodes: "
                                      f"{describe(valid)}")
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
