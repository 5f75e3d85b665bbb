"""clickpaca.wire.scoring without a model: llama-perplexity's windows and NLL per row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.wire.scoring import score_rows, windows_for

BOS = 2


def perplexity_reference(tokens, n_ctx, bos):
    """What llama-perplexity -c n_ctx scores (tools/perplexity/perplexity.cpp): n/n_ctx
    chunks; each chunk's first token replaced by BOS; logits rows first = n_ctx/2 ..
    n_ctx-2 predict tokens first+1 .. n_ctx-1 of the chunk. Returns (chunk, [(row, target)])."""
    out = []
    for i in range(len(tokens) // n_ctx):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        first = n_ctx // 2
        out.append((chunk, [(j, chunk[j + 1]) for j in range(first, n_ctx - 1)]))
    return out


def scored_pairs(windows):
    """(row, target) pairs the scheduler scores for each window: rows first .. len-2."""
    return [(list(map(int, w)), [(j, int(w[j + 1])) for j in range(first, len(w) - 1)])
            for w, first in windows]


def test_too_short():
    assert windows_for(np.array([], np.int32), 8, BOS) == []
    assert windows_for(np.array([BOS], np.int32), 8, BOS) == []


def test_short_text_is_one_window_scoring_every_token_after_the_first():
    toks = np.array([BOS, 10, 11, 12, 13], np.int32)
    (w, first), = windows_for(toks, 8, BOS)
    assert first == 0 and w.tolist() == toks.tolist()
    assert w is not toks  # a copy
    pairs = scored_pairs([(w, first)])[0][1]
    assert [t for _, t in pairs] == [10, 11, 12, 13]
    # exactly `window` tokens: still whole
    toks = np.arange(100, 108, dtype=np.int32)
    (w, first), = windows_for(toks, 8, BOS)
    assert first == 0 and w.tolist() == toks.tolist()  # no BOS replacement either


def test_long_text_windows():
    toks = np.arange(1000, 1000 + 37, dtype=np.int32)
    wins = windows_for(toks, 8, BOS)
    assert len(wins) == 37 // 8 == 4
    for j, (w, first) in enumerate(wins):
        assert len(w) == 8 and w.dtype == np.int32
        assert first == 4
        assert w[0] == BOS
        assert w[1:].tolist() == toks[j * 8 + 1:(j + 1) * 8].tolist()
    # the remainder (37 - 32 = 5 tokens) is dropped
    assert wins[-1][0][-1] == toks[31]
    # the input is not modified
    assert toks[0] == 1000 and toks[8] == 1008


def test_no_bos_keeps_the_first_token():
    toks = np.arange(50, 70, dtype=np.int32)
    wins = windows_for(toks, 6, None)
    assert [w.tolist() for w, _ in wins] == [toks[i * 6:(i + 1) * 6].tolist() for i in range(3)]
    assert [f for _, f in wins] == [3, 3, 3]


def test_odd_window():
    wins = windows_for(np.arange(23, dtype=np.int32), 7, BOS)
    assert len(wins) == 3 and all(f == 3 for _, f in wins)
    assert sum(len(w) - 1 - f for w, f in wins) == 3 * 3  # 3 scored tokens per window


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=0, max_size=200), st.integers(2, 64),
       st.sampled_from([BOS, None]))
def test_matches_llama_perplexity(tokens, window, bos):
    toks = np.array(tokens, np.int32)
    wins = windows_for(toks, window, bos)
    if len(toks) < 2:
        assert wins == []
    elif len(toks) <= window:
        assert len(wins) == 1 and wins[0][1] == 0 and wins[0][0].tolist() == tokens
        assert len(scored_pairs(wins)[0][1]) == len(tokens) - 1
    else:
        assert scored_pairs(wins) == perplexity_reference(tokens, window, bos)
        assert len(wins) == len(tokens) // window


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 300), st.integers(3, 64))
def test_every_allowed_window_scores_something(n, window):
    # the protocol refuses window < 3: with 2, a long text would have no scored token
    # (first row 1 of a 2-token window predicts nothing)
    from clickpaca.wire.protocol import REQUESTS
    check = REQUESTS["score"]["window"][0]
    with pytest.raises(ValueError):
        check("window", 2)
    wins = windows_for(np.arange(n, dtype=np.int32), window, BOS)
    assert sum(len(w) - 1 - first for w, first in wins) >= 1


# ------------------------------------------------------------------ score_rows

def reference_nll(rows, targets):
    rows = np.asarray(rows, np.float64)
    m = rows.max(axis=1, keepdims=True)
    logsoftmax = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
    return -logsoftmax[np.arange(len(rows)), targets]


def test_score_rows_simple():
    rows = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], np.float32))
    nll = score_rows(rows, np.array([0, 2]))
    assert nll.dtype == np.float64 and nll.shape == (2,)
    np.testing.assert_allclose(nll, [np.log(2), -np.log(0.8)], rtol=1e-6)


def test_score_rows_uniform_and_shift_invariant():
    rows = np.zeros((3, 1000), np.float32)
    np.testing.assert_allclose(score_rows(rows, [0, 5, 999]), np.log(1000), rtol=1e-6)
    rows = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    t = np.array([1, 2, 3, 49])
    np.testing.assert_allclose(score_rows(rows + 1000, t), score_rows(rows, t), atol=1e-3)


def test_score_rows_large_logits_do_not_overflow():
    rows = np.array([[1000.0, 0.0, -1000.0], [-1e4, -1e4, -1e4 + 1]], np.float32)
    nll = score_rows(rows, [0, 1])
    assert np.all(np.isfinite(nll))
    np.testing.assert_allclose(nll, reference_nll(rows, [0, 1]), rtol=1e-5, atol=1e-5)


def test_score_rows_empty():
    assert score_rows(np.zeros((0, 10), np.float32), np.zeros(0, np.int32)).shape == (0,)


@pytest.mark.parametrize("seed", range(5))
def test_score_rows_matches_numpy_log_softmax(seed):
    rng = np.random.default_rng(seed)
    n, v = rng.integers(1, 20), rng.integers(2, 5000)
    rows = (rng.normal(size=(n, v)) * rng.uniform(0.1, 30)).astype(np.float32)
    targets = rng.integers(0, v, size=n)
    nll = score_rows(rows, targets)
    np.testing.assert_allclose(nll, reference_nll(rows, targets), rtol=1e-5, atol=1e-5)
    assert np.all(nll >= -1e-6)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(2, 300), st.integers(0, 2 ** 32 - 1), st.floats(0.01, 100))
def test_score_rows_property(n, v, seed, scale):
    rng = np.random.default_rng(seed)
    rows = (rng.normal(size=(n, v)) * scale).astype(np.float32)
    targets = rng.integers(0, v, size=n)
    nll = score_rows(rows, targets)
    np.testing.assert_allclose(nll, reference_nll(rows, targets), rtol=1e-5, atol=1e-4)
    # probabilities of all targets of a row sum to one
    all_t = score_rows(np.repeat(rows[:1], v, axis=0), np.arange(v))
    assert abs(np.exp(-all_t).sum() - 1) < 1e-4


def test_score_last_moves_the_first_scored_row_and_half_is_the_default():
    toks = np.arange(40, dtype=np.int32)
    default, half = windows_for(toks, 16, 2), windows_for(toks, 16, 2, score_last=8)
    assert [w[1] for w in half] == [w[1] for w in default] == [8, 8]
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(half, default))
    assert [w[1] for w in windows_for(toks, 16, 2, score_last=4)] == [12, 12]
    with pytest.raises(ValueError, match="score_last"):
        windows_for(toks, 16, 2, score_last=16)
