"""The decode graph's pre-selection (llama/presample/) against its numpy reference.

Real prompts are decoded on the default model with a `Presampler` on a small context,
several sequences in one decode: some rows ordered (each kind of order: plain top-K, a
temperature with touched tokens, a dense draw, raw masses, a grammar mask with many and
with few allowed tokens), some passing through whole. The same batch is decoded by a
context without a presampler: its rows are the rows the graph saw (x). Each ordered
row's pre-selection (`Presampler.read`) must be `presample.reference(x, order)`, at the
row's own K whatever the others asked for:

- ids: the same set, except ids tied with the K-th value (any of them may be picked);
  vals bit for bit y[ids] (y: x with the grammar's -inf); top bit for bit y's max;
- touched: bit for bit x[touched]; raw_max bit for bit x's max; raw_ids/raw_vals as ids;
- blocks, dense masses, raw_mass: ggml's exp and sum against numpy's, within
  `REL_BOUND` relative (measured below it; the numbers are printed with -s);
- dense: the same block ids; a grammar: disallowed ids never among the ids (when at
  least K are allowed), and blocks the reference's with the mask.

The pass-through rows and the kept whole rows (`full_row`) must equal the plain decode's
bit for bit, and a row's pre-selection is bit for bit the same whatever else is ordered
beside it (other K, masks, draws; or ordered alone): deterministic mode's claim needs it.
Three layouts: one micro-batch; micro-batches of 16 (nBatch > nUbatch, the rows of a
decode in different graphs); one KV stream per sequence (deterministic mode's layout, its
own micro-batch split). And a sequence with every row an output (a score window) beside
ordered rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from clickpaca.llama import core
from clickpaca.llama.presample import BLOCK, K_ROOM, TOUCHED_ROOM, Presampler, RowOrder, fits, plan_of, reference, roomy
from clickpaca.llama.presample.unpack import _own_best_rows

pytestmark = pytest.mark.model

#: ggml's exp/sum_rows vs numpy's, relative (blocks, dense masses, raw mass); measured
#: max over these tests: see MEASURED (printed at the end of the module with -s)
REL_BOUND = 1e-6
#: masses below this are compared absolutely (float32 subnormals: ggml's vector exp and
#: numpy's may flush or keep them)
TINY = 1e-37

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are", "Water boils at", "A haiku about the sea:",
           "Shall I compare thee to a summer's day?"]

MEASURED: dict[str, float] = {}


def _note(name: str, value: float) -> None:
    MEASURED[name] = max(MEASURED.get(name, 0.0), float(value))


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    print("\npresample vs reference, max relative differences:",
          {k: f"{v:.3g}" for k, v in sorted(MEASURED.items())})


def _mask(n_vocab: int, allowed: np.ndarray) -> np.ndarray:
    bits = np.zeros(-(-n_vocab // 8) * 8, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little")


def _orders(n_vocab: int) -> dict[int, RowOrder]:
    """Slot -> its order; slot 6 is not ordered (its row passes through)."""
    rng = np.random.default_rng(39)
    half = np.flatnonzero(rng.random(n_vocab) < 0.5)
    few = np.sort(rng.choice(n_vocab, 10, replace=False))
    return {
        0: RowOrder(k=64),
        2: RowOrder(k=1, mass=False),  # greedy: argmax's id alone
        1: RowOrder(k=40, inv_tau=1 / 0.7, touched=np.array([5, 17, 2000], np.int32), u=0.3, raw=True),
        3: RowOrder(k=100, inv_tau=10.0, touched=np.array([0, n_vocab - 1], np.int32), u=0.999),
        4: RowOrder(k=64, inv_tau=1 / 1.3, touched=np.array([7, 123456], np.int32), u=0.5, raw=True,
                    mask=_mask(n_vocab, half)),
        5: RowOrder(k=64, mask=_mask(n_vocab, few), raw=True, u=0.0001),
    }


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    big = np.abs(b) >= TINY
    assert (np.abs(a[~big] - b[~big]) <= TINY).all(), "tiny masses differ beyond the subnormal range"
    if not big.any():
        return 0.0
    return float(np.max(np.abs(a[big] - b[big]) / np.abs(b[big])))


def _same_top_k(ids: np.ndarray, ref_ids: np.ndarray, y: np.ndarray) -> None:
    """The same K ids, except among those tied with the K-th value."""
    assert ids.size == ref_ids.size == np.unique(ids).size
    kth = y[ref_ids].min()
    assert (y[ids] >= kth).all(), "an id below the K-th value"
    above, ref_above = ids[y[ids] > kth], ref_ids[y[ref_ids] > kth]
    assert set(above.tolist()) == set(ref_above.tolist())


def _same_pack(a, b) -> None:
    """Bit for bit the same pre-selection (ids in the same order)."""
    for f in ("ids", "vals", "blocks", "raw_ids", "raw_vals", "touched"):
        u, v = getattr(a, f), getattr(b, f)
        assert (u is None) == (v is None) and (u is None or np.array_equal(u, v)), f
    assert (a.top, a.raw_max, a.raw_mass) == (b.top, b.raw_max, b.raw_mass)
    assert (a.dense is None) == (b.dense is None)
    if a.dense is not None:
        assert set(a.dense) == set(b.dense)
        assert all(np.array_equal(a.dense[i], b.dense[i]) for i in a.dense)


def _check(pre, x: np.ndarray, o: RowOrder) -> None:
    ref = reference(x, o)
    k = o.k
    V = x.size
    allowed = np.ones(V, bool)
    if o.mask is not None:
        allowed = np.unpackbits(o.mask, bitorder="little")[:V].astype(bool)
    y = np.where(allowed, x, np.float32(-np.inf)).astype(np.float32)
    # ids and vals
    if k == 1:  # the canonical first: the largest value, the smallest id among equal ones
        assert pre.first and pre.ids[0] == int(np.argmax(y)) == ref.ids[0]
    _same_top_k(pre.ids, ref.ids, y)
    assert np.array_equal(pre.vals, y[pre.ids]), "vals are not the row's values at ids"
    assert np.array_equal(np.sort(pre.vals), np.sort(ref.vals))
    n_allowed = int(allowed.sum())
    if n_allowed >= k:
        assert allowed[pre.ids].all(), "a disallowed id among the ids"
    else:  # every allowed id is there; the rest are disallowed, at -inf
        assert set(np.flatnonzero(allowed).tolist()) <= set(pre.ids.tolist())
        assert (pre.vals[~allowed[pre.ids]] == -np.inf).all()
    assert pre.top == ref.top == float(y.max())
    # masses: only for a row that wants them (whatever the others of its decode wanted)
    assert (pre.blocks is None) == (ref.blocks is None) == (not o.mass and o.u is None)
    if pre.blocks is None:
        assert pre.dense is None and pre.raw_max is None
        assert np.array_equal(pre.touched, x[o.touched])
        return
    assert pre.blocks.shape == ref.blocks.shape == (-(-V // BLOCK),)
    _note("blocks", _rel(pre.blocks, ref.blocks))
    assert _rel(pre.blocks, ref.blocks) <= REL_BOUND
    if o.mask is not None:  # a block holding no allowed token has no mass
        per_block = np.zeros(-(-V // BLOCK) * BLOCK, bool)
        per_block[:V] = allowed
        assert (pre.blocks[~per_block.reshape(-1, BLOCK).any(1)] == 0).all()
    if o.u is None:
        assert pre.dense is None
    else:
        assert set(pre.dense) == set(ref.dense), (sorted(pre.dense), sorted(ref.dense))
        for b, masses in pre.dense.items():
            assert masses.shape == (BLOCK,)
            _note("dense masses", _rel(masses, ref.dense[b]))
            assert _rel(masses, ref.dense[b]) <= REL_BOUND
            if o.mask is not None:
                lo, hi = b * BLOCK, min((b + 1) * BLOCK, V)
                assert (masses[:hi - lo][~allowed[lo:hi]] == 0).all()
    # raw
    if o.raw:
        assert pre.raw_max == ref.raw_max == float(x.max())
        _note("raw mass", _rel(pre.raw_mass, ref.raw_mass))
        assert _rel(pre.raw_mass, ref.raw_mass) <= REL_BOUND
        # x's own K best: only under a mask (else y is x, and ids/vals serve)
        assert (pre.raw_ids is not None) == (pre.raw_vals is not None) == (o.mask is not None)
        if o.mask is not None:
            _same_top_k(pre.raw_ids, ref.raw_ids, x)
            assert np.array_equal(pre.raw_vals, x[pre.raw_ids])
    else:
        assert pre.raw_max is None and pre.raw_mass is None
    # touched
    assert np.array_equal(pre.touched, x[o.touched])
    assert np.array_equal(pre.touched, ref.touched)


def _owned(pre):
    """The pre-selection with its arrays copied out of llama.cpp's buffers (a failing
    assertion's values are shown after the context is closed)."""
    if pre is None:
        return None
    cp = lambda a: None if a is None else np.array(a)  # noqa: E731
    return dataclasses.replace(pre, ids=cp(pre.ids), vals=cp(pre.vals), blocks=cp(pre.blocks),
                               dense=None if pre.dense is None else {b: cp(m) for b, m in pre.dense.items()},
                               raw_ids=cp(pre.raw_ids), raw_vals=cp(pre.raw_vals), touched=cp(pre.touched))


