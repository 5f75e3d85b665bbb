"""base/order.py: the canonical-order checks against their definition (numpy's lexsort
by descending value, then id), on rows with ties, NaN, -0.0 and infinities."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.base.order import canonical_keys, is_canonical, strictly_descending

POOL = [0.0, -0.0, 1.5, -1.5, 3.0, np.inf, -np.inf, np.nan]


def _rows(data):
    m, n = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 12))
    vals = np.array(data.draw(st.lists(st.lists(st.sampled_from(POOL) | st.floats(-4, 4, width=32), min_size=n,
                                                max_size=n), min_size=m, max_size=m)), np.float32)
    ids = np.stack([np.random.default_rng(j).permutation(50)[:n] for j in range(m)]).astype(np.int32)
    if data.draw(st.booleans()):  # sorted rows too, so that the True side is reached
        o = np.stack([np.lexsort((ids[j], -vals[j])) for j in range(m)])
        ids, vals = np.take_along_axis(ids, o, 1), np.take_along_axis(vals, o, 1)
    return ids, vals


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_is_canonical_is_lexsorts_order(data):
    ids, vals = _rows(data)
    # canonical and free of NaN (a row with NaN is sorted, whatever its order: NaN goes last)
    want = not np.isnan(vals).any() and all(np.array_equal(np.lexsort((ids[j], -vals[j])), np.arange(ids.shape[1]))
                                            for j in range(len(ids)))
    assert is_canonical(ids, vals) == want
    # the keys sort as the definition does
    o = np.argsort(canonical_keys(ids, vals), axis=1)
    for j in range(len(ids)):
        assert np.array_equal(o[j], np.lexsort((ids[j], -vals[j])))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_strictly_descending_means_no_tie_and_no_nan(data):
    _, vals = _rows(data)
    want = all(all(a > b for a, b in zip(r[:-1], r[1:])) for r in vals.tolist())
    assert strictly_descending(vals) == want
