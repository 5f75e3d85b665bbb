"""Per-needle measures and their summaries: pure functions over numbers, no model.

Per needle: exact match of the greedy answer, the teacher-forced log-probability of the
correct answer (nats, summed over its tokens: continuous, so it still says something
where the model misses), and the KL divergence of the answer positions' distributions
against a reference (mean over the answer's tokens).
Across needles: means with percentile bootstrap 95% intervals; a type against f16 is
paired needle by needle (the same haystack, the same question), so the needles'
difficulty cancels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...results.paired import bootstrap


def exact_match(text: str, answer: str) -> bool:
    """The greedy text starts with the answer (spaces aside) and does not run on into a
    longer word or number ("48213" is not matched by "482139")."""
    t, a = text.lstrip(), answer.strip()
    return t.startswith(a) and not (len(t) > len(a) and t[len(a)].isalnum())


def kl_rows(logp_ref: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) per row, in nats."""
    return (np.exp(logp_ref) * (logp_ref - logp)).sum(axis=1, dtype=np.float64)


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """Mean over needles with its bootstrap interval (needles resampled one by one)."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return {"mean": None, "ci": None, "n": 0}
    lo, hi = bootstrap(lambda x: x.mean(axis=1), [v], block=1)
    return {"mean": float(v.mean()), "ci": [lo, hi], "n": len(v)}


def paired_diff(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Mean of b - a over needles, paired, with its interval."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"cannot pair {len(a)} needles with {len(b)}")
    return mean_ci(b - a)


def excludes_zero(ci: Sequence[float] | None) -> bool:
    return ci is not None and (ci[0] > 0 or ci[1] < 0)


def floor(noise: list[dict[str, Any]]) -> dict[str, float | None]:
    """The noise floor from the noise rows of one length: the largest mean KL against the
    setup they vary (kl_base: the f16 default, or the --noise-of type), and the largest |mean
    Δ answer log-prob| and |Δ accuracy| against it."""
    if not noise:
        return {"kl": None, "dlogp": None, "dacc": None}
    return {"kl": max(r["kl_base"]["mean"] for r in noise),
            "dlogp": max(abs(r["dlogp"]["mean"]) for r in noise),
            "dacc": max(abs(r["dacc"]["mean"]) for r in noise)}


def above_noise(row: dict[str, Any], fl: dict[str, float | None]) -> bool | None:
    """As `ppl --noise` decides: a type's effect stands above the noise when its KL against
    the f16 default exceeds the floor's and its answer log-prob moved by more than any
    noise row's, with a paired interval that excludes zero."""
    if fl.get("kl") is None or row.get("dlogp") is None or row.get("kl_f16") is None:
        return None
    d = row["dlogp"]
    return bool(row["kl_f16"]["mean"] > fl["kl"] and abs(d["mean"]) > fl["dlogp"] and excludes_zero(d["ci"]))
