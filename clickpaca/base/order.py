"""The canonical order of a candidate set as one sortable key per entry.

The sampler chain orders candidates by value descending, then id ascending
(sampling/steps.py ``canonical_order``); the pre-selection's read (llama/presample/)
hands each row's K best back in that order and the host path's batched rows
(sampling/batch.py) sort their candidates so. Both sort [m, n] matrices along their rows:
one uint64 key per entry makes that one argsort.
"""

from __future__ import annotations

import numpy as np


def canonical_keys(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One uint64 per entry whose ascending order is the canonical order of float32
    values: value descending (NaN last, as lexsort puts it; -0.0 equal to 0.0), then id
    ascending (ids in [0, 2^32)). The keys are distinct where the ids are, so any sort
    of them (an argsort along a row of a matrix) gives sampling.steps.canonical_order's order."""
    bits = (values.astype(np.float32, copy=False) + np.float32(0)).view(np.int32).astype(np.int64)
    key = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ascending with the float's order
    desc = np.where(np.isnan(values), 0xFFFFFFFF, 0x7FFFFFFF - key).astype(np.uint64)  # < 2^32
    return (desc << np.uint64(32)) | ids.astype(np.uint64)


def is_canonical(ids: np.ndarray, values: np.ndarray) -> bool:
    """Whether every row of [m, n] ids and values is in canonical order already (value
    descending, then id ascending; NaN anywhere says no): a check of a few passes, where
    sorting would cost the keys and an argsort."""
    if strictly_descending(values):  # the common case (real logits rarely tie): two calls
        return True
    a, b = values[:, :-1], values[:, 1:]
    return bool(np.logical_and.reduce((a > b) | ((a == b) & (ids[:, :-1] < ids[:, 1:])), axis=None))


def strictly_descending(values: np.ndarray) -> bool:
    """Whether every row of [m, n] values descends strictly (no ties, no NaN): canonical
    whatever the ids. (ufunc reductions: ndarray.all is a Python-level wrapper, slow on
    the cold caches a decode leaves.)"""
    return bool(np.logical_and.reduce(np.greater(values[:, :-1], values[:, 1:]), axis=None))
