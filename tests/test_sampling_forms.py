"""clickpaca.sampling.forms and the rows' batched forms (registry.Batched).

The batched passes trust the forms: they compute a step from its declared form and never
look at its name. So each row's form is held here against the row's own `run` on random
candidate sets and params (a TOUCH form bit for bit, over several rows side by side), and
`forms.shape` against the chain: the shape's arithmetic, done by hand from the declared
forms, keeps the same candidates with the same values as `apply_chain`.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.sampling import SamplerParams, forms
from clickpaca.sampling import registry as R
from clickpaca.sampling.chain import apply_chain
from clickpaca.sampling.registry import DIVIDE, KEEP_K, KEEP_MASS, TOUCH, StepContext
from clickpaca.sampling.steps import canonical_order

from test_sampling_table import V, candidates, history, params_st

STEPS = R.steps()
FORMED = [s for s in STEPS if s.batched is not None]


def test_the_forms_declared():
    """Which rows have a batched form (a new one needs its check below)."""
    assert {s.name: R.form(s) for s in FORMED} == {
        "logit_bias": TOUCH, "penalties": TOUCH, "top_k": KEEP_K, "top_p": KEEP_MASS, "temperature": DIVIDE}
    for s in FORMED:
        assert (R.form(s) == TOUCH) == (s.batched.touch is not None) == (s.batched.value is None), s.name


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), p=params_st)
def test_keep_forms_are_their_rows(seed, p):
    """KEEP_K keeps the value(p) best in canonical order; KEEP_MASS the shortest canonical
    prefix whose mass reaches value(p) of the whole; DIVIDE divides every logit: each as
    the row's own run does, where the row is on."""
    ids, logits = candidates(seed)
    ctx = StepContext(history(seed, p), (), n_vocab=V, seed=seed)
    order = canonical_order(ids, logits)
    for s in FORMED:
        if R.form(s) == TOUCH or s.off(p, True):
            continue
        got_ids, got = s.run(ids, logits, p, ctx)
        x = s.batched.value(p)
        if R.form(s) == KEEP_K:
            keep = order[:x]
            assert np.array_equal(np.sort(got_ids), np.sort(ids[keep])), s.name
        elif R.form(s) == KEEP_MASS:
            e = np.exp(logits[order] - logits.max())
            n = min(int(np.searchsorted(np.cumsum(e), x * e.sum())) + 1, ids.size)
            assert set(got_ids.tolist()) == set(ids[order[:n]].tolist()), s.name
        elif x > 0:  # DIVIDE (t <= 0 is greedy: no shape holds it)
            assert np.array_equal(got_ids, ids) and np.array_equal(got, logits / x), s.name


@settings(max_examples=300, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**31), min_size=1, max_size=4), p=params_st)
def test_touch_forms_are_their_rows_bit_for_bit(seeds, p):
    """A TOUCH form over the touched ids of several rows side by side (row ids, values
    float64, the window's counts) gives, for each row whose result it says it gives,
    the values and the removals of the row's run over that row's candidates, bit for bit."""
    rows = []
    for seed in seeds:
        ids, logits = candidates(seed)
        ctx = StepContext(history(seed, p), (), n_vocab=V, seed=seed)
        rows.append((ids, logits.astype(np.float64), ctx))
    for s in FORMED:
        if R.form(s) != TOUCH or s.off(p, True) or not s.batched.carries(p):
            continue
        t_ids, t_row, v, counts = [], [], [], []
        for r, (ids, logits, ctx) in enumerate(rows):
            touched = np.intersect1d(s.touches(p, ctx), ids)  # the touched ids among the row's candidates
            t_ids.append(touched)
            t_row.append(np.full(touched.size, r))
            v.append(np.array([logits[ids == t][0] for t in touched.tolist()], np.float64))
            h_ids, h_counts = ctx.hist
            counts.append(np.array([h_counts[h_ids == t][0] if (h_ids == t).any() else 0.0
                                    for t in touched.tolist()], np.float64))
        t_ids_a = np.concatenate(t_ids).astype(np.int32)
        t_row_a = np.concatenate(t_row).astype(np.intp)
        v_a = np.concatenate(v)
        ok, removed = s.batched.touch(v_a, t_ids_a, t_row_a, len(rows), p,
                                      np.concatenate(counts) if s.batched.counts else None)
        dead = np.zeros(v_a.size, bool)
        if removed is not None:
            dead[removed] = True
        for r, (ids, logits, ctx) in enumerate(rows):
            if ok is not None and not ok[r]:
                # it may refuse only a row where a biased id is not among the candidates
                assert not np.isin(p.bias_arrays[0], ids).all(), s.name
                continue
            got_ids, got = s.run(ids, logits, p, ctx)
            mine = t_row_a == r
            for t, x, d in zip(t_ids_a[mine].tolist(), v_a[mine].tolist(), dead[mine].tolist()):
                assert (t not in got_ids.tolist()) == d, (s.name, t)
                if not d:
                    assert got[got_ids == t][0] == x, (s.name, t)


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**31), p=params_st,
       order=st.permutations(["logit_bias", "penalties", "top_k", "top_p", "temperature"]),
       n=st.integers(1, 5), min_p=st.booleans())
def test_a_shape_computes_its_chain(seed, p, order, n, min_p):
    """Where forms.shape holds a chain, its touching steps' runs, then the k best, the
    mass share and the division (the shape's arithmetic, by hand) keep the candidates
    the chain keeps, with its values (min-p, a step without a form, leaves no shape)."""
    chain = tuple(order[:n]) + (("min_p",) if min_p else ())
    p = p.replace(samplers=chain, trace=False, dynatemp_range=0.0, mirostat=0)
    hist = history(seed, p)
    sh = forms.shape(p, hist[0].size > 0, V)
    if min_p and p.min_p > 0:
        assert sh is None
    if sh is None:
        return
    rng = np.random.default_rng(seed)
    row = np.round(rng.normal(0, 3, V), 1).astype(np.float32)
    want = apply_chain(row, p, hist=hist)
    ids, vals = np.arange(V, dtype=np.int32), row.astype(np.float64)
    ctx = StepContext(hist, (), n_vocab=V, seed=seed)
    for s in sh.touch:
        ids, vals = s.run(ids, vals, p, ctx)
    o = canonical_order(ids, vals)
    if sh.k is not None:
        o = o[:sh.k]
    if sh.mass is not None and o.size > 1:
        e = np.exp(vals[o] - vals[o].max())
        o = o[:min(int(np.searchsorted(np.cumsum(e), sh.mass * e.sum())) + 1, o.size)]
    ids, vals = ids[o], vals[o]
    if sh.divide is not None:
        vals = vals / sh.divide
    w_ids, w_vals = want.materialize()
    assert dict(zip(ids.tolist(), vals.tolist())) == dict(zip(w_ids.tolist(), w_vals.tolist()))
