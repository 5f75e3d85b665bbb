"""The pre-selection's own graph (llama/presample/graph.py) on ggml's CPU backend, held
to the fast path's contract against the host path on rows hypothesis draws.

tests/test_sampling_fastpath.py states the contract and checks it on
`presample.reference`, the ops' numpy twin; tests/test_presample.py holds the graph to
that twin on the rows a model writes for a few prompts. Here `standalone.preselect`
runs graph.build and graph.fill on a ggml context of their own over drawn rows (every
row of a tick in one graph, at the largest K rounded up as a new graph is, each read back
at its own), and the same properties run on what it hands back:

- one sequence, a few tokens (`fast_vs_host`): orders from every preselected step in
  random orders, K, grammar masks, biases at the edge of the K best, rows with ties,
  -inf, NaN;
- a tick of several sequences (`tick_vs_host`, `touched_tick`): one graph for all rows;
- the packs themselves against the reference (test_presample's `_check`) for drawn
  orders on rows of finite values, and each row's pack bit for bit the one it gets alone
  in a graph.

Greedy rows alone in a graph take their one id from a top-k of 1, not from ggml's
argmax (which on the CPU backend keeps the last of equal maxima, not the smallest id):
`test_a_greedy_tick_takes_the_first_of_equal_maxima` holds that case on its own.

Needs the build's library, not the model.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_presample import _check, _same_pack
from test_sampling_fastpath import (BIASES, DENSITIES, STYLES, TICK_CHAINS, VOCABS, chains, fast_vs_host, make_row,
                                    near_boundary_is_rare, params_of, report_tally, rows_and_masks, tick_vs_host,
                                    touched_chains, touched_tick, wide_chains)

from clickpaca.llama import native
from clickpaca.llama.presample import RowOrder
from clickpaca.llama.presample.standalone import preselect
from clickpaca.sampling import SamplerParams, SequenceSampler
from clickpaca.sampling import fastpath as F
from clickpaca.sampling.bench import random_mask

__all__ = ["near_boundary_is_rare", "report_tally"]  # the contract's fixtures, used here too


@pytest.fixture(scope="module")
def by_graph():
    """Rows and orders of one decode to their pre-selections, by the graph's own ops."""
    nat = native.load()

    def run(rows, orders):
        with np.errstate(invalid="ignore"):
            return preselect(nat, np.stack(rows), orders)
    return run


@settings(max_examples=120, deadline=None)
@given(V=VOCABS, source=st.integers(0, 2**32 - 1), style=st.sampled_from(STYLES), density=DENSITIES,
       chain=st.one_of(chains(), wide_chains()), k=st.sampled_from([F.K_MIN, F.K_MIN, 8, 16, 200]),
       ticks=st.integers(1, 3), batched=st.booleans())
def test_the_graph_is_the_host_path(by_graph, V, source, style, density, chain, k, ticks, batched):
    rows, masks = rows_and_masks(source, V, [style] * ticks, density)
    p, history = params_of(chain, rows[0])
    fast_vs_host(p, history, rows, masks, k, batched, preselect=by_graph)


@settings(max_examples=60, deadline=None)
@given(V=st.sampled_from([3000, 5001]), source=st.integers(0, 2**32 - 1),
       specs=st.lists(st.tuples(st.sampled_from(range(len(TICK_CHAINS))),
                                st.sampled_from(["synthetic", "ties", "flat", "neg_inf"]),
                                st.integers(0, 2**32), st.sampled_from([6, 9, 16, F.K_MIN])), min_size=2, max_size=8))
def test_a_tick_in_one_graph_is_each_ones_host_path(by_graph, V, source, specs):
    rows, _ = rows_and_masks(source, V, [style for _, style, _, _ in specs], None)
    params = [SamplerParams(**TICK_CHAINS[c], seed=seed) for c, _, seed, _ in specs]
    tick_vs_host(V, rows, params, [k for _, _, _, k in specs], preselect=by_graph)


@settings(max_examples=60, deadline=None)
@given(V=st.sampled_from([3000, 5001, 32000]), source=st.integers(0, 2**32 - 1),
       specs=st.lists(st.tuples(touched_chains(), st.sampled_from(["synthetic", "ties", "flat", "neg_inf", "nan"]),
                                st.sampled_from([8, 16, F.K_MIN]),
                                st.one_of(st.none(), st.tuples(st.sampled_from([b for b in BIASES if b < 1e9]),
                                                               st.sampled_from([-1, 0, 1])))),
                      min_size=1, max_size=6))
def test_a_tick_with_touched_tokens_in_one_graph_is_each_ones_host_path(by_graph, V, source, specs):
    rows, _ = rows_and_masks(source, V, [style for _, style, _, _ in specs], None)
    touched_tick(V, rows, [c for c, _, _, _ in specs], [k for _, _, k, _ in specs], [e for _, _, _, e in specs],
                 preselect=by_graph)


@st.composite
def orders(draw, V: int, rng: np.random.Generator) -> RowOrder:
    """A row's order as the fast path makes them: K, masses, a temperature, touched ids, a
    dense draw's uniform, the raw row's own best, a grammar mask."""
    k = draw(st.sampled_from([1, 2, 8, 40, 64, 100]))
    mass = k > 1 or draw(st.booleans())
    touched = np.unique(rng.choice(V, draw(st.integers(0, 20)), replace=False)).astype(np.int32)
    density = draw(st.sampled_from([None, None, 0.02, 0.5]))
    return RowOrder(k=k, mass=mass, inv_tau=draw(st.sampled_from([1.0, 1 / 0.7, 2.0, 10.0, 1 / 1.3])),
                    touched=touched, u=draw(st.sampled_from([None, 0.0001, 0.3, 0.999])) if mass else None,
                    raw=mass and draw(st.booleans()),
                    mask=None if density is None else random_mask(rng, V, density).view(np.uint8))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), V=st.sampled_from([3000, 4097, 5001, 32000]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 5))
def test_packs_equal_the_reference_whatever_shares_the_graph(by_graph, data, V, seed, n):
    """Each row's pack against presample.reference (ids up to ties at the K-th value,
    values and tops bit for bit, masses within test_presample's bound), and bit for bit
    the pack it gets alone in a graph."""
    rng = np.random.default_rng(seed)
    # finite rows: -inf where the grammar allows tokens would tie them with the disallowed
    # ones, which _check's rules for real rows do not cover (the contract above does)
    rows = [make_row(rng, V, data.draw(st.sampled_from(["synthetic", "ties", "flat"]))) for _ in range(n)]
    os_ = [data.draw(orders(V, rng)) for _ in range(n)]
    together = by_graph(rows, os_)
    for row, o, pre in zip(rows, os_, together):
        _check(pre, row, o)
        _same_pack(pre, by_graph([row], [o])[0])


def test_a_greedy_tick_takes_the_first_of_equal_maxima():
    """Greedy rows alone in a graph: the one id must be the smallest of equal maxima, as
    the host's greedy (and llama.cpp's) takes it; ggml's CPU argmax would give 4096."""
    V = 4097
    row = np.zeros(V, np.float32)
    row[[7, 300, 4096]] = 5.0
    s = SequenceSampler(SamplerParams(temperature=0.0), V)
    pre = preselect(native.load(), row[None], [F.order(s, None)])[0]
    assert pre.first and pre.ids.tolist() == [7]
    assert F.sample(s, pre, None).token == SequenceSampler(SamplerParams(temperature=0.0), V).sample(row).token == 7
