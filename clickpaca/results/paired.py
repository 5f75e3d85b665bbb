"""Paired statistics for comparing two runs: pure functions, fixed seeds, no model.

Quality: both runs scored the same tokens, so the per-token NLL differences are paired
and the noise of the text itself cancels. ΔPPL = exp(mean nll_b) - exp(mean nll_a),
with a percentile bootstrap 95% interval that resamples *blocks* of consecutive tokens
(neighbouring tokens share context, so single-token resampling would be too narrow).

Speed: rounds of the two runs are not paired (different times), so the interval of the
ratio of medians resamples each run's rounds independently.

A difference is "within noise" when its interval includes zero (a ratio: one), or when
it is smaller than a recorded noise floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SEED = 20261130
RESAMPLES = 2000
BLOCK = 16
LEVEL = 0.95


def block_indices(n: int, block: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[resamples, n] token indices: whole blocks of `block` consecutive tokens drawn with
    replacement (the last block may be shorter), cut to n per resample."""
    block = max(1, min(block, n))
    starts = np.arange(0, n, block)
    k = math.ceil(n / block)
    picks = rng.integers(0, len(starts), size=(resamples, k))
    idx = (starts[picks][:, :, None] + np.arange(block)[None, None, :]).reshape(resamples, -1)
    # blocks that run past the end wrap around (circular blocks): every index stays valid
    return (idx % n)[:, :n]


def bootstrap(stat: Callable[[np.ndarray], np.ndarray], arrays: Sequence[np.ndarray], block: int = BLOCK,
              resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of stat over paired arrays resampled by the same block indices.

    stat takes a [resamples, n] array per input (the resampled values) and returns
    one value per resample."""
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError("paired arrays differ in length")
    if n == 0:
        raise ValueError("no samples")
    rng = np.random.default_rng(seed)
    idx = block_indices(n, block, rng, resamples)
    vals = stat(*[np.asarray(a, dtype=np.float64)[idx] for a in arrays])
    lo, hi = np.quantile(vals, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def verdict(lo: float | None, hi: float | None, value: float | None, zero: float = 0.0,
            floor: float | None = None) -> str:
    """'within noise' when the interval includes `zero` or |value - zero| is below the noise
    floor; 'identical' when every resample gave exactly `zero` (the same per-token values);
    'higher' / 'lower' otherwise; 'no interval' when there is none."""
    if value is None or lo is None or hi is None or not all(map(math.isfinite, (lo, hi, value))):
        return "no interval"
    if lo == hi == value == zero:
        return "identical"
    if lo <= zero <= hi:
        return "within noise"
    if floor is not None and abs(value - zero) < floor:
        return "within noise (below the noise floor)"
    return "higher" if value > zero else "lower"


def delta_ppl(nll_a: Sequence[float], nll_b: Sequence[float], **kw: Any) -> dict[str, Any]:
    """Paired ΔPPL (b - a), its relative size, the mean per-token NLL difference, and their
    bootstrap 95% intervals."""
    a = np.asarray(nll_a, dtype=np.float64)
    b = np.asarray(nll_b, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"cannot pair {len(a)} tokens with {len(b)}")
    ppl_a, ppl_b = math.exp(a.mean()), math.exp(b.mean())
    d = b - a
    lo, hi = bootstrap(lambda x, y: np.exp(y.mean(axis=1)) - np.exp(x.mean(axis=1)), [a, b], **kw)
    dlo, dhi = bootstrap(lambda x: x.mean(axis=1), [d], **kw)
    return {"tokens": len(a), "ppl_a": ppl_a, "ppl_b": ppl_b, "delta_ppl": ppl_b - ppl_a,
            "delta_ppl_ci": [lo, hi], "delta_ppl_rel": ppl_b / ppl_a - 1,
            "delta_ppl_rel_ci": [lo / ppl_a, hi / ppl_a],
            "delta_nll": float(d.mean()), "delta_nll_ci": [dlo, dhi],
            "mean_abs_delta_nll": float(np.abs(d).mean())}


def mean_ci(values: Sequence[float], **kw: Any) -> dict[str, Any]:
    """Mean and block-bootstrap interval of one per-token series (e.g. KL vs a reference)."""
    v = np.asarray(values, dtype=np.float64)
    lo, hi = bootstrap(lambda x: x.mean(axis=1), [v], **kw)
    return {"mean": float(v.mean()), "ci": [lo, hi], "tokens": len(v)}


def paired_mean_diff(a: Sequence[float], b: Sequence[float], **kw: Any) -> dict[str, Any]:
    """Mean of b - a per token (paired) with its interval: KL or top-1 agreement of two runs
    against references that are the same."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"cannot pair {len(a)} tokens with {len(b)}")
    d = b - a
    lo, hi = bootstrap(lambda x: x.mean(axis=1), [d], **kw)
    return {"a": float(a.mean()), "b": float(b.mean()), "diff": float(d.mean()), "ci": [lo, hi]}


def ratio_of_medians(rounds_a: Sequence[float], rounds_b: Sequence[float], resamples: int = RESAMPLES,
                     seed: int = SEED, level: float = LEVEL) -> dict[str, Any]:
    """median(b) / median(a), with a bootstrap interval resampling each side's rounds.

    With one round on either side there is no interval (ci None): one round says
    nothing about the noise."""
    a = np.asarray([x for x in rounds_a if x is not None and math.isfinite(x)], dtype=np.float64)
    b = np.asarray([x for x in rounds_b if x is not None and math.isfinite(x)], dtype=np.float64)
    if not len(a) or not len(b):
        raise ValueError("no rounds")
    r = float(np.median(b) / np.median(a))
    ci = None
    if len(a) > 1 and len(b) > 1:
        rng = np.random.default_rng(seed)
        ma = np.median(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)
        mb = np.median(b[rng.integers(0, len(b), size=(resamples, len(b)))], axis=1)
        lo, hi = np.quantile(mb / ma, [(1 - level) / 2, 1 - (1 - level) / 2])
        ci = [float(lo), float(hi)]
    return {"median_a": float(np.median(a)), "median_b": float(np.median(b)), "rounds_a": len(a),
            "rounds_b": len(b), "ratio": r, "ci": ci}
