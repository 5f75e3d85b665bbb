"""sampling.candidates: a dense set's draw (``Candidates.sample``), which takes its block
sums without dense_exp's whole-row total, against the draw as it was made with it (the
reference below, the earlier code line for line): the same token and log-normaliser bit
for bit, on rows with NaN, +-inf, exact ties, temperatures, grammar words and touched
tokens. No model needed."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.sampling.candidates import _BLOCK, Candidates, Dense, dense_exp
from clickpaca.sampling.cut import RowView

from test_sampling_chain import make_row, mask_words


def reference_sample(c: Candidates, u: float):
    """(token, lse): the dense draw with dense_exp's total, as before."""
    ref = c._ref()
    if not ref > -math.inf:
        return -1, None
    d = c.dense
    buf, _ = dense_exp(d.view, d.tau, d.words, d.exclude, ref)
    if c.ids.size:
        buf[c.ids] = np.exp(c.logits - ref)
    n = d.view.n
    blocks = np.add.reduceat(buf, np.arange(0, n, _BLOCK), dtype=np.float64)
    cb = np.add.accumulate(blocks)
    total = float(cb[-1])
    if not total > 0 or not math.isfinite(total):
        return -1, None
    lse = ref + math.log(total)
    target = u * total
    b = min(int(np.searchsorted(cb, target, side="right")), cb.size - 1)
    while blocks[b] <= 0:
        b -= 1
    lo = b * _BLOCK
    chunk = buf[lo: lo + _BLOCK]
    within = np.add.accumulate(chunk, dtype=np.float64)
    within += float(cb[b - 1]) if b else 0.0
    j = int(np.searchsorted(within, target, side="right"))
    if j >= chunk.size:
        j = int(np.flatnonzero(chunk > 0)[-1])
    return lo + j, lse


@st.composite
def dense_sets(draw):
    V = draw(st.sampled_from([7, 300, 1024, 3000, 5000]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = make_row(rng, V, draw(st.sampled_from(["normal", "coarse", "peaked"]))).copy()
    special = draw(st.integers(0, 5))
    if special == 1:
        row[rng.integers(0, V, max(1, V // 4))] = -np.inf
    elif special == 2:
        row[rng.integers(0, V, 3)] = np.nan
    elif special == 3:
        row[rng.integers(0, V)] = np.inf
    elif special == 4:
        row[:] = -np.inf
    row.flags.writeable = False
    words = mask_words(rng.random(V) < draw(st.sampled_from([0.05, 0.5, 1.0]))) if draw(st.booleans()) else None
    touched = np.unique(rng.integers(0, V, draw(st.integers(0, 6)))).astype(np.int32)
    tau = draw(st.sampled_from([1.0, 0.7, 1.9]))
    t_logits = (row[touched].astype(np.float64) / tau + rng.uniform(-3, 3, touched.size)) if touched.size else np.empty(0)
    t_logits = np.fmax(t_logits, -np.inf)  # NaN -> -inf, as gather does
    view = RowView(row)
    allowed = V if words is None else int(np.unpackbits(words.view(np.uint8), bitorder="little")[:V].sum())
    d = Dense(view, tau, words, allowed / V, touched, max(1, allowed - touched.size))
    return Candidates(touched, t_logits, dense=d), draw(st.floats(0, 1, exclude_max=True))


@settings(max_examples=300, deadline=None)
@given(case=dense_sets())
def test_dense_draw_without_the_total_is_the_draw_with_it(case):
    c, u = case
    want_tok, want_lse = reference_sample(c, u)
    got = c.sample(u)
    assert got == want_tok
    if want_lse is not None:
        assert repr(c._lse) == repr(want_lse)
