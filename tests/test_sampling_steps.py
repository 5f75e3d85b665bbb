"""Each step on hand-made candidate sets, the bitmask helpers and the row cutting primitives."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.sampling import steps as S
from clickpaca.sampling.bitmask import allowed_ids, allows, as_words, count_allowed
from clickpaca.sampling.cut import RowView, upper_ids

FAST = settings(max_examples=150, deadline=None)


def cand(logits, ids=None):
    logits = np.asarray(logits, np.float64)
    ids = np.arange(logits.size, dtype=np.int32) if ids is None else np.asarray(ids, np.int32)
    ids.flags.writeable = False
    logits.flags.writeable = False  # a write by a step would raise
    return ids, logits


def as_dict(ids, logits):
    return dict(zip(ids.tolist(), logits.tolist()))


# -- grammar ------------------------------------------------------------------------------

def words_for(allowed, n):
    w = np.zeros((n + 31) // 32, np.uint32)
    for t in allowed:
        w[t >> 5] |= np.uint32(1 << (t & 31))
    return w.view(np.int32)


def test_grammar_keeps_allowed():
    ids, logits = cand([1.0, 2.0, 3.0, 4.0], ids=[40, 3, 33, 0])
    out = S.grammar(ids, logits, as_words(words_for([3, 40], 64), 64))
    assert as_dict(*out) == {40: 1.0, 3: 2.0}


@FAST
@given(n=st.integers(1, 300), data=st.data())
def test_bitmask_helpers_match_unpackbits(n, data):
    nw = (n + 31) // 32
    raw = np.array(data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=nw, max_size=nw + 2)),
                   np.int32)
    words = as_words(raw, n)
    bits = np.unpackbits(raw.view(np.uint8), bitorder="little")[:n].astype(bool)
    assert count_allowed(words, n) == bits.sum()
    assert allowed_ids(words, n).tolist() == np.flatnonzero(bits).tolist()
    assert allows(words, np.arange(n)).tolist() == bits.tolist()


def test_sparse_and_dense_extraction_agree():
    rng = np.random.default_rng(1)
    for density in (0.001, 0.5):
        n = 5000
        allowed = np.flatnonzero(rng.random(n) < density)
        w = as_words(words_for(allowed, n), n)
        assert allowed_ids(w, n).tolist() == allowed.tolist()


def test_bitmask_shape_checks():
    with pytest.raises(ValueError, match="needs 2 for 40 tokens"):
        as_words(np.zeros(1, np.int32), 40)
    with pytest.raises(ValueError, match="32-bit"):
        as_words(np.zeros(2, np.int64), 40)
    assert as_words(np.zeros((1, 2), np.int32), 40).shape == (2,)  # llguidance's [1, W] row


# -- logit bias -----------------------------------------------------------------------------

BIAS = (np.array([1, 2, 5], np.int32), np.array([0.5, -1e9, 3.0]))


def test_bias_adds_and_bans():
    out = S.logit_bias(*cand([0.0, 1.0, 2.0, 3.0]), *BIAS)
    assert as_dict(*out) == {0: 0.0, 1: 1.5, 3: 3.0}


def test_bias_forces():
    ids, logits = cand([0.0, 1.0, 2.0, 3.0])
    out = S.logit_bias(ids, logits, np.array([0, 2, 3], np.int32), np.array([1e9, math.inf, -5.0]))
    assert as_dict(*out) == {0: 0.0, 2: 2.0}  # only forced tokens remain, logits unbiased


def test_bias_force_absent_does_nothing():
    out = S.logit_bias(*cand([0.0, 1.0]), np.array([7], np.int32), np.array([1e9]))
    assert as_dict(*out) == {0: 0.0, 1: 1.0}


def test_bias_many_candidates_path():
    n = 10_000
    ids, logits = cand(np.zeros(n), ids=np.arange(n)[::-1])
    out = S.logit_bias(ids, logits, np.array([3, 9000], np.int32), np.array([2.0, -1e9]))
    d = as_dict(*out)
    assert len(d) == n - 1 and d[3] == 2.0 and 9000 not in d


# -- penalties ------------------------------------------------------------------------------

def test_penalties_llama_cpp_semantics():
    ids, logits = cand([2.0, -2.0, 0.0, 4.0])
    out = S.penalties(ids, logits, np.array([0, 1, 2], np.int32), np.array([1.0, 2.0, 3.0]),
                      repeat=2.0, freq=0.5, present=0.25)
    # positive: divide; non-positive: multiply; then - (count * freq + present)
    assert as_dict(*out) == {0: 2.0 / 2 - 0.75, 1: -2.0 * 2 - 1.25, 2: 0.0 - 1.75, 3: 4.0}


# -- truncations ----------------------------------------------------------------------------

def test_top_k_ties_go_to_smaller_ids():
    ids, logits = cand([1.0, 3.0, 3.0, 3.0, 0.0], ids=[9, 8, 2, 5, 1])
    assert sorted(S.top_k(ids, logits, 2)[0].tolist()) == [2, 5]
    assert S.top_k(ids, logits, 0)[0].size == 5
    assert S.top_k(ids, logits, 9)[0].size == 5


def test_min_p():
    ids, logits = cand(np.log([0.5, 0.25, 0.2, 0.05]))
    assert S.min_p(ids, logits, 0.45)[0].tolist() == [0, 1]  # p >= 0.45 * 0.5
    assert S.min_p(ids, logits, 1.0)[0].tolist() == [0]
    assert S.min_p(ids, logits, 0.0)[0].size == 4


def test_top_p():
    ids, logits = cand(np.log([0.2, 0.5, 0.3]))
    assert sorted(S.top_p(ids, logits, 0.5)[0].tolist()) == [1]
    assert sorted(S.top_p(ids, logits, 0.6)[0].tolist()) == [1, 2]
    assert sorted(S.top_p(ids, logits, 0.0)[0].tolist()) == [1]  # at least one
    assert S.top_p(ids, logits, 1.0)[0].size == 3


def test_top_p_rest_mass_counts_unseen_tokens():
    ids, logits = cand([0.0, 0.0])  # two tokens of mass 1 each, plus 2 more outside
    assert S.top_p(ids, logits, 0.5, rest_mass=2.0)[0].tolist() == [0, 1]
    assert S.top_p(ids, logits, 0.25, rest_mass=2.0)[0].tolist() == [0]


def plain_top_p(ids, logits, p):
    """Full sort, then walk down until the cumulative mass reaches p."""
    order = np.lexsort((ids, -logits))
    e = np.exp(logits - logits.max())
    z = e.sum()
    cum = np.cumsum(e[order])
    cut = int(np.argmax(cum >= p * z)) if cum[-1] >= p * z else ids.size - 1
    return sorted(ids[order[: cut + 1]].tolist()), order, cum, z


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2049, 6000), p=st.floats(0, 0.999),
       coarse=st.booleans(), scale=st.sampled_from([0.5, 3.0, 20.0]))
def test_top_p_bucket_path_matches_plain_sort(seed, n, p, coarse, scale):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(n) * scale
    if coarse:
        logits = np.round(logits)  # many ties
    ids = rng.permutation(n * 2)[:n].astype(np.int32)
    want, order, cum, z = plain_top_p(ids, logits, p)
    if np.any(np.abs(cum - p * z) <= 1e-9 * z):
        return  # a cumulative sum on the boundary: rounding decides, not the definition
    assert sorted(S.top_p(*cand(logits, ids), p)[0].tolist()) == want


def test_temperature():
    ids, logits = cand([1.0, 4.0, 2.0])
    assert S.temperature(ids, logits, 2.0)[1].tolist() == [0.5, 2.0, 1.0]
    ids, logits = cand([4.0, 1.0, 4.0], ids=[7, 1, 3])
    assert S.temperature(ids, logits, 0.0)[0].tolist() == [3]  # greedy, smaller id on ties
    assert S.temperature(ids, logits, -1.0)[0].tolist() == [3]


# -- sample ---------------------------------------------------------------------------------

def test_sample_inverse_cdf_in_id_order():
    ids, logits = cand(np.log([0.5, 0.25, 0.25]), ids=[9, 2, 4])
    # id order: 2 (0.25), 4 (0.25), 9 (0.5)
    assert S.sample(ids, logits, 0.0) == 2
    assert S.sample(ids, logits, 0.3) == 4
    assert S.sample(ids, logits, 0.6) == 9
    assert S.sample(ids, logits, 0.999999) == 9


def test_sample_never_draws_minus_inf_or_empty():
    ids, logits = cand([-np.inf, 0.0, -np.inf])
    assert all(S.sample(ids, logits, u) == 1 for u in (0.0, 0.5, 0.9999))
    assert S.sample(*cand([-np.inf, -np.inf]), 0.5) == -1
    assert S.sample(*cand([]), 0.5) == -1
    assert S.sample(*cand([0.0, np.nan]), 0.5) == -1
    assert S.sample(*cand([0.0, np.inf, np.inf]), 0.0) == 1


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 50), data=st.data())
def test_steps_never_write_and_return_subsets(seed, n, data):
    rng = np.random.default_rng(seed)
    ids, logits = cand(rng.standard_normal(n) * 3, rng.permutation(1000)[:n])
    before = (ids.copy(), logits.copy())
    k = data.draw(st.integers(0, n + 2))
    p = data.draw(st.floats(0, 1))
    t = data.draw(st.floats(-1, 3))
    results = [
        S.logit_bias(ids, logits, np.sort(ids[: n // 2]), rng.standard_normal(n // 2)),
        S.penalties(ids, logits, np.sort(ids[: n // 2]), np.ones(n // 2), 1.3, 0.1, 0.2),
        S.top_k(ids, logits, k), S.min_p(ids, logits, p), S.top_p(ids, logits, p),
        S.temperature(ids, logits, t),
    ]
    for out_ids, out_logits in results:
        assert set(out_ids.tolist()) <= set(ids.tolist()) and out_ids.size == out_logits.size
        if k or p or t:  # nothing truncates to empty
            assert out_ids.size >= 1
    assert np.array_equal(ids, before[0]) and np.array_equal(logits, before[1])
    assert S.sample(ids, logits, data.draw(st.floats(0, 0.9999))) in set(ids.tolist())


def test_top_n_and_log_softmax():
    ids, logits = cand([1.0, 3.0, 3.0, 2.0], ids=[5, 7, 6, 1])
    top_ids, top_v = S.top_n(ids, logits, 3)
    assert top_ids.tolist() == [6, 7, 1] and top_v.tolist() == [3.0, 3.0, 2.0]
    ls = S.log_softmax(logits)
    assert np.isclose(np.exp(ls).sum(), 1.0)


# -- cutting the raw row ----------------------------------------------------------------------

@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), cols=st.integers(1, 64),
       coarse=st.booleans(), data=st.data())
def test_rowview_ge_and_upper_ids(seed, n, cols, coarse, data):
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n) * 3).astype(np.float32)
    if coarse:
        row = np.round(row)
    row.flags.writeable = False
    view = RowView(row, cols=min(cols, n), dense_frac=data.draw(st.sampled_from([0.25, 2.0])))
    t = float(data.draw(st.sampled_from([-math.inf, *row[:5].tolist()])))
    assert view.ge(t).tolist() == np.flatnonzero(row >= t).tolist()
    need = data.draw(st.integers(1, n + 3))
    mask = rng.random(n) < data.draw(st.sampled_from([0.05, 0.5, 1.0]))
    words = as_words(words_for(np.flatnonzero(mask), n), n)
    exclude = np.unique(rng.integers(0, n, data.draw(st.integers(0, 5)))).astype(np.int32)
    ok = mask.copy()
    ok[exclude] = False
    got = upper_ids(view, need, words, max(mask.mean(), 1e-3), exclude)
    assert set(got.tolist()) <= set(np.flatnonzero(ok).tolist())
    assert got.size >= min(need, ok.sum())
    if got.size:  # an upper set: nothing allowed outside it beats anything in it
        outside = np.setdiff1d(np.flatnonzero(ok), got)
        assert outside.size == 0 or row[outside].max() < row[got].min()
    assert view.max() == row.max()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), decimals=st.sampled_from([0, 1, 3]), n=st.integers(4097, 30000))
def test_canonical_order_of_a_big_set_is_lexsorts(seed, decimals, n):
    """The big-set path (unstable sort, then the runs of equal logits by id) is exact."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(200_000)[:n].astype(np.int32)
    logits = np.round(rng.standard_normal(n) * 3, decimals)
    logits[rng.integers(0, n, 20)] = -np.inf
    assert np.array_equal(S.canonical_order(ids, logits), np.lexsort((ids, -logits)))


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 6), n=st.integers(1, 40), p=st.floats(0.01, 0.999), seed=st.integers(0, 2**32 - 1),
       ties=st.booleans(), rest=st.sampled_from([0.0, 0.5, 3.0]), dtype=st.sampled_from([np.float32, np.float64]))
