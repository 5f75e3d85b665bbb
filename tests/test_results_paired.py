"""clickpaca.results.paired: the bootstrap intervals and verdicts, on synthetic data (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.results import paired

nll_lists = st.lists(st.floats(0.0, 20.0, allow_nan=False), min_size=1, max_size=200)


def test_block_indices_are_whole_blocks_in_range():
    rng = np.random.default_rng(0)
    idx = paired.block_indices(50, 8, rng, 30)
    assert idx.shape == (30, 50)
    assert idx.min() >= 0 and idx.max() < 50
    # inside each block of 8 the indices are consecutive (modulo the wrap at the end)
    for row in idx:
        for j in range(0, 48, 8):
            assert all((row[j + i + 1] - row[j + i]) % 50 == 1 for i in range(7))


def test_interval_covers_a_known_difference():
    """The synthetic truth: b = a + 0.03 nats per token + zero-mean noise. Over 200 synthetic
    texts the 95% interval of the mean NLL difference holds 0.03 about 95% of the time,
    and the ΔPPL interval holds the exact population ΔPPL about as often."""
    true_d = 0.03
    rng = np.random.default_rng(7)
    covered_d = covered_ppl = 0
    trials = 200
    for t in range(trials):
        a = rng.gamma(2.0, 1.5, size=400)
        b = a + true_d + rng.normal(0, 0.2, size=400)
        r = paired.delta_ppl(a, b, resamples=1000, block=1, seed=t)
        lo, hi = r["delta_nll_ci"]
        covered_d += lo <= true_d <= hi
        # given this a, the ΔPPL the noise averages to: exp(mean a) * (exp(true_d) - 1)
        target = math.exp(a.mean()) * (math.exp(true_d) - 1)
        covered_ppl += r["delta_ppl_ci"][0] <= target <= r["delta_ppl_ci"][1]
    assert 0.88 <= covered_d / trials <= 0.99
    assert 0.88 <= covered_ppl / trials <= 0.99


def test_blocks_widen_the_interval_of_correlated_tokens():
    """Neighbouring tokens share context: with positively correlated differences, whole
    blocks give a wider (honest) interval than single tokens."""
    rng = np.random.default_rng(3)
    e = rng.normal(0, 0.1, size=2000)
    d = np.empty_like(e)
    d[0] = e[0]
    for i in range(1, len(e)):
        d[i] = 0.8 * d[i - 1] + e[i]
    a = rng.gamma(2.0, 1.5, size=2000)
    one = paired.delta_ppl(a, a + d, block=1)["delta_nll_ci"]
    blk = paired.delta_ppl(a, a + d, block=32)["delta_nll_ci"]
    assert blk[1] - blk[0] > 1.5 * (one[1] - one[0])


@settings(max_examples=40, deadline=None)
@given(nll_lists)
def test_zero_difference_is_zero_and_identical(a):
    r = paired.delta_ppl(a, a, resamples=200)
    assert r["delta_ppl"] == 0 and r["delta_nll"] == 0
    assert r["delta_ppl_ci"] == [0.0, 0.0] and r["delta_nll_ci"] == [0.0, 0.0]
    assert paired.verdict(*r["delta_ppl_ci"], r["delta_ppl"]) == "identical"


@settings(max_examples=40, deadline=None)
@given(nll_lists, st.data())
def test_swapping_the_runs_mirrors_the_interval(a, data):
    b = data.draw(st.lists(st.floats(0.0, 20.0, allow_nan=False), min_size=len(a), max_size=len(a)))
    ab = paired.delta_ppl(a, b, resamples=200)
    ba = paired.delta_ppl(b, a, resamples=200)
    assert ab["delta_nll"] == pytest.approx(-ba["delta_nll"], abs=1e-12)
    assert ab["delta_nll_ci"][0] == pytest.approx(-ba["delta_nll_ci"][1], abs=1e-9)
    assert ab["delta_nll_ci"][1] == pytest.approx(-ba["delta_nll_ci"][0], abs=1e-9)


def test_same_seed_same_interval_other_seed_other_interval():
    rng = np.random.default_rng(1)
    a = rng.gamma(2.0, 1.5, size=300)
    b = a + rng.normal(0.01, 0.3, size=300)
    assert paired.delta_ppl(a, b, seed=5) == paired.delta_ppl(a, b, seed=5)
    assert paired.delta_ppl(a, b, seed=5)["delta_ppl_ci"] != paired.delta_ppl(a, b, seed=6)["delta_ppl_ci"]


def test_unpaired_lengths_are_refused():
    with pytest.raises(ValueError, match="cannot pair"):
        paired.delta_ppl([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="cannot pair"):
        paired.paired_mean_diff([1.0, 2.0], [1.0])


def test_mean_ci_of_a_constant_is_the_constant():
    r = paired.mean_ci([0.25] * 50)
    assert r["mean"] == 0.25 and r["ci"] == [0.25, 0.25]


def test_ratio_of_medians():
    one = paired.ratio_of_medians([50.0], [45.0])
    assert one["ratio"] == pytest.approx(0.9) and one["ci"] is None
    same = paired.ratio_of_medians([50.0, 51.0, 49.0], [50.0, 51.0, 49.0])
    assert same["ratio"] == 1.0 and same["ci"][0] <= 1.0 <= same["ci"][1]
    assert paired.verdict(*same["ci"], same["ratio"], zero=1.0) == "within noise"
    apart = paired.ratio_of_medians([50.0, 51.0, 49.0, 50.5], [40.0, 41.0, 39.5, 40.5])
    assert apart["ci"][1] < 1.0
    assert paired.verdict(*apart["ci"], apart["ratio"], zero=1.0) == "lower"
    with pytest.raises(ValueError):
        paired.ratio_of_medians([], [1.0])


def test_verdict_uses_the_noise_floor():
    assert paired.verdict(0.01, 0.03, 0.02) == "higher"
    assert paired.verdict(-0.03, -0.01, -0.02) == "lower"
    assert paired.verdict(0.01, 0.03, 0.02, floor=0.025) == "within noise (below the noise floor)"
    assert paired.verdict(0.01, 0.03, 0.02, floor=0.015) == "higher"
    assert paired.verdict(None, None, 0.02) == "no interval"
    assert paired.verdict(0.0, 0.0, 0.0) == "identical"
    assert paired.verdict(-0.01, 0.01, 0.0) == "within noise"
    assert paired.verdict(1.0, 1.0, 1.0, zero=1.0) == "identical"
