"""The logit lens: what each layer's residual stream says the next token is.

Rows of `l_out-L` (read from a decode by capture.py) go through the model's own last steps
in a ggml graph of their own, composed through the generated bindings and run on ggml's
CPU backend: the final RMS norm with its weight, the output head (`output.weight`, or
`token_embd.weight` where the head is tied) in its stored quantized type, the final-logit
softcap where the model has one, then per row the top k and what the log-softmax and the
entropy need. These are the ops, in the order, of llama.cpp's own graph after the last
layer (src/models/gemma3.cpp, llama.cpp), so the last layer's lens is the model's logits.

The weights are the GGUF file's own bytes, memory-mapped (no copy of the head): ggml's
gguf reader gives the tensors' types, shapes and offsets, and a CPU buffer over the mapped
data section holds them. Only the rows asked for are multiplied. Why a graph of its own
and not inside the decode, and what it costs: docs/ACTIVATIONS.md, "The logit lens".
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: architectures whose steps after the last layer are checked to be these (llama.cpp's
#: src/models/<arch>.cpp): RMS norm with a weight, the head, and the softcap if the key is set
ARCHES = ("gemma3", "llama")
#: rows multiplied in one graph (each row's logits, softmax and product: 3 x 4 x n_vocab bytes)
CHUNK = 32
_NODES = 64


class LensError(ValueError):
    """The model or the request cannot have a lens; the message says why."""


@dataclass(frozen=True)
class LensRows:
    """Per row: the top k token ids (by log-probability, descending; equal values by id),
    their log-probabilities, and the entropy (nats) of the whole distribution."""

    ids: np.ndarray  # [m, k] int32
    logprobs: np.ndarray  # [m, k] float32
    entropy: np.ndarray  # [m] float32


class Lens:
    """The model file's final norm and output head, ready to apply to residual rows."""

    def __init__(self, nat: Any, path: str | Path, n_threads: int = 1) -> None:
        self.nat, self.path, self.n_threads = nat, Path(path), n_threads
        lib, ffi = nat.lib, nat.ffi
        self._meta = ffi.new("struct ggml_context **")
        params = ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": self._meta})
        self._gguf = lib.gguf_init_from_file(str(self.path).encode(), params[0])
        if self._gguf == ffi.NULL:
            raise LensError(f"lens: ggml cannot read {self.path} as GGUF")
        self._buf = self._backend = None
        self._file = self._map = None
        try:
            self.arch = self._str("general.architecture")
            if self.arch not in ARCHES:
                raise LensError(f"lens: architecture {self.arch!r} is not one whose final steps are checked "
                                f"({', '.join(ARCHES)})")
            self.eps = self._f32(f"{self.arch}.attention.layer_norm_rms_epsilon")
            self.softcap = self._f32(f"{self.arch}.final_logit_softcapping", 0.0)
            self.norm = self._tensor("output_norm.weight")
            own = lib.gguf_find_tensor(self._gguf, b"output.weight") >= 0
            self.tied = not own
            self.head = self._tensor("output.weight" if own else "token_embd.weight")
            if lib.gguf_find_tensor(self._gguf, b"output.scale") >= 0:
                raise LensError("lens: this model scales its output head (output.scale), a step not composed here")
            self.n_embd, self.n_vocab = int(self.head.ne[0]), int(self.head.ne[1])
            self._place_weights()
            self._backend = lib.ggml_backend_cpu_init()
            lib.ggml_backend_cpu_set_n_threads(self._backend, n_threads)
        except BaseException:
            self.close()
            raise

    # -- the file -------------------------------------------------------------------

    def _str(self, key: str) -> str:
        lib, ffi = self.nat.lib, self.nat.ffi
        i = lib.gguf_find_key(self._gguf, key.encode())
        if i < 0:
            raise LensError(f"lens: {self.path.name} has no {key}")
        return ffi.string(lib.gguf_get_val_str(self._gguf, i)).decode()

    def _f32(self, key: str, default: float | None = None) -> float:
        lib = self.nat.lib
        i = lib.gguf_find_key(self._gguf, key.encode())
        if i < 0:
            if default is None:
                raise LensError(f"lens: {self.path.name} has no {key}")
            return default
        return float(lib.gguf_get_val_f32(self._gguf, i))

    def _tensor(self, name: str) -> Any:
        t = self.nat.lib.ggml_get_tensor(self._meta[0], name.encode())
        if t == self.nat.ffi.NULL:
            raise LensError(f"lens: {self.path.name} has no tensor {name}")
        return t

    def _place_weights(self) -> None:
        """Point the norm and head tensors at the mapped file: one CPU buffer over the
        data section (page-aligned map + the file's aligned data offset), no copy."""
        lib, ffi = self.nat.lib, self.nat.ffi
        self._file = open(self.path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        base = int(ffi.cast("uintptr_t", ffi.from_buffer(self._map)))
        start = int(lib.gguf_get_data_offset(self._gguf))
        size = len(self._map) - start
        self._buf = lib.ggml_backend_cpu_buffer_from_ptr(ffi.cast("void *", base + start), size)
        for name, t in (("output_norm.weight", self.norm), (None, self.head)):
            name = name or ("token_embd.weight" if self.tied else "output.weight")
            i = lib.gguf_find_tensor(self._gguf, name.encode())
            off = int(lib.gguf_get_tensor_offset(self._gguf, i))
            if int(lib.gguf_get_tensor_size(self._gguf, i)) != int(lib.ggml_nbytes(t)) or \
                    off + int(lib.ggml_nbytes(t)) > size:
                raise LensError(f"lens: {name} does not fit where {self.path.name} puts it")
            lib.ggml_backend_tensor_alloc(self._buf, t, ffi.cast("void *", base + start + off))

    @property
    def head_type(self) -> str:
        return self.nat.ffi.string(self.nat.lib.ggml_type_name(self.head.type)).decode()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the file the lens reads (the head and the norm): mapped, shared with the
        page cache, never copied."""
        lib = self.nat.lib
        return int(lib.ggml_nbytes(self.head)) + int(lib.ggml_nbytes(self.norm))

    def close(self) -> None:
        lib, ffi = self.nat.lib, self.nat.ffi
        if self._backend is not None:
            lib.ggml_backend_free(self._backend)
            self._backend = None
        if self._buf is not None and self._buf != ffi.NULL:
            lib.ggml_backend_buffer_free(self._buf)
        self._buf = None
        if self._gguf is not None and self._gguf != ffi.NULL:
            lib.gguf_free(self._gguf)
            lib.ggml_free(self._meta[0])
        self._gguf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a cffi view of it is still alive: the map goes with it
                pass
            self._file.close()
            self._map = self._file = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- the graph --------------------------------------------------------------------

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """[m, n_vocab] float32: the head's logits of residual rows [m, n_embd] (the
        checks' view of the same graph; `apply` keeps only the top k and two sums)."""
        return np.concatenate([self._run(c, 0) for c in _chunks(rows, self.n_embd)])

    def apply(self, rows: np.ndarray, top: int) -> LensRows:
        """The lens of residual rows [m, n_embd] (float32): top ``top`` ids and
        log-probabilities and the entropy, each row as it would be alone."""
        if not 1 <= top <= self.n_vocab:
            raise LensError(f"lens: top must be 1..{self.n_vocab}, got {top}")
        packs = [self._run(c, top) for c in _chunks(rows, self.n_embd)]
        packed = np.concatenate(packs) if packs else np.zeros((0, 2 * top + 3), np.float32)
        return unpack(packed, top)

    def _run(self, rows: np.ndarray, top: int) -> np.ndarray:
        """One graph over m <= CHUNK rows: the logits (top 0) or the packed lens rows."""
        lib, ffi = self.nat.lib, self.nat.ffi
        m, V = rows.shape[0], self.n_vocab
        size = lib.ggml_tensor_overhead() * _NODES + lib.ggml_graph_overhead_custom(_NODES, False)
        p = ffi.new("struct ggml_init_params *", {"mem_size": size, "mem_buffer": ffi.NULL, "no_alloc": True})
        ctx = lib.ggml_init(p[0])
        buf = None
        try:
            x = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_F32, self.n_embd, m)
            lib.ggml_set_input(x)
            out = self.build(ctx, x, top)
            gf = lib.ggml_new_graph_custom(ctx, _NODES, False)
            lib.ggml_build_forward_expand(gf, out)
            buf = lib.ggml_backend_alloc_ctx_tensors(ctx, self._backend)
            if buf == ffi.NULL:
                raise MemoryError(f"lens: ggml could not allocate {m} rows of the lens graph")
            lib.ggml_backend_tensor_set(x, ffi.from_buffer(rows), 0, rows.nbytes)
            if lib.ggml_backend_graph_compute(self._backend, gf) != lib.GGML_STATUS_SUCCESS:
                raise RuntimeError("lens: ggml's CPU backend failed the lens graph")
            res = np.empty((m, int(out.ne[0])), np.float32)
            lib.ggml_backend_tensor_get(out, ffi.from_buffer(res), 0, res.nbytes)
            return res
        finally:
            if buf is not None and buf != ffi.NULL:
                lib.ggml_backend_buffer_free(buf)
            lib.ggml_free(ctx)

    def build(self, ctx: Any, x: Any, top: int) -> Any:
        """The ops over ``x`` [n_embd, m]: llama.cpp's final norm, head and softcap
        (top 0: those logits), then per row [top values | top ids | max logit | its
        softmax probability | sum of p x logit] (2 top + 3 floats)."""
        lib = self.nat.lib
        m, V = int(x.ne[1]), self.n_vocab
        cur = lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, self.eps), self.norm)
        cur = lib.ggml_mul_mat(ctx, self.head, cur)                              # [V, m]
        if self.softcap:
            cur = lib.ggml_scale(ctx, cur, 1.0 / self.softcap)
            cur = lib.ggml_scale(ctx, lib.ggml_tanh(ctx, cur), self.softcap)
        if top == 0:
            return cur
        l3 = lib.ggml_reshape_3d(ctx, cur, 1, V, m)
        ids = lib.ggml_top_k(ctx, cur, top)                                      # [top, m] i32
        vals = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, l3, ids), top, m)
        arg = lib.ggml_reshape_2d(ctx, lib.ggml_argmax(ctx, cur), 1, m)
        l_max = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, l3, arg), 1, m)
        prob = lib.ggml_soft_max(ctx, cur)                                       # [V, m]
        p_max = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, prob, 1, V, m), arg), 1, m)
        mean = lib.ggml_sum_rows(ctx, lib.ggml_mul(ctx, prob, cur))              # [1, m]
        pack = vals
        for piece in (lib.ggml_cast(ctx, ids, lib.GGML_TYPE_F32), l_max, p_max, mean):
            pack = lib.ggml_concat(ctx, pack, piece, 0)
        return pack