def test_top_p_cut_of_rows_is_each_rows_own_and_a_left_search(m, n, p, seed, ties, rest, dtype):
    """top_p_target and top_p_cut, the one arithmetic of top-p's cut: on an [m, n]
    matrix (the batched rows: a count of running masses below the target) each row gets
    what it gets alone (the scalar step: a binary search), and the cut is the left-sided
    search of the running mass, kept within the row; in float32 (the logits' type) too."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((m, n)).astype(dtype)
    if ties:
        v = np.round(v)
    ids = np.stack([rng.permutation(n) for _ in range(m)]).astype(np.int32)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    e_can = np.stack([e[a][S.canonical_order(ids[a], v[a])] for a in range(m)])
    rests = np.full(m, rest)
    cut = S.top_p_cut(S.top_p_target(e, p, rests), e_can)
    for a in range(m):
        target = S.top_p_target(e[a], p, rest)
        alone = int(S.top_p_cut(target, e_can[a]))
        assert int(cut[a]) == alone
        assert alone == min(int(np.searchsorted(np.cumsum(e_can[a]), target, side="left")), n - 1)
        kept, _ = S.top_p(ids[a], v[a], p, rest)
        assert kept.size == alone + 1


def test_top_p_cut_keeps_the_token_whose_running_mass_reaches_the_target_exactly():
    """A running mass equal to the target is reached: that token is the last kept (the
    host step's left-sided search), and one token at least is kept."""
    e = np.ones(4)
    assert int(S.top_p_cut(S.top_p_target(e, 0.5), e)) == 1  # running masses 1, 2 (= 0.5 x 4), 3, 4
    assert int(S.top_p_cut(S.top_p_target(e, 0.01), e)) == 0
    assert int(S.top_p_cut(S.top_p_target(e, 0.9, 10.0), e)) == 3  # the target beyond the row: all kept
