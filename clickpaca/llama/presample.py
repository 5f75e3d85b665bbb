"""Pre-selection inside the decode: the few values per sampled row that a chain needs.

llama.cpp's backend sampling lets a sampler add ggml ops to the decode graph for its
sequence's output row; what they produce comes back instead of the whole row. `Presampler`
attaches one sampler per slot when the context is created (its hooks are cffi callbacks) and
composes ggml's own ops through the generated bindings: no C of ours. Per decode the engine
orders the rows it wants pre-selected (`RowOrder`, by slot); the ops run once over all of them
as one [V, n] tensor, and every other row passes through whole. Each pre-selected row comes
back packed in one float32 row (`Layout`), which `Presampler.read` turns into a `Preselected`
for the chain's fast path (sampling/fastpath.py); `full_row` gives the whole row when that
path cannot decide. The graph is rebuilt only when the tick's `Plan` no longer `fits` the
last one. The ops, the packing, graph reuse and the costs: docs/BENCHMARKS.md,
"Pre-selection inside the decode".
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base.order import canonical_keys, is_canonical, strictly_descending

__all__ = ["BLOCK", "Layout", "Preselected", "Presampler", "RowOrder", "mask_table", "reference"]

#: tokens per mass block (the host path's dense draw uses the same: sampling/candidates.py)
BLOCK = 1024
#: blocks handed back around the one where a dense draw lands
DENSE_BLOCKS = 3
#: graph nodes each sampler reports when llama.cpp probes it (its view, its share of the
#: ~60 shared ops at one row, with room): llama.cpp adds them to the graph's node budget
PROBE_NODES = 64


@dataclass(slots=True)
class RowOrder:
    """What one sampled row asks of the graph (made once per row and tick and not changed
    after: not frozen, whose __init__ costs three times a plain one's).

    k: top ids wanted (the graph gives the tick's largest k to every row); when the
      largest is 1, the one id is ggml's argmax (the first of equal maxima: the canonical
      first token), not a top-k;
    mass: the block masses (and the max they are taken from) are wanted;
    inv_tau: 1/temperature for the masses (1.0 when no temperature applies);
    touched: int32 ids whose raw logits the host adjusts (bias, penalties);
    u: the uniform of a draw over the whole set (None: no dense draw);
    raw: the raw row's own max, mass and top ids are wanted (nProbs when y is not x at tau 1);
    mask: the grammar's bitmask as uint8 bytes (None: no grammar)."""

    k: int
    mass: bool = True
    inv_tau: float = 1.0
    touched: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    u: float | None = None
    raw: bool = False
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class Layout:
    """Where each piece sits in a packed row (float32 offsets); one per micro-batch graph."""

    k: int
    n_blocks: int
    n_touched: int
    dense: bool
    raw: bool
    raw_top: bool
    mass: bool = True

    @functools.cached_property
    def pieces(self) -> list[tuple[str, int]]:
        out = [("vals", self.k), ("ids", self.k)]
        if self.mass:
            out += [("top", 1), ("p_top", 1), ("blocks", self.n_blocks)]
        if self.dense:
            out += [("dense_ids", DENSE_BLOCKS), ("dense", DENSE_BLOCKS * BLOCK)]
        if self.raw:
            out += [("raw_max", 1), ("raw_p_max", 1)]
            if self.raw_top:
                out += [("raw_vals", self.k), ("raw_ids", self.k)]
        if self.n_touched:
            out += [("touched", self.n_touched)]
        return out

    @functools.cached_property
    def size(self) -> int:
        return sum(n for _, n in self.pieces)

    @functools.cached_property
    def at(self) -> dict[str, slice]:
        """Each piece's columns in a packed row."""
        out, at = {}, 0
        for name, n in self.pieces:
            out[name] = slice(at, at + n)
            at += n
        return out


@dataclass(frozen=True)
class Plan:
    """The shape of the ops for a set of orders: what a graph was built for. Two decodes
    with equal plans (and equal micro-batches) can share one graph."""

    slots: tuple[int, ...]
    layout: Layout
    scale: float | None  # the one 1/tau of every row (softmax's own scale), else None
    keep: bool = True  # whole rows copied beside the packs (a decode of several micro-batches)


#: a new graph's K and touched ids are rounded up to these, so that orders which grow by a
#: few (a penalty window's distinct tokens, say) still fit the graph built for them
K_ROOM, TOUCHED_ROOM = 32, 16


def _room(n: int, step: int) -> int:
    return -(-n // step) * step


def roomy(plan: Plan, n_vocab: int) -> Plan:
    """``plan`` with K (above 1: argmax's plan stays) and the touched ids rounded up to
    K_ROOM and TOUCHED_ROOM: what a new graph is built for."""
    lay = plan.layout
    k = lay.k if lay.k == 1 else min(n_vocab, _room(lay.k, K_ROOM))
    t = _room(lay.n_touched, TOUCHED_ROOM)
    if (k, t) == (lay.k, lay.n_touched):
        return plan
    return dataclasses.replace(plan, layout=dataclasses.replace(lay, k=k, n_touched=t))


def fits(plan: Plan, built: Plan | None) -> bool:
    """Whether the graph built for ``built`` serves ``plan``: its ops compute a superset
    (the same rows, pieces and temperature; K and touched ids at least as many, and at
    most twice as many or what `roomy` makes of them, so that a graph much too large is
    rebuilt). Each row reads its own k best and its own touched values from the larger
    pack (`unpack`)."""
    if built is None or plan.slots != built.slots or plan.keep != built.keep or plan.scale != built.scale:
        return False
    a, b = plan.layout, built.layout
    return ((a.n_blocks, a.dense, a.raw, a.raw_top, a.mass) == (b.n_blocks, b.dense, b.raw, b.raw_top, b.mass)
            and (a.k == b.k or 1 < a.k <= b.k <= max(2 * a.k, _room(a.k, K_ROOM)))
            and a.n_touched <= b.n_touched <= max(2 * a.n_touched, _room(a.n_touched, TOUCHED_ROOM)))


def plan_of(orders: dict[int, RowOrder], n_vocab: int, keep: bool = True) -> Plan | None:
    """The ops' shape for these orders (None: no rows ordered)."""
    if not orders:
        return None
    slots = tuple(sorted(orders))
    os_ = [orders[s] for s in slots]
    k = min(n_vocab, max(o.k for o in os_))
    n_touched = max(o.touched.size for o in os_)
    masked = any(o.mask is not None for o in os_)
    dense = any(o.u is not None for o in os_)
    raw = any(o.raw for o in os_)
    mass = dense or any(o.mass for o in os_)
    layout = Layout(k, -(-n_vocab // BLOCK), n_touched, dense, raw, raw_top=raw and masked, mass=mass)
    scales = {o.inv_tau for o in os_}
    return Plan(slots, layout, scales.pop() if mass and len(scales) == 1 else None, keep)


@dataclass(slots=True)
class Preselected:
    """One row's pre-selection, decoded from its packed floats (see the module doc).

    ids/vals: the K best of y (the row with the grammar applied), in canonical order
    (value descending, then id; the fast path reads a row's k best as its first k):
    disallowed tokens may appear with -inf when fewer than K are allowed. top: y's max.
    blocks: the masses exp((y - top) * inv_tau) summed per BLOCK tokens (ggml's softmax in float32,
    summed in float64 per block, over the top's probability; None when not ordered).
    dense: {block id: its BLOCK masses} around the draw.
    raw_max/raw_mass: the raw row's max and sum exp(x - max) (None: y is x and inv_tau 1,
    so top/blocks serve). raw_ids/raw_vals: x's own K best (None: ids/vals serve).
    touched: x at the order's touched ids."""

    order: RowOrder
    ids: np.ndarray
    vals: np.ndarray
    top: float
    blocks: np.ndarray | None
    dense: dict[int, np.ndarray] | None
    raw_max: float | None
    raw_mass: float | None
    raw_ids: np.ndarray | None
    raw_vals: np.ndarray | None
    touched: np.ndarray

    @property
    def floor(self) -> float:
        """Every token outside ``ids`` has y <= this (the K-th best value): a decision is
        exact when what it keeps lies strictly above it."""
        return float(self.vals.min()) if self.vals.size else np.inf

    @property
    def first(self) -> bool:
        """``ids`` is argmax's one id: the canonical first token itself (the largest
        value, the smallest id among equal ones), exact whatever ties."""
        return self.ids.size == 1


def unpack(packed: np.ndarray, lay: Layout, orders: list[RowOrder]) -> list[Preselected]:
    """The Preselected of each packed row ([m, lay.size] float32, one per order). The
    graph's masses are softmax probabilities: over the top's they are exp((y - top) /
    tau); every row is computed as it would be alone (elementwise, or per row)."""
    at = lay.at
    m = packed.shape[0]
    # the pieces "vals", "ids" (and "raw_vals", "raw_ids") lie side by side
    ids, vals, clean = _own_best_rows(packed[:, :2 * lay.k], lay.k)
    z = None
    if lay.mass:  # as float32(1 / p_top) times each float32 mass, the read of one row
        z = (1.0 / packed[:, at["p_top"].start].astype(np.float64)).astype(np.float32)[:, None]
    blocks = packed[:, at["blocks"]] * z if lay.mass else None
    tops = packed[:, at["top"].start].tolist() if lay.mass else None
    dense_ids = dense = None
    if lay.dense:
        dense_ids = packed[:, at["dense_ids"]].astype(np.int64).tolist()
        dense = packed[:, at["dense"]].reshape(m, DENSE_BLOCKS, BLOCK) * z[:, :, None]
    raw_ids = raw_vals = None
    if lay.raw:
        raw_max = packed[:, at["raw_max"].start].tolist()
        raw_mass = (1.0 / packed[:, at["raw_p_max"].start].astype(np.float64)).tolist()
        if lay.raw_top:
            r = at["raw_vals"].start
            raw_ids, raw_vals, _ = _own_best_rows(packed[:, r:r + 2 * lay.k], lay.k)
    touched = packed[:, at["touched"]] if lay.n_touched else None
    if not lay.mass:  # y's max: the first of the sorted values, unless a NaN is among them
        first = vals[:, 0].tolist()
        nan = [False] * m if clean else np.logical_or.reduce(np.isnan(vals), axis=1).tolist()
    # one view per row, made in C (list() of a matrix), sliced only where a row's own k or
    # touched ids are fewer than the graph's (an index per row costs as much as the row)
    K, T = lay.k, lay.n_touched
    id_rows, val_rows = list(ids), list(vals)
    block_rows = list(blocks) if lay.mass else None
    touched_rows = list(touched) if touched is not None else None
    out = []
    for j, o in enumerate(orders):
        k = o.k
        own_ids, v = (id_rows[j], val_rows[j]) if k == K else (id_rows[j][:k], val_rows[j][:k])
        raw = lay.raw and o.raw
        raw_top = raw and lay.raw_top and o.mask is not None
        out.append(Preselected(
            o, own_ids, v,
            tops[j] if lay.mass else (float(v.max()) if nan[j] else first[j]),
            block_rows[j] if lay.mass and (o.mass or o.u is not None) else None,
            {int(b): dense[j, i] for i, b in enumerate(dense_ids[j])} if lay.dense and o.u is not None else None,
            raw_max[j] if raw else None,
            raw_mass[j] if raw else None,
            raw_ids[j, :k] if raw_top else None,
            raw_vals[j, :k] if raw_top else None,
            _NO_FLOATS if touched_rows is None else
            touched_rows[j] if o.touched.size == T else touched_rows[j][:o.touched.size]))
    return out


_NO_FLOATS = np.empty(0, np.float32)
_NO_FLOATS.flags.writeable = False


def _own_best_rows(head: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Each row's K values by value then id, from ``head`` ([m, 2K]: the K values, then
    their K ids as float32, as the graph packs them): ([m, K] int32 ids, [m, K] values,
    whether every row came strictly descending: no ties and no NaN, so a row's first value
    is its max). The first k of a row are its own k best, the same whatever the others'
    K. At K = 1 the one id is argmax's (the smallest of equal maxima), as when the graph
    took argmax for a micro-batch of greedy rows."""
    if k == 1:
        return head[:, 1:].astype(np.int32), head[:, :1], False
    # ggml's CPU top_k hands the K best back sorted by value but for its first two, which
    # it swaps on purpose: one gather puts them back (values and ids at once), and rows
    # already canonical need no sort (a check of a few passes against the keys' dozen and
    # an argsort); any other order is sorted
    g = head[:, _unswap_columns(k)]
    vals, ids = g[:, :k], g[:, k:].astype(np.int32)
    if strictly_descending(vals):
        return ids, vals, True
    if is_canonical(ids, vals):
        return ids, vals, False
    o = np.argsort(canonical_keys(ids, vals), axis=1)
    return np.take_along_axis(ids, o, 1), np.take_along_axis(vals, o, 1), False


@functools.lru_cache(maxsize=64)
def _unswap_columns(k: int) -> np.ndarray:
    """The columns of a [m, 2k] head (values, then ids) with each half's first two swapped."""
    sw = np.arange(k)
    sw[:2] = 1, 0
    return np.concatenate([sw, sw + k])


def _graph_logits(lib: Any, src: Any) -> Any:
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


class Presampler:
    """One backend sampler per slot; `order` before a decode, `read` after it."""

    NAME = b"clickpaca-preselect"

    def __init__(self, nat: Any, n_vocab: int, n_slots: int) -> None:
        self.nat = nat
        ffi, lib = nat.ffi, nat.lib
        self.n_vocab = int(n_vocab)
        self.n_blocks = -(-self.n_vocab // BLOCK)
        self._name = ffi.new("char[]", self.NAME)
        cb = ffi.callback
        self._callbacks = [
            cb("const char *(*)(const struct llama_sampler *)", self._cb_name),
            cb("void (*)(struct llama_sampler *, llama_token_data_array *)", self._cb_apply_host),
            cb("bool (*)(struct llama_sampler *, ggml_backend_buffer_type_t, uint32_t)", self._cb_init),
            cb("void (*)(struct llama_sampler *, struct ggml_context *, struct ggml_cgraph *, "
               "struct llama_sampler_data *)", self._cb_apply),
            cb("void (*)(struct llama_sampler *)", self._cb_set_input),
            cb("void (*)(struct llama_sampler *)", self._cb_reset),
        ]
        self._iface = ffi.new("struct llama_sampler_i *")
        (self._iface.name, self._iface.apply, self._iface.backend_init, self._iface.backend_apply,
         self._iface.backend_set_input, self._iface.backend_reset) = self._callbacks
        self.chains = []
        self._slot_of: dict[int, int] = {}  # address of our sampler -> slot
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        for slot in range(n_slots):
            self.chains.append(self._new_chain(slot, chain_params))
        self._chain_params = chain_params
        self._retired: list = []  # slot 0's chains swapped out (before_decode), freed one swap later
        self._built: Plan | None = None  # the plan of the graph llama.cpp holds (None: none with ops)
        self._plan: Plan | None = None  # the plan of the next decode (before_decode)
        self._configs = ffi.new("struct llama_sampler_seq_config[]", n_slots)
        for slot, chain in enumerate(self.chains):
            self._configs[slot].seq_id = slot
            self._configs[slot].sampler = chain
        self._table = mask_table()
        self._mask_buf: np.ndarray | None = None  # int32 per mask byte, [rows, V / 8], reused
        self.orders: dict[int, RowOrder] = {}
        self._graph: Any = None  # the graph context the shared ops were built in
        self._shared: dict[str, Any] | None = None
        self._rows: dict[int, int] = {}  # slot -> its output row in the micro-batch being built
        self._set = False
        self._layouts: dict[int, Layout] = {}  # slot -> the layout of its packed row, this decode
        self._graph_layouts: dict[int, Layout] = {}  # the same, of the last graph built (a reuse's)
        self._fresh = False  # a graph was built in this decode (else the last one was reused)
        self._ctx: Any = None
        self._keep = True  # this decode copies every pre-selected row whole (before_decode)
        self._row_slot: dict[int, int] = {}  # output row -> slot, of the rows read this decode
        self._logits_src: Any = None  # the graph's logits (an output: kept until the next decode)
        self.failures = 0  # callbacks that raised (their rows passed through whole)
        self.rebuilds = 0  # decodes whose orders asked for a new graph (before_decode)
        # per decode (reset by `order`): thread CPU ns in our callbacks, bytes uploaded to
        # the graph's inputs and bytes of packed rows it hands back
        self.cost = {"callback_ns": 0, "up_bytes": 0, "down_bytes": 0}

    def _new_chain(self, slot: int, chain_params: Any) -> Any:
        """A llama.cpp sampler chain holding one sampler of ours, for ``slot``."""
        lib, ffi = self.nat.lib, self.nat.ffi
        chain = lib.llama_sampler_chain_init(chain_params)
        smpl = lib.llama_sampler_init(self._iface, ffi.NULL)
        lib.llama_sampler_chain_add(chain, smpl)
        self._slot_of[int(ffi.cast("uintptr_t", smpl))] = slot
        return chain

    # ------------------------------------------------------------------ context

    def attach(self, params: Any) -> None:
        """Give llama_context_params the samplers (before llama_init_from_model)."""
        params.samplers = self._configs
        params.n_samplers = len(self.chains)
        # every row of a sequence may be an output (a score's): llama.cpp's default of one
        # output per sequence with a backend sampler would refuse those decodes
        params.n_outputs_max_per_seq = 0

    def close(self) -> None:
        """Free the chains (after the context that uses them)."""
        for chain in self.chains + self._retired:
            self.nat.lib.llama_sampler_free(chain)
        self.chains = []
        self._retired = []

    # ------------------------------------------------------------------ per decode

    def order(self, orders: dict[int, RowOrder]) -> None:
        """The rows to pre-select in the next decode, by slot (one output row each)."""
        self.orders = dict(orders)
        self._plan = None  # the plan its decode builds or reuses (before_decode)
        self._set = False  # a reused graph gets these orders' inputs (set_input)
        self.cost = {"callback_ns": 0, "up_bytes": 0, "down_bytes": 0}

    def before_decode(self, one_micro_batch: bool = False) -> None:
        """Right before llama_decode (core.Context.decode): when the orders ask for ops of
        another shape than the graph llama.cpp holds, make it build a new one (slot 0
        given a new sampler chain); equal plans may reuse it (their inputs are set
        again). Counted in ``rebuilds``. ``one_micro_batch``: the decode is certain to
        run as one micro-batch (one output token per sequence, within n_ubatch), so a
        whole row can be read from the graph's logits afterwards (`full_row`) and none
        is copied; otherwise every pre-selected row is copied whole beside its pack."""
        self._layouts = {}
        self._fresh = False
        self._keep = not one_micro_batch
        self._row_slot = {}
        plan = plan_of(self.orders, self.n_vocab, self._keep)
        if plan is not None:  # the graph held when it serves these orders, else a roomy new one
            plan = self._built if fits(plan, self._built) else roomy(plan, self.n_vocab)
        self._plan = plan
        if plan == self._built or self._ctx is None:
            return
        # a chain is initialised for a context once: slot 0 gets a new one, the old one is
        # freed at the next swap (llama.cpp compares the last graph's sampler pointers only)
        lib = self.nat.lib
        for chain in self._retired:
            self._slot_of.pop(int(self.nat.ffi.cast("uintptr_t", lib.llama_sampler_chain_get(chain, 0))), None)
            lib.llama_sampler_free(chain)
        nxt = self._new_chain(0, self._chain_params)
        self._retired = [self.chains[0]]
        self.chains[0] = nxt
        if not lib.llama_set_sampler(self._ctx, 0, nxt):
            raise RuntimeError("llama_set_sampler refused the pre-selection's sampler")
        self.rebuilds += 1
        # the graph built next is this plan's (_cb_reset/_cb_apply); until then none is held
        self._built = None

    def bind(self, ctx_ptr: Any) -> None:
        """The context it serves."""
        self._ctx = ctx_ptr

    def read(self, slot: int, row: int, n_outputs: int) -> Preselected | None:
        """Decode slot's packed row (output ``row`` of the last decode, which had
        ``n_outputs`` rows); None when the row came back whole (a callback failed: the
        host path takes it). One row of `read_many`."""
        return self.read_many([slot], [row], n_outputs)[0]

    def read_many(self, slots: list[int], rows: list[int], n_outputs: int) -> list[Preselected | None]:
        """`read` for several (slot, output row) pairs at once: the rows of one layout are
        gathered from llama.cpp's sampled-logits block and decoded as [m, size] matrices
        (a Python pass per row costs what the fast path saves). Each row gets only what
        its own order asked for, whatever the others of its micro-batch asked: its own k
        best (not the micro-batch's K, by value then id), the masses only if it wanted
        them, x's own best only under its own mask (deterministic mode: what a row hands
        the chain must not depend on what else is in its batch)."""
        out: list[Preselected | None] = [None] * len(slots)
        lib, ffi = self.nat.lib, self.nat.ffi
        if not self._fresh:  # llama.cpp reused the last graph: its rows are laid out as then
            self._layouts = dict(self._graph_layouts)
            self._fresh = True
        groups: dict[int, tuple[Layout, list[int]]] = {}  # by the layout's identity (one per plan)
        # (names bound once: a row's attribute lookups cost as much as its call here)
        count, ctx, layout_of, row_slot = lib.llama_get_sampled_logits_count_ith, self._ctx, self._layouts.get, self._row_slot
        for a, (slot, row) in enumerate(zip(slots, rows)):
            lay = layout_of(slot)
            # llama.cpp's negative index: the row itself, not a batch position
            if lay is not None and count(ctx, row - n_outputs) == lay.size:
                groups.setdefault(id(lay), (lay, []))[1].append(a)
                row_slot[row] = slot
        if not groups:
            return out
        ptr = lib.llama_get_sampled_logits_ith(ctx, -n_outputs)  # row 0: rows lie n_vocab apart
        block = np.frombuffer(ffi.buffer(ptr, n_outputs * self.n_vocab * 4), np.float32)
        block = block.reshape(n_outputs, self.n_vocab)
        for lay, idx in groups.values():
            r = [rows[a] for a in idx]
            # consecutive rows: a view, no copy (checked in Python: numpy's np.diff and
            # .all() are Python-level wrappers, ~150 us on the caches a decode leaves)
            if r == list(range(r[0], r[0] + len(r))):
                packed = block[r[0]:r[-1] + 1, :lay.size]
            else:
                packed = block[np.array(r, np.intp), :lay.size]
            orders = [self.orders[slots[a]] for a in idx]
            for a, pre in zip(idx, unpack(packed, lay, orders)):
                out[a] = pre
        return out

    def full_row(self, row: int, n_outputs: int, pre: Any = None) -> np.ndarray | None:
        """The whole raw row of a pre-selected output row (valid until the next decode),
        or None where it is not to be had. A decode of several micro-batches copied it
        beside the pack (llama.cpp's sampled-probs block); a decode of one is read on
        demand from the graph's logits (llama.cpp keeps them, an output of the graph,
        until the next decode: one row crosses, not every row), and checked against the
        row's own pack (its K best and touched values; `pre`, the row's read pack where the
        caller has it, else it is read again) before it is handed out."""
        lib, ffi = self.nat.lib, self.nat.ffi
        i = row - n_outputs
        if lib.llama_get_sampled_probs_count_ith(self._ctx, i) == self.n_vocab:
            ptr = lib.llama_get_sampled_probs_ith(self._ctx, i)
            return np.frombuffer(ffi.buffer(ptr, self.n_vocab * 4), np.float32)
        slot = self._row_slot.get(row)
        src, at = self._logits_src, self._rows.get(slot)
        if (self._keep or slot is None or src is None or at is None or src.buffer == ffi.NULL
                or not int(src.flags) & int(lib.GGML_TENSOR_FLAG_OUTPUT) or src.ne[0] != self.n_vocab):
            return None
        out = np.empty(self.n_vocab, np.float32)
        lib.ggml_backend_tensor_get(src, ffi.from_buffer(out), at * int(src.nb[1]), out.nbytes)
        if not self._same_as_pack(out, pre if pre is not None else self.read(slot, row, n_outputs)):
            return None
        return out

    @staticmethod
    def _same_as_pack(x: np.ndarray, pre: Any) -> bool:
        """The row read on demand holds the values the pack was made from (a guard: a
        row of another micro-batch's graph would not)."""
        if pre is None:
            return False
        o = pre.order
        vals = x[pre.ids]
        if o.mask is not None:  # disallowed ids come back -inf: compare the allowed ones
            bits = o.mask[pre.ids >> 3] >> (pre.ids & 7) & 1
            vals = np.where(bits == 1, vals, np.float32(-np.inf))
        ok = np.array_equal(vals, pre.vals, equal_nan=True)
        if o.touched.size:
            ok = ok and np.array_equal(x[o.touched], pre.touched, equal_nan=True)
        return bool(ok)

    # ------------------------------------------------------------------ callbacks

    def _cb_name(self, smpl: Any) -> Any:
        return self._name

    def _cb_apply_host(self, smpl: Any, cur_p: Any) -> None:
        """The CPU-side apply llama.cpp requires of every sampler: ours is never asked to
        sample on the host (the engine samples), so it leaves the candidates alone."""

    def _cb_init(self, smpl: Any, buft: Any, n_outputs_max_per_seq: int) -> bool:
        return True

    def _cb_reset(self, smpl: Any) -> None:
        # called for every sampler before a sampling graph is built (a reused one keeps
        # its shared ops, rows and layouts: the plan and the micro-batch are the same)
        self._shared = None
        self._graph = None
        self._rows = {}
        self._graph_layouts = {}
        self._set = False
        self._built = None

    def _cb_apply(self, smpl: Any, ctx: Any, gf: Any, data: Any) -> None:
        t0 = time.thread_time_ns()
        try:
            slot = self._slot_of[int(self.nat.ffi.cast("uintptr_t", smpl))]
            view = data.logits
            src = view.view_src
            if src == self.nat.ffi.NULL:
                # llama.cpp probing how many graph nodes the sampler adds (it sizes the
                # graph by that, at creation and at each llama_set_sampler): a share of the
                # shared ops, counted as tensors of its context, whether or not the slot has
                # an order now (at creation none has: a budget of the probe's own tensor per
                # slot overflowed the graph's context at 64 ordered rows)
                for _ in range(PROBE_NODES):
                    self.nat.lib.ggml_new_tensor_1d(ctx, self.nat.lib.GGML_TYPE_F32, 1)
                return
            o = self.orders.get(slot)
            if o is None:
                return  # the row passes through whole
            row = int(view.view_offs) // int(src.nb[1])
            if self._graph != ctx or self._shared is None:
                self._graph = ctx
                self._logits_src = _graph_logits(self.nat.lib, src)
                self._shared = self._build(ctx, src)
                self._built = self._shared["plan"]
            sh = self._shared
            j = sh["index"][slot]
            self._rows[slot] = row
            pack = sh["pack"]
            data.logits = self.nat.lib.ggml_view_1d(ctx, pack, sh["layout"].size, j * int(pack.nb[1]))
            self._layouts[slot] = self._graph_layouts[slot] = sh["layout"]
            self._fresh = True
            if self._keep:
                data.probs = view  # the whole row, copied beside the pack (before_decode)
        except Exception:  # noqa: BLE001 - a C caller: the row passes through, the host path takes it
            self.failures += 1
            traceback.print_exc(file=sys.stderr)
        finally:
            self.cost["callback_ns"] += time.thread_time_ns() - t0

    def _cb_set_input(self, smpl: Any) -> None:
        if self._set or self._shared is None:
            return
        t0 = time.thread_time_ns()
        try:
            self._set = True
            self._fill(self._shared)
        except Exception:  # noqa: BLE001
            self.failures += 1
            traceback.print_exc(file=sys.stderr)
        finally:
            self.cost["callback_ns"] += time.thread_time_ns() - t0

    # ------------------------------------------------------------------ the ops

    def _build(self, ctx: Any, logits_t: Any) -> dict[str, Any]:
        """The shared ops over every ordered slot's row (see the module doc)."""
        lib = self.nat.lib
        V, nb = self.n_vocab, self.n_blocks
        plan = self._plan if self._plan is not None else plan_of(self.orders, V, self._keep)
        slots, layout = list(plan.slots), plan.layout
        n = len(slots)
        k, n_touched, dense, raw, mass = layout.k, layout.n_touched, layout.dense, layout.raw, layout.mass
        masked = any(self.orders[s].mask is not None for s in slots)
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
        arg = lib.ggml_reshape_2d(ctx, lib.ggml_argmax(ctx, y), 1, n)              # [1, n] i32
        top = lib.ggml_reshape_2d(ctx, lib.ggml_get_rows(ctx, y3, arg), 1, n)      # [1, n]
        if k == 1:  # greedy rows only: the canonical first is argmax's, no top-k pass
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
                e = lib.ggml_soft_max_ext(ctx, y, self.nat.ffi.NULL, float(plan.scale), 0.0)
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

    def _fill(self, sh: dict[str, Any]) -> None:
        """Upload the inputs of the shared ops (once per micro-batch)."""
        lib, ffi = self.nat.lib, self.nat.ffi
        slots, lay = sh["slots"], sh["layout"]
        orders = [self.orders[s] for s in slots]  # this decode's (a reused graph: the same plan)
        n = len(slots)

        def put(t, arr):
            arr = np.ascontiguousarray(arr)
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, arr.nbytes)
            self.cost["up_bytes"] += arr.nbytes

        # a slot this micro-batch does not sample reads row 0 (its results are not used)
        put(sh["rows"], np.array([self._rows.get(s, 0) for s in slots], np.int32))
        self.cost["down_bytes"] += 4 * lay.size * sum(s in self._rows for s in slots)  # its packed rows
        if sh["inv_tau"] is not None:
            put(sh["inv_tau"], np.array([o.inv_tau for o in orders], np.float32))
        if sh["table"] is not None:
            put(sh["table"], self._table)
            nbytes = -(-self.n_vocab // 8)
            # one buffer kept across ticks: a fresh 128 KiB per row would be new pages each time
            if self._mask_buf is None or self._mask_buf.shape[0] < n:
                self._mask_buf = np.empty((n, nbytes), np.int32)
            b = self._mask_buf[:n]
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


def reference(row: np.ndarray, o: RowOrder, k: int | None = None) -> Preselected:
    """What the graph's ops hand back for one row, computed with numpy: the exact
    reference of `Presampler._build` (tests/test_presample.py holds the graph to it, and
    the fast path's property tests run on it without a model). ``k``: default the
    order's own, which is what `Presampler.read` hands back; the micro-batch's K (the
    largest order's) gives what the graph's ops computed, before `read` keeps the row's
    own. Ties at the K-th value are broken by the smaller id here; the graph may pick
    any of the tied ids."""
    x = np.asarray(row, np.float32)
    V = x.size
    k = min(V, k or o.k)
    y = x
    if o.mask is not None:
        bits = np.unpackbits(np.asarray(o.mask, np.uint8), bitorder="little")[:V]
        y = np.where(bits == 1, x, np.float32(-np.inf)).astype(np.float32)
    top = np.float32(y[int(np.argmax(y))])
    ids = (np.array([np.argmax(y)]) if k == 1 else np.argsort(-y, kind="stable")[:k]).astype(np.int32)
    e, z = _softmax(y * np.float32(o.inv_tau))
    e = e * z  # over the top's probability, as `read` does
    nb = -(-V // BLOCK)
    ep = np.zeros(nb * BLOCK, np.float64)
    ep[:V] = e
    blocks = ep.reshape(nb, BLOCK).sum(axis=1)
    if not (o.mass or o.u is not None):
        blocks = None
    dense = None
    if o.u is not None:
        cum = np.cumsum(blocks.astype(np.float32), dtype=np.float32)
        b = int((cum < np.float32(cum[-1] * np.float32(o.u))).sum())
        dense = {}
        for d in range(-1, DENSE_BLOCKS - 1):
            bb = min(max(b + d, 0), nb - 1)
            dense[bb] = ep[bb * BLOCK:(bb + 1) * BLOCK].copy()
    raw_max = raw_mass = raw_ids = raw_vals = None
    if o.raw:
        raw_max = float(x.max())
        raw_mass = _softmax(x)[1]
        if o.mask is not None:
            raw_ids = np.argsort(-x, kind="stable")[:k].astype(np.int32)
            raw_vals = x[raw_ids]
    return Preselected(order=o, ids=ids, vals=y[ids], top=float(top), blocks=blocks, dense=dense,
                       raw_max=raw_max, raw_mass=raw_mass, raw_ids=raw_ids, raw_vals=raw_vals,
                       touched=x[o.touched] if o.touched.size else np.empty(0, np.float32))


def _softmax(v: np.ndarray) -> tuple[np.ndarray, float]:
    """ggml's soft_max of a row, and the sum it divided by relative to the max (1 / the
    top's probability): float32 exp(v - max), summed in float64, scaled by 1/sum."""
    m = np.float32(v.max())
    e = np.exp(v - m).astype(np.float32)
    total = float(e.sum(dtype=np.float64))
    p = (e * np.float32(1.0 / total)).astype(np.float32)
    return p, 1.0 / float(p[int(np.argmax(v))])
