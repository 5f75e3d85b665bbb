"""The pre-selection's own ops run on ggml's CPU backend over given logits rows, without
a model: graph.build and graph.fill on a small ggml context of their own, then unpack,
as `Presampler.read` would after a decode. The tests hold these ops to the host path on
rows hypothesis draws (a decode gives only the rows a model writes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .graph import build, fill, mask_table
from .reuse import plan_of, roomy
from .rows import Preselected, RowOrder
from .unpack import unpack

#: graph nodes and tensors a context is sized for (build adds about 60 at most)
_NODES = 512


def preselect(nat: Any, rows: np.ndarray, orders: list[RowOrder], n_threads: int = 1) -> list[Preselected]:
    """Each row's pre-selection (``rows``: [m, V] float32, one order each), all rows in
    one graph as one decode's micro-batch: the K and touched ids a new graph gets
    (`roomy`), each row read back at its own."""
    lib, ffi = nat.lib, nat.ffi
    rows = np.ascontiguousarray(rows, np.float32)
    m, V = rows.shape
    by_slot = dict(enumerate(orders))
    plan = roomy(plan_of(by_slot, V, keep=False), V)
    # ggml's own record, the same in every version: given whole (bindgen/usage.py reads
    # attribute names alone, and `no_alloc` is also a newer llama_model_params field)
    size = lib.ggml_tensor_overhead() * _NODES + lib.ggml_graph_overhead_custom(_NODES, False)
    p = ffi.new("struct ggml_init_params *", {"mem_size": size, "mem_buffer": ffi.NULL, "no_alloc": True})
    ctx = lib.ggml_init(p[0])
    backend = buf = None
    try:
        logits = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_F32, V, m)
        sh = build(nat, ctx, logits, plan, by_slot, V)
        gf = lib.ggml_new_graph_custom(ctx, _NODES, False)
        lib.ggml_build_forward_expand(gf, sh["pack"])
        backend = lib.ggml_backend_cpu_init()
        lib.ggml_backend_cpu_set_n_threads(backend, n_threads)
        buf = lib.ggml_backend_alloc_ctx_tensors(ctx, backend)
        if buf == ffi.NULL:
            raise RuntimeError("ggml could not allocate the pre-selection's tensors")
        lib.ggml_backend_tensor_set(logits, ffi.from_buffer(rows), 0, rows.nbytes)
        cost = {"up_bytes": 0, "down_bytes": 0}
        fill(nat, sh, by_slot, {s: s for s in by_slot}, mask_table(), None, cost, V)
        if lib.ggml_backend_graph_compute(backend, gf) != lib.GGML_STATUS_SUCCESS:
            raise RuntimeError("ggml's CPU backend failed the pre-selection's graph")
        lay = sh["layout"]
        packed = np.empty((m, lay.size), np.float32)
        lib.ggml_backend_tensor_get(sh["pack"], ffi.from_buffer(packed), 0, packed.nbytes)
        return unpack(packed, lay, [by_slot[s] for s in sh["slots"]])
    finally:
        if buf is not None and buf != ffi.NULL:
            lib.ggml_backend_buffer_free(buf)
        if backend is not None:
            lib.ggml_backend_free(backend)
        lib.ggml_free(ctx)