def _plain_rows(model, kw: dict, batch) -> np.ndarray:
    """The batch's logits rows from a context without a presampler (the reference rows)."""
    plain = core.Context(model, **kw)
    try:
        assert plain.decode(batch) == 0
        return plain.logits().copy()
    finally:
        plain.close()


LAYOUTS = {
    "one micro-batch": dict(n_batch=256),
    "micro-batches of 16": dict(n_batch=128, n_ubatch=16),
    "per-sequence KV": dict(n_batch=128, kv_unified=False, flash_attn="off"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packs_equal_the_reference_on_every_row(model, layout):
    kw = dict(n_ctx=1024, n_seq_max=len(PROMPTS), n_threads=2, **LAYOUTS[layout])
    nat = model.nat
    toks = [model.tokenize(p) for p in PROMPTS]
    n_tok = sum(len(t) for t in toks)

    def batch():
        b = core.Batch(nat, n_tok)
        for s, t in enumerate(toks):
            b.add(t, 0, s, output_last=True)
        return b

    x_rows = _plain_rows(model, kw, batch())
    assert x_rows.shape == (len(PROMPTS), model.n_vocab)

    ps = Presampler(nat, model.n_vocab, len(PROMPTS))
    ctx = core.Context(model, presampler=ps, **kw)
    try:
        if "n_ubatch" in kw:  # the rows come from different micro-batch graphs
            assert n_tok > 2 * kw["n_ubatch"]
        first = _orders(model.n_vocab)
        # then other orders (nothing of a decode is kept for the next), and rows alone: a
        # row's pre-selection is the same whatever else is ordered beside it (K, masks,
        # draws, temperatures: alone, its one temperature goes into softmax's own scale;
        # greedy rows alone: argmax instead of a top-k)
        rounds = [first, {**{s: first[s] for s in (0, 1, 4)}, 6: RowOrder(k=8)}, {1: first[1]},
                  {2: first[2], 5: RowOrder(k=1, mass=False)}, {3: first[3]}]
        seen, compared = {}, []
        for orders in rounds:
            ctx.clear()
            ps.order(orders)
            assert ctx.decode(batch()) == 0
            n_out = ctx.n_outputs
            assert n_out == len(PROMPTS)
            assert ps.failures == 0
            L = ctx.logits()
            together = ps.read_many(list(range(n_out)), list(range(n_out)), n_out)  # the engine's read
            for row in range(n_out):  # output rows in batch order: row s is sequence s
                x = x_rows[row]
                if row not in orders:
                    assert np.array_equal(L[row], x), f"pass-through row {row} differs from a plain decode"
                    assert ps.read(row, row, n_out) is None and together[row] is None
                    continue
                full = ps.full_row(row, n_out)
                assert full is not None and np.array_equal(full, x), f"row {row}'s whole row differs"
                pre = _owned(ps.read(row, row, n_out))
                assert pre is not None, f"row {row} came back whole"
                _same_pack(_owned(together[row]), pre)  # read beside every other row, or alone
                assert pre.ids.size == orders[row].k  # its own K, not the decode's largest
                _check(pre, x, orders[row])
                key = (row, id(orders[row]))
                if key in seen:
                    _same_pack(pre, seen[key])
                    compared.append(row)
                seen[key] = pre
        assert sorted(compared) == [0, 1, 1, 2, 3, 4]
    finally:
        ctx.close()


@pytest.mark.parametrize("layout", ["one micro-batch", "per-sequence KV"])
def test_a_sequence_with_every_row_an_output_beside_ordered_rows(model, layout):
    """A score window or a capture asks for every row of its sequence (llama.cpp's
    backend sampling takes one output per sequence unless told more): the decode runs,
    those rows come back whole, bit for bit a plain decode's, and the ordered rows beside
    them are their reference."""
    kw = dict(n_ctx=1024, n_seq_max=3, n_threads=2, **LAYOUTS[layout])
    nat = model.nat
    toks = [model.tokenize(p) for p in PROMPTS[:3]]

    def batch():
        b = core.Batch(nat, sum(len(t) for t in toks))
        b.add(toks[0], 0, 0, output_last=True)
        b.add(toks[1], 0, 1, output_all=True)  # row 1 .. len(toks[1])
        b.add(toks[2], 0, 2, output_last=True)
        return b

    x_rows = _plain_rows(model, kw, batch())
    n_out = 2 + len(toks[1])
    assert x_rows.shape == (n_out, model.n_vocab)
    ps = Presampler(nat, model.n_vocab, 3)
    ctx = core.Context(model, presampler=ps, **kw)
    try:
        orders = {0: RowOrder(k=64, u=0.4, raw=True), 2: RowOrder(k=32, inv_tau=2.0)}
        ps.order(orders)
        assert ctx.decode(batch()) == 0
        assert ctx.n_outputs == n_out and ps.failures == 0
        L = ctx.logits()
        for row in range(1, n_out - 1):
            assert np.array_equal(L[row], x_rows[row]), row
        for slot, row in ((0, 0), (2, n_out - 1)):
            pre = _owned(ps.read(slot, row, n_out))
            assert pre is not None
            _check(pre, x_rows[row], orders[slot])
    finally:
        ctx.close()


def test_a_graph_is_reused_while_the_orders_keep_their_shape(model):
    """One token per sequence per tick, the same batch shape every tick: while the orders
    keep their plan (slots, K, pieces, one temperature) llama.cpp reuses the graph and only
    the inputs change (masks, uniforms, touched ids, rows); a plan of another shape makes a
    new graph (Presampler.rebuilds). Every tick's packs equal the reference on that tick's
    own whole rows, reused graph or not."""
    n = len(PROMPTS)
    V = model.n_vocab
    nat = model.nat
    ps = Presampler(nat, V, n)
    ctx = core.Context(model, n_ctx=1024, n_batch=256, n_seq_max=n, n_threads=2, presampler=ps)
    rng = np.random.default_rng(3)

    def orders(tau: float, k: int, nt: int) -> dict[int, RowOrder]:
        # fresh values of the same shape: a mask, a draw, nt touched ids
        return {0: RowOrder(k=k, inv_tau=tau, u=float(rng.random()),
                            touched=np.sort(rng.choice(V, nt, replace=False)).astype(np.int32),
                            mask=_mask(V, np.flatnonzero(rng.random(V) < 0.3))),
                3: RowOrder(k=k, inv_tau=tau, touched=np.sort(rng.choice(V, 2, replace=False)).astype(np.int32),
                            u=float(rng.random()))}

    try:
        b = core.Batch(nat, 256)
        toks = [model.tokenize(p) for p in PROMPTS]
        for sq, t in enumerate(toks):
            b.add(t, 0, sq, output_last=True)
        ps.order({})
        assert ctx.decode(b) == 0
        pos = [len(t) for t in toks]
        plans = ([(1.0, 64, 2)] * 3 + [(1 / 0.7, 64, 2)] * 2 + [(1 / 0.7, 128, 2)] * 2 + [(1 / 0.7, 128, 2)]
                 + [(1 / 0.7, 100, 9), (1 / 0.7, 97, 16), (1 / 0.7, 40, 3), (1 / 0.7, 50, 17)])
        reused, rebuilds, down = [], [], []
        for tick, (tau, k, nt) in enumerate(plans):
            o = orders(tau, k, nt)
            ps.order(o)
            b.clear()
            for sq in range(n):
                b.add([1000 + tick], pos[sq], sq, output_last=True)
                pos[sq] += 1
            before = nat.lib.llama_perf_context(ctx.ptr).n_reused
            r0 = ps.rebuilds
            assert ctx.decode(b) == 0
            reused.append(nat.lib.llama_perf_context(ctx.ptr).n_reused - before)
            rebuilds.append(ps.rebuilds - r0)
            down.append(ps.cost["down_bytes"])
            for slot in o:
                pre = _owned(ps.read(slot, slot, n))
                assert pre is not None, (tick, slot)
                # one token per sequence: no row was copied whole; full_row reads it from the graph
                assert nat.lib.llama_get_sampled_probs_count_ith(ctx.ptr, slot - n) != V
                _check(pre, np.array(ps.full_row(slot, n)), o[slot])
            for row in set(range(n)) - set(o):  # the others pass through whole
                assert ps.read(row, row, n) is None
        # a new plan at ticks 0 (the prefill's graph had no ops), 3 (another temperature),
        # 5 (a larger K), 10 (a K under half the graph's) and 11 (more touched ids than
        # the graph's 16); the ticks between reuse the graph, also where K or the touched
        # ids shrink or grow within it (8, 9)
        assert rebuilds == [1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1], rebuilds
        assert reused == [0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0], reused
        # the packed rows cross on a reused graph as on a new one (Presampler.cost)
        assert down[0] > 0 and down[:5] == [down[0]] * 5 and down[5:10] == [down[5]] * 5 > [down[0]] * 5, down
    finally:
        ctx.close()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_each_row_keeps_its_k_best_by_value_then_id(data):
    """read's sort of a [m, K] block (one int64 key per value) orders each row as numpy's
    lexsort by descending value, then id, orders it alone: NaN last, -0.0 tied with 0.0,
    infinities, subnormals; rows that come sorted but for their first two (ggml's CPU
    top_k) or sorted take the no-sort branch and give the same."""
    m = data.draw(st.integers(1, 4))
    K = data.draw(st.integers(1, 40))
    pool = [0.0, -0.0, 1.5, -1.5, 3.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38]
    vals = np.array(data.draw(st.lists(st.lists(st.sampled_from(pool) | st.floats(width=32), min_size=K,
                                                max_size=K), min_size=m, max_size=m)), np.float32)
    ids = np.stack([np.random.default_rng(j).permutation(1 << 20)[:K] for j in range(m)]).astype(np.float32)
    arrange = data.draw(st.sampled_from(["as drawn", "canonical", "as ggml's CPU top_k"]))
    if arrange != "as drawn":  # rows already sorted (no sort needed), or with their first two swapped
        o = np.stack([np.lexsort((ids[j].astype(np.int32), -vals[j])) for j in range(m)])
        if arrange == "as ggml's CPU top_k" and K > 1:
            o[:, [0, 1]] = o[:, [1, 0]]
        ids, vals = np.take_along_axis(ids, o, 1), np.take_along_axis(vals, o, 1)
    got_ids, got_vals, clean = _own_best_rows(np.concatenate([vals, ids], axis=1), K)  # as the graph packs them
    # clean: every row came strictly descending (no tie, no NaN), so its first value is its max
    strict = K > 1 and all(all(a > b for a, b in zip(r[:-1], r[1:])) for r in got_vals.tolist())
    assert not clean or strict
    if arrange == "as ggml's CPU top_k":  # as the graph hands them: the no-sort branch says clean
        assert clean == strict
    for j in range(m):
        o = np.lexsort((ids[j].astype(np.int32), -vals[j]))
        assert np.array_equal(got_ids[j], ids[j][o].astype(np.int32))
        assert np.array_equal(got_vals[j], vals[j][o], equal_nan=True)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_the_reference_hands_its_k_best_back_in_canonical_order(data):
    """reference(), which the fast path's tests run on in place of the graph, orders its
    K best as read does (the fast path takes a row's k best as its first k columns):
    value descending, then id, ties and infinities included."""
    V = data.draw(st.integers(2, 300))
    pool = st.sampled_from([0.0, -0.0, 1.5, -1.5, 3.0, -np.inf]) | st.floats(-8, 8, width=32)
    row = np.array(data.draw(st.lists(pool, min_size=V, max_size=V)), np.float32)
    assume(np.isfinite(row).any())
    k = data.draw(st.integers(2, V))
    pre = reference(row, RowOrder(k=k, mass=False))
    o = np.lexsort((np.arange(V), -row))[:k]
    assert np.array_equal(pre.ids, o.astype(np.int32))
    assert np.array_equal(pre.vals, row[o])


@settings(max_examples=300, deadline=None)
@given(ks=st.lists(st.integers(1, 1500), min_size=1, max_size=5), nts=st.lists(st.integers(0, 90), min_size=5,
       max_size=5), later=st.tuples(st.integers(1, 1500), st.integers(0, 90)), n_vocab=st.sampled_from([300, 262_144]))
def test_a_roomy_graph_serves_its_orders_and_those_that_fit(ks, nts, later, n_vocab):
    """roomy (what a new graph is built for) keeps argmax's K = 1, rounds a larger K up to
    K_ROOM (at most the vocabulary) and the touched ids up to TOUCHED_ROOM, and its graph
    serves the plan it was made from; a later plan is served exactly when its pieces are
    the same and its K and touched ids fit within the graph's and are not under half (or
    under what roomy makes of them)."""
    orders = {s: RowOrder(k=min(k, n_vocab), touched=np.arange(nt, dtype=np.int32)) for s, (k, nt) in
              enumerate(zip(ks, nts))}
    plan = plan_of(orders, n_vocab)
    built = roomy(plan, n_vocab)
    a, b = plan.layout, built.layout
    assert fits(plan, built) and roomy(built, n_vocab) == built
    assert b.k == 1 if a.k == 1 else (b.k == n_vocab or b.k % K_ROOM == 0) and a.k <= b.k < a.k + K_ROOM
    assert b.n_touched % TOUCHED_ROOM == 0 and a.n_touched <= b.n_touched < a.n_touched + TOUCHED_ROOM
    k2, nt2 = min(later[0], n_vocab), later[1]
    nxt = plan_of({s: RowOrder(k=k2 if s == 0 else 1, touched=np.arange(nt2 if s == 0 else 0, dtype=np.int32))
                   for s in orders}, n_vocab)
    c = nxt.layout
    k_ok = c.k == b.k or 1 < c.k <= b.k <= max(2 * c.k, -(-c.k // K_ROOM) * K_ROOM)
    t_ok = c.n_touched <= b.n_touched <= max(2 * c.n_touched, -(-c.n_touched // TOUCHED_ROOM) * TOUCHED_ROOM)
    assert fits(nxt, built) == (k_ok and t_ok)
    assert not fits(dataclasses.replace(nxt, slots=nxt.slots + (99,)), built)