def _chunks(rows: np.ndarray, n_embd: int):
    rows = np.ascontiguousarray(rows, np.float32)
    if rows.ndim != 2 or rows.shape[1] != n_embd:
        raise LensError(f"lens: rows must be [m, {n_embd}], got {list(rows.shape)}")
    for i in range(0, rows.shape[0], CHUNK):
        yield np.ascontiguousarray(rows[i:i + CHUNK])


def unpack(packed: np.ndarray, top: int) -> LensRows:
    """LensRows of the graph's packed rows [m, 2 top + 3]. The log-sum-exp is the max
    logit less the log of its softmax probability (at least 1 / n_vocab, so its log is
    exact to float32); the entropy is that less the expected logit. ggml's CPU top_k gives
    the k best in no promised order: each row is sorted by value, then id."""
    vals = packed[:, :top].astype(np.float64)
    ids = packed[:, top:2 * top].astype(np.int32)
    l_max, p_max, mean = (packed[:, 2 * top + i].astype(np.float64) for i in range(3))
    lse = l_max - np.log(p_max)
    order = np.lexsort((ids, -vals), axis=1)
    ids = np.take_along_axis(ids, order, 1)
    logprobs = (np.take_along_axis(vals, order, 1) - lse[:, None]).astype(np.float32)
    return LensRows(ids, logprobs, (lse - mean).astype(np.float32))


def layers_of(spec: Any, n_layer: int) -> list[int]:
    """The layers a request's `lens.layers` names: "all" or a list of distinct
    0..n_layer-1 (negative counts from the end); LensError naming what is wrong."""
    if spec == "all":
        return list(range(n_layer))
    if not isinstance(spec, list) or not spec or not all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in spec):
        raise LensError('lens: layers must be "all" or a non-empty list of layer numbers')
    out = []
    for i in spec:
        j = i + n_layer if i < 0 else i
        if not 0 <= j < n_layer:
            raise LensError(f"lens: layers: {i} is not a layer of this model (0..{n_layer - 1})")
        if j in out:
            raise LensError(f"lens: layers: layer {j} listed twice")
        out.append(j)
    return sorted(out)
