"""The ggml ops of the pre-selection, composed through the generated bindings (no C of
ours): `build` adds them over every ordered row to llama.cpp's decode graph, `fill`
uploads their inputs once per micro-batch. The ops and their costs: docs/BENCHMARKS.md,
"Pre-selection inside the decode"; their numpy twin is reference.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .reuse import Plan
from .rows import BLOCK, DENSE_BLOCKS, RowOrder


def graph_logits(lib: Any, src: Any) -> Any:
    """The graph's logits tensor under the rows the samplers see (llama.cpp hands them a
    padded copy: ggml_pad of t_logits, which it marks an output once the graph is built;
    `full_row` checks that before reading: a tensor that is not an output may have its
    memory reused within the graph)."""
    return src.src[0] if src.op == lib.GGML_OP_PAD else src


def mask_table() -> np.ndarray:
    """[256, 8] float32: row b, column j = 0 when bit j of byte b is set, else -inf (the
    grammar bias of the 8 tokens one bitmask byte covers, little-endian bit order)."""
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
    return np.where(bits == 1, 0.0, -np.inf).astype(np.float32)


def build(nat: Any, ctx: Any, logits_t: Any, plan: Plan, orders: dict[int, RowOrder],
          n_vocab: int) -> dict[str, Any]:
    """The shared ops over the row of every slot in ``plan`` (``orders``: by slot), added
    to the graph context ``ctx`` over the logits tensor ``logits_t``."""
    lib = nat.lib
    V, nb = n_vocab, -(-n_vocab // BLOCK)
    slots, layout = list(plan.slots), plan.layout
    n = len(slots)
    k, n_touched, dense, raw, mass = layout.k, layout.n_touched, layout.dense, layout.raw, layout.mass
    masked = any(orders[s].mask is not None for s in slots)
    F32, I32 = lib.GGML_TYPE_F32, lib.GGML_TYPE_I32

    def inp(t, name):
        lib.ggml_set_input(t)
        lib.ggml_set_name(t, name)
        return t

    rows = inp(lib.ggml_new_tensor_1d(ctx, I32, n), b"cp_rows")
    x = lib.ggml_get_rows(ctx, logits_t, rows)                                 # [V, n]
    y = x
    table = mask_bytes = None
    if masked:
        nbytes = -(-V // 8)
        table = inp(lib.ggml_new_tensor_2d(ctx, F32, 8, 256), b"cp_mask_table")
        mask_bytes = inp(lib.ggml_new_tensor_1d(ctx, I32, nbytes * n), b"cp_mask_bytes")
        bias = lib.ggml_get_rows(ctx, table, mask_bytes)                       # [8, nbytes * n]
        bias = lib.ggml_reshape_2d(ctx, bias, nbytes * 8, n)
        if nbytes * 8 != V:
            bias = lib.ggml_view_2d(ctx, bias, V, n, int(bias.nb[1]), 0)
        y = lib.ggml_add(ctx, x, bias)
    y3 = lib.ggml_reshape_3d(ctx, y, 1, V, n)
    # the max's id: at K = 1 it is the row's one id, and must be the first of equal maxima
    # (the host's and llama.cpp's greedy pick); ggml's CPU argmax keeps the last of them,
    # its top-k of 1 (a partial sort that replaces only on a larger value) the first
    arg = lib.ggml_top_k(ctx, y, 1) if k == 1 else lib.ggml_argmax(ctx, y)
    arg = lib.ggml_reshape_2d(ctx, arg, 1, n)                                   # [1, n] i32
    top = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, y3, arg), 1, n)      # [1, n]
    if k == 1:  # greedy rows only: no wider top-k pass
        top_ids, vals = arg, top
    else:
        top_ids = lib.ggml_top_k(ctx, y, k)                                    # [k, n] i32
        vals = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, y3, top_ids), k, n)
    pieces = [vals, lib.ggml_cast(ctx, top_ids, F32)]
    inv_tau = u = e3 = blocks = None
    if mass:
        # softmax(y / tau): ggml's vectorised exp (its plain exp op is scalar, 10x slower
        # here); the host divides by the top's probability to get exp((y - top) / tau)
        if plan.scale is not None:  # one temperature for all rows: softmax's own scale, no extra pass
            e = lib.ggml_soft_max_ext(ctx, y, nat.ffi.NULL, float(plan.scale), 0.0)
        else:
            inv_tau = inp(lib.ggml_new_tensor_2d(ctx, F32, 1, n), b"cp_inv_tau")
            e = lib.ggml_soft_max(ctx, lib.ggml_mul(ctx, y, inv_tau))          # [V, n]
        p_top = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, e, 1, V, n), arg), 1, n)
        if nb * BLOCK != V:
            e = lib.ggml_pad(ctx, e, nb * BLOCK - V, 0, 0, 0)
        e3 = lib.ggml_reshape_3d(ctx, e, BLOCK, nb, n)
        blocks = lib.ggml_reshape_2d(ctx, lib.ggml_sum_rows(ctx, e3), nb, n)   # [nb, n]
        pieces += [top, p_top, blocks]
    if dense:
        u = inp(lib.ggml_new_tensor_2d(ctx, F32, 1, n), b"cp_u")
        cum = lib.ggml_cumsum(ctx, blocks)                                     # [nb, n]
        total = lib.ggml_view_2d(ctx, cum, 1, n, int(cum.nb[1]), (nb - 1) * 4)
        target = lib.ggml_mul(ctx, total, u)                                   # [1, n]
        below = lib.ggml_step(ctx, lib.ggml_neg(ctx, lib.ggml_sub(ctx, cum, target)))
        b = lib.ggml_sum_rows(ctx, below)                                      # [1, n]: blocks below
        around = lib.ggml_arange(ctx, -1.0, float(DENSE_BLOCKS - 1), 1.0)       # [3]
        trio = lib.ggml_add(ctx, lib.ggml_repeat(ctx, b, lib.ggml_new_tensor_2d(ctx, F32, DENSE_BLOCKS, n)),
                            around)
        trio = lib.ggml_clamp(ctx, trio, 0.0, float(nb - 1))
        trio_i = lib.ggml_cast(ctx, trio, I32)                                 # [3, n]
        masses = lib.ggml_get_rows(ctx, e3, trio_i)                            # [BLOCK, 3, n]
        pieces += [lib.ggml_cont(ctx, trio), lib.ggml_reshape_2d(ctx, masses, DENSE_BLOCKS * BLOCK, n)]
    if raw:
        x3 = lib.ggml_reshape_3d(ctx, x, 1, V, n)
        rarg = lib.ggml_reshape_2d(ctx, lib.ggml_argmax(ctx, x), 1, n)
        rmax = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, x3, rarg), 1, n)
        rp = lib.ggml_reshape_3d(ctx, lib.ggml_soft_max(ctx, x), 1, V, n)
        pieces += [rmax, lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, rp, rarg), 1, n)]
        if layout.raw_top:
            rids = lib.ggml_top_k(ctx, x, k)
            rvals = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, x3, rids), k, n)
            pieces += [rvals, lib.ggml_cast(ctx, rids, F32)]
    touched = None
    if n_touched:
        touched = inp(lib.ggml_new_tensor_2d(ctx, I32, n_touched, n), b"cp_touched")
        x3 = lib.ggml_reshape_3d(ctx, x, 1, V, n)
        pieces.append(lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, x3, touched), n_touched, n))
    pack = pieces[0]
    for p in pieces[1:]:
        pack = lib.ggml_concat(ctx, pack, p, 0)
    lib.ggml_set_name(pack, b"cp_pack")
    return {"slots": slots, "index": {s: j for j, s in enumerate(slots)}, "plan": plan,
            "layout": layout, "pack": pack, "rows": rows,
            "table": table, "mask_bytes": mask_bytes, "inv_tau": inv_tau, "u": u, "touched": touched}

def fill(nat: Any, sh: dict[str, Any], orders_by_slot: dict[int, RowOrder], rows: dict[int, int],
         table: np.ndarray, mask_buf: np.ndarray | None, cost: dict[str, int],
         n_vocab: int) -> np.ndarray | None:
    """Upload the inputs of the shared ops ``sh`` (`build`'s; once per micro-batch).
    ``rows``: slot -> its output row in this micro-batch; ``cost`` counts the bytes each
    way. Returns the mask buffer, ``mask_buf`` or a larger one (kept by the caller)."""
    lib, ffi = nat.lib, nat.ffi
    slots, lay = sh["slots"], sh["layout"]
    orders = [orders_by_slot[s] for s in slots]  # this decode's (a reused graph: the same plan)
    n = len(slots)

    def put(t, arr):
        arr = np.ascontiguousarray(arr)
        lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, arr.nbytes)
        cost["up_bytes"] += arr.nbytes

    # a slot this micro-batch does not sample reads row 0 (its results are not used)
    put(sh["rows"], np.array([rows.get(s, 0) for s in slots], np.int32))
    cost["down_bytes"] += 4 * lay.size * sum(s in rows for s in slots)  # its packed rows
    if sh["inv_tau"] is not None:
        put(sh["inv_tau"], np.array([o.inv_tau for o in orders], np.float32))
    if sh["table"] is not None:
        put(sh["table"], table)
        nbytes = -(-n_vocab // 8)
        # one buffer kept across ticks: a fresh 128 KiB per row would be new pages each time
        if mask_buf is None or mask_buf.shape[0] < n:
            mask_buf = np.empty((n, nbytes), np.int32)
        b = mask_buf[:n]
        for j, o in enumerate(orders):
            if o.mask is not None:
                np.copyto(b[j], o.mask[:nbytes], casting="unsafe")
            else:
                b[j] = 255
        put(sh["mask_bytes"], b)
    if sh["u"] is not None:
        put(sh["u"], np.array([0.5 if o.u is None else o.u for o in orders], np.float32))
    if sh["touched"] is not None:
        t = np.zeros((n, lay.n_touched), np.int32)
        for j, o in enumerate(orders):
            t[j, :o.touched.size] = o.touched
        put(sh["touched"], t)
    return mask_buf
