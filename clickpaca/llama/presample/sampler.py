"""`Presampler`: the backend sampler llama.cpp calls, one per slot. It attaches the
samplers to a context (their hooks are cffi callbacks), takes the rows to pre-select
before each decode, makes llama.cpp build a new graph when the orders no longer fit the
one it holds, and reads the packed rows (or a whole row) back after it.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import numpy as np

from .graph import build, fill, graph_logits, mask_table
from .reuse import Plan, fits, plan_of, roomy
from .rows import BLOCK, Layout, Preselected, RowOrder
from .unpack import unpack


#: graph nodes each sampler reports when llama.cpp probes it (its view, its share of the
#: ~60 shared ops at one row, with room): llama.cpp adds them to the graph's node budget
PROBE_NODES = 64


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
                self._logits_src = graph_logits(self.nat.lib, src)
                plan = self._plan if self._plan is not None else plan_of(self.orders, self.n_vocab, self._keep)
                self._shared = build(self.nat, ctx, src, plan, self.orders, self.n_vocab)
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
            self._mask_buf = fill(self.nat, self._shared, self.orders, self._rows, self._table, self._mask_buf,
                                  self.cost, self.n_vocab)
        except Exception:  # noqa: BLE001
            self.failures += 1
            traceback.print_exc(file=sys.stderr)
        finally:
            self.cost["callback_ns"] += time.thread_time_ns() - t0
