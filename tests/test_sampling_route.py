"""sampling/route.py: the one decision of a row's path, and its typed reasons.

The fast path's property tests (tests/test_sampling_fastpath.py) hold `route` to the
registry's rows over drawn chains; here: every reason the pre-selection gives is a
`Fallback`, a row asked for beside others goes to the host, the result's path text, and
`FastStats` counting typed reasons into keys the done event's JSON encodes.
"""

from __future__ import annotations

import numpy as np
import orjson

from clickpaca.llama.presample import RowOrder, reference
from clickpaca.sampling import SamplerParams, SequenceSampler
from clickpaca.sampling import fastpath as F
from clickpaca.sampling import route as R
from clickpaca.sampling.chain import SampleResult

V = 3000


def test_route_is_none_for_a_chain_of_preselected_steps_and_typed_otherwise():
    s = SequenceSampler(SamplerParams(top_k=40, top_p=0.9, temperature=0.7), V)
    assert R.route(s, grammar=False) is None
    assert R.route(s, grammar=False, rows=2) is R.MORE_THAN_ONE_ROW
    traced = R.route(SequenceSampler(SamplerParams(trace=True), V), grammar=False)
    assert traced is R.TRACE and isinstance(traced, R.Fallback)
    dry = R.route(SequenceSampler(SamplerParams(dry_multiplier=0.8), V), grammar=False)
    assert isinstance(dry, R.Fallback) and dry == "dry"
    dense = R.route(SequenceSampler(SamplerParams(top_k=0, top_p=1.0, logit_bias={5: 1.0}), V), grammar=False)
    assert dense is R.DENSE_TOUCHED


def test_a_refusal_after_the_decode_is_a_fallback():
    """A truncation past the K best: fastpath.sample gives back PAST_K itself, nothing drawn."""
    row = np.linspace(0.0, 1.0, V, dtype=np.float32)  # a flat row: a top-p 0.99 nucleus of thousands
    s = SequenceSampler(SamplerParams(top_k=0, top_p=0.99, min_p=0.0), V)
    u = s.peek()
    got = F.sample(s, reference(row, F.order(s, None)), None)
    assert got is R.PAST_K and s.peek() == u


def test_the_path_text_and_the_counts():
    assert R.path(None) == "graph"
    assert R.path(R.PAST_K) == "host: truncation reaches past the K best"
    stats = F.FastStats()
    stats.took(SampleResult(1, path="graph"))
    stats.took(SampleResult(1, path=R.path(R.PAST_K), fallback=R.PAST_K))
    stats.took(SampleResult(1))  # a host result no fallback was given for
    assert stats.as_event() == {"graph": 1, "host": 2, "reasons": {R.PAST_K: 1, "host": 1}}
    # the done event is encoded by orjson, which takes no str subclass as a key
    assert all(type(k) is str for k in stats.as_event()["reasons"])
    orjson.dumps(stats.as_event())


def test_past_k_widens_the_sequences_k_up_to_k_max():
    stats = F.FastStats()
    stats.widen(R.NO_MASS)
    assert stats.k == F.K_MIN
    for _ in range(10):
        stats.widen(R.PAST_K)
    assert stats.k == F.K_MAX


def test_an_order_is_what_route_allowed():
    s = SequenceSampler(SamplerParams(top_k=40), V)
    assert R.route(s, grammar=False) is None
    assert isinstance(F.order(s, None), RowOrder)


def test_a_pre_selected_rows_pass_is_one_object_per_chain():
    """Plan.tick: the batched pass of fastpath.sample_tick a row takes (greedy, top-k, a
    dense draw; None: per row), the same object for every sequence of a chain (a tick
    groups its rows by it), whatever the seed. `plan` takes params, has history and the
    vocabulary; `tick` what the order asked: masked, touched, mass, raw, dense."""
    greedy = [SequenceSampler(SamplerParams(temperature=0.0, seed=i), V) for i in range(2)]
    a, b = (R.plan(s.params, s.penalizes, V).tick(False, False, False, False, False) for s in greedy)
    assert a is b and tuple(a) == ("greedy",)
    topk = SequenceSampler(SamplerParams(top_k=5, top_p=0.95, min_p=0.0, temperature=0.7), V)
    t = R.plan(topk.params, topk.penalizes, V).tick(False, False, True, False, False)
    assert t is not None and t[0] == "topk" and t is not a
    dense = SequenceSampler(SamplerParams(top_k=0, top_p=1.0, temperature=0.9), V)
    d = R.plan(dense.params, dense.penalizes, V).tick(False, False, True, False, True)
    assert d is not None and d[0] == "dense"
    assert R.plan(dense.params, dense.penalizes, V).tick(True, False, True, False, True) is None  # masked
