"""The fast paths of issue 29 against the reference and the per-sequence chain.

- the argmax cut (``cut.upper_ids`` with need 1, no grammar) and the greedy short path
  of ``SequenceSampler.sample`` against the plain whole-vocabulary reference of
  test_sampling_chain (its ``reference``) and against ``apply_chain``;
- both greedy paths against llama.cpp's greedy sampler through the bindings (oracle);
- ``batch.sample_tick`` against one ``sample`` call per sequence: the same results
  (tokens, candidate counts, logprobs) bit for bit, and the same random streams after,
  on one thread and spread over two or three (``workers.run_all``);
- user-defined steps stay on the calling thread.
Rows have exact ties, -inf, NaN and +inf at the top; no model needed.
"""

import threading

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from clickpaca.llama import native
from clickpaca.sampling import SamplerParams, SequenceSampler, apply_chain
from clickpaca.sampling.batch import sample_tick
from clickpaca.sampling.route import plan
from clickpaca.sampling.candidates import raw_logprobs
from clickpaca.sampling.chain import greedy_tail
from clickpaca.sampling.cut import RowView, upper_ids
from clickpaca.sampling.oracle import CSampler

from conftest import TEST_BUILD

from test_sampling_chain import Ambiguous, make_row, reference, window_arrays


def row_of(rng, V, style, drawable=False):
    """test_sampling_chain's rows (many exact ties when coarse), with special values;
    ``drawable``: only those that leave a maximum to pick (no NaN, not all -inf)."""
    row = make_row(rng, V, style).copy()  # make_row's rows are read-only
    special = rng.choice([0, 1, 4, 5]) if drawable else rng.integers(0, 6)
    if special == 1:
        row[rng.integers(0, V, max(1, V // 4))] = -np.inf
    elif special == 2:
        row[:] = -np.inf
    elif special == 3:
        row[rng.integers(0, V)] = np.nan
    elif special == 4:
        row[rng.integers(0, V, 2)] = np.inf
    return row


@st.composite
def greedy_cases(draw):
    V = draw(st.integers(4, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = row_of(rng, V, draw(st.sampled_from(["normal", "coarse", "peaked"])))
    row.flags.writeable = False
    tail = draw(st.lists(st.sampled_from(["top_p", "min_p", "top_n_sigma"]), unique=True))
    if draw(st.booleans()):  # top-k 1 first, with a temperature before or after it
        head = ["top_k"]
        before = ["temperature"] if draw(st.booleans()) else []
        steps = before + head + tail + ([] if before else ["temperature"])
        p = SamplerParams(top_k=1, top_p=draw(st.floats(0, 1)), min_p=draw(st.floats(0, 1)),
                          top_n_sigma=draw(st.sampled_from([-1.0, 0.5, 2.0])),
                          temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 2.5])), samplers=steps)
    else:  # greedy temperature, with truncations before it (skipped) and after it
        pre = draw(st.lists(st.sampled_from(["top_k", "top_p", "min_p"]), unique=True))
        post = [s for s in tail if s not in pre]
        p = SamplerParams(temperature=draw(st.sampled_from([0.0, -1.0])), top_k=draw(st.integers(0, 50)),
                          top_p=draw(st.floats(0, 1)), min_p=draw(st.floats(0, 1)),
                          samplers=pre + ["temperature"] + post)
    return row, p.replace(n_probs=draw(st.sampled_from([0, 0, 3])), seed=draw(st.integers(0, 2**32)))


@settings(max_examples=300, deadline=None)
@given(case=greedy_cases())
def test_greedy_short_path_is_the_reference_and_the_chain(case):
    row, p = case
    V = row.size
    assert greedy_tail(p, False, V) is not None
    got = SequenceSampler(p, V).sample(row)
    # the same as the general chain (which uses the same argmax cut), logprobs included ...
    view = RowView(row)
    cand = apply_chain(row, p, view=view)
    want_tok = -1 if cand.empty_step else cand.sample(float(np.random.default_rng(p.seed).random()))
    assert got.token == want_tok
    if got.token >= 0:
        assert got.n_candidates == cand.size == 1
        if p.n_probs:
            lp, top = raw_logprobs(view, got.token, p.n_probs)
            # repr: a +inf top makes the steered logprob NaN on both paths (NaN != NaN)
            assert repr((got.logprob, got.top)) == repr((lp, top))
            assert repr((got.steered_logprob, got.steered_top)) == repr((cand.logprob(got.token),
                                                                           cand.top(p.n_probs)))
    # ... and the same as the column-maxima cut and the plain reference
    try:
        _, ids, _ = reference(row, p)[-1]
    except Ambiguous:
        assume(False)
    if not np.isnan(row).any():
        finite_top = ids.size == 1 and row[ids[0]] > -np.inf
        assert got.token == (int(ids[0]) if finite_top else -1)


@settings(max_examples=200, deadline=None)
@given(V=st.integers(1, 300), seed=st.integers(0, 2**32 - 1), style=st.sampled_from(["normal", "coarse", "peaked"]),
       n_ex=st.integers(0, 3))
def test_argmax_cut_keeps_what_the_column_cut_keeps_first(V, seed, style, n_ex):
    """upper_ids(view, 1): the canonical first allowed, non-excluded token, as the
    column path finds it (its canonical first), or the column path itself."""
    rng = np.random.default_rng(seed)
    row = row_of(rng, V, style)
    exclude = np.unique(rng.integers(0, V, n_ex)).astype(np.int32)
    fast = upper_ids(RowView(row), 1, None, 1.0, exclude)
    view = RowView(row)
    view._first = -1  # the column path
    slow = upper_ids(view, 1, None, 1.0, exclude)

    def first(ids):
        v = np.fmax(row[ids].astype(np.float64), -np.inf)
        return int(ids[np.lexsort((ids, -v))[0]]) if ids.size else None

    assert first(fast) == first(slow)


# -- the batched tick against per-sequence calls ------------------------------------------

PLANS = [
    dict(top_k=1), dict(temperature=0.0), dict(), dict(top_k=5, top_p=0.5, temperature=1.5),
    dict(top_k=8, top_p=1.0), dict(top_k=3, top_p=0.9, temperature=1.0), dict(top_k=40),
    # not batched: per sequence inside the tick
    dict(n_probs=2), dict(min_p=0.1), dict(top_k=0, top_p=0.9), dict(penalty_present=1.0),
    dict(logit_bias={3: 2.0}), dict(top_k=2, samplers=["temperature", "top_k"]),
]


@st.composite
def ticks(draw):
    V = draw(st.sampled_from([16, 64, 300, 1024]))
    n_out = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    styles = ["normal", "coarse", "peaked"]
    block = np.stack([row_of(rng, V, styles[int(rng.integers(0, 3))]) for _ in range(n_out)])
    block.flags.writeable = False
    n = draw(st.integers(1, 10))
    rows = draw(st.one_of(st.just(list(range(min(n, n_out)))),
                          st.lists(st.integers(0, n_out - 1), min_size=n, max_size=n)))
    specs = [draw(st.sampled_from(PLANS)) for _ in rows]
    masks = []
    for _ in rows:
        if draw(st.integers(0, 4)) == 0:
            allowed = np.zeros((V + 31) // 32 * 32, np.uint8)
            allowed[:V] = rng.random(V) < 0.5
            masks.append(np.packbits(allowed, bitorder="little").view(np.int32))
        else:
            masks.append(None)
    hist = [rng.integers(0, V, int(rng.integers(0, 5))).tolist() for _ in rows]
    return block, rows, specs, masks, hist, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3]))


@settings(max_examples=200, deadline=None)
@given(case=ticks())
def test_sample_tick_equals_per_sequence_calls(case):
    block, rows, specs, masks, hist, n_ticks, threads = case
    V = block.shape[1]
    a = [SequenceSampler(SamplerParams(seed=i, **kw), V, h) for i, (kw, h) in enumerate(zip(specs, hist))]
    b = [s.fork() for s in a]
    for t in range(n_ticks):
        r = [(x + t) % block.shape[0] for x in rows]
        want = [s.sample(block[i], m) for s, i, m in zip(a, r, masks)]
        got = sample_tick(b, block, r, masks, threads=threads)
        assert repr(got) == repr(want)  # repr: bit for bit, NaN logprobs included
        for s, res in zip(a + b, want + got):
            if not res.empty:
                s.accept(res.token)
    # the random streams are where per-sequence calls leave them
    assert [s._rng.random() for s in a] == [s._rng.random() for s in b]


def test_the_plans_that_run_batched():
    V = 262_144

    def batch_plan(p, has_hist, V):  # route.py's decision for the host's batched pass
        return plan(p, has_hist, V).host

    assert batch_plan(SamplerParams(top_k=1), False, V) == ("greedy",)
    assert batch_plan(SamplerParams(temperature=0), False, V) == ("greedy",)
    assert batch_plan(SamplerParams(), False, V) == ("topk", 40, 0.95, 0.7)
    assert batch_plan(SamplerParams(top_p=1.0, temperature=1.0), False, V) == ("topk", 40, None, None)
    for kw in (dict(n_probs=5), dict(trace=True), dict(top_k=0), dict(min_p=0.05), dict(top_k=1000)):
        assert batch_plan(SamplerParams(**kw), False, V) is None, kw
    # penalties count only with a history
    p = SamplerParams(penalty_present=1.0)
    assert batch_plan(p, False, V) is not None and batch_plan(p, True, V) is None


def test_sample_tick_at_the_real_vocabulary():
    """262,144 tokens (32 x 8192 columns): 64 rows, default, greedy and a narrow top-p."""
    V = 262_144
    rng = np.random.default_rng(3)
    block = (rng.standard_normal((16, V)) * 5 - 3).astype(np.float32)
    for i in range(16):
        block[i, rng.choice(V, 24, replace=False)] = block[i].max() + rng.uniform(-6, 2, 24)
    block[5, 7] = block[5].max()  # an exact tie at the top
    block[5, 9] = block[5, 7]
    block.flags.writeable = False
    for kw in (dict(), dict(top_k=1), dict(temperature=0), dict(top_k=20, top_p=0.5, temperature=1.3),
               dict(n_probs=5), dict(top_k=0, top_p=1.0, temperature=0.9), dict(top_k=0, top_p=0.95)):
        a = [SequenceSampler(SamplerParams(seed=i, **kw), V) for i in range(64)]
        b = [s.fork() for s in a]
        c = [s.fork() for s in a]
        rows = [i % 16 for i in range(64)]
        want = [s.sample(block[r]) for s, r in zip(a, rows)]
        assert repr(sample_tick(b, block, rows)) == repr(want), kw
        assert repr(sample_tick(c, block, rows, threads=2)) == repr(want), kw
    # the tie: greedy takes the smaller id
    assert sample_tick([SequenceSampler(SamplerParams(temperature=0), V)], block, [5])[0].token == 7


@pytest.fixture(scope="module")
def nat():
    return native.load(TEST_BUILD)


@settings(max_examples=100, deadline=None)
@given(V=st.integers(2, 2000), seed=st.integers(0, 2**32 - 1), style=st.sampled_from(["normal", "coarse", "peaked"]))
def test_greedy_paths_pick_what_llama_cpps_greedy_sampler_picks(nat, V, seed, style):
    """The short path and the batched tick against llama_sampler_init_greedy on the whole
    row (ids ascending, so its first maximum is the smallest id); rows without NaN."""
    # drawn from the rows the test is for, not filtered (a third of all rows have NaN or
    # no finite maximum: rejecting them risked Hypothesis's filter_too_much health check)
    row = row_of(np.random.default_rng(seed), V, style, drawable=True)
    assert not np.isnan(row).any() and row.max() > -np.inf
    with CSampler(nat, "greedy") as c:
        res = c.apply(np.arange(V, dtype=np.int32), row)
    want = int(res.ids[res.selected])
    assert SequenceSampler(SamplerParams(temperature=0), V).sample(row).token == want
    assert SequenceSampler(SamplerParams(top_k=1), V).sample(row).token == want
    block = row[None, :]
    assert sample_tick([SequenceSampler(SamplerParams(temperature=0), V)], block, [0])[0].token == want


def test_a_failing_user_step_takes_only_its_own_place():
    """isolate: the failing sequence gets its exception, the others their results."""
    from clickpaca.sampling import registry as R

    class Boom(Exception):
        pass

    def run(ids, logits, p, ctx):
        raise Boom("step failed")

    V = 64
    block = np.random.default_rng(0).standard_normal((3, V)).astype(np.float32)
    # made before the registration: their default order does not hold the new step
    ok = [SequenceSampler(SamplerParams(seed=1), V), SequenceSampler(SamplerParams(top_k=1, seed=2), V)]
    R.register(R.Step("boom_29", R.GENERAL, run=run, off=lambda p, h: False))
    try:
        bad = SequenceSampler(SamplerParams(samplers=["boom_29"], seed=3), V)
        want = [s.fork().sample(block[i]) for i, s in enumerate(ok)]
        got = sample_tick([ok[0], bad, ok[1]], block, [0, 2, 1], isolate=(Boom,))
        assert isinstance(got[1], Boom)
        assert [got[0], got[2]] == want
    finally:
        R.unregister("boom_29")


def test_user_steps_run_on_the_calling_thread_and_built_ins_may_not():
    """threads=2: a chain holding a step whose row says it reads shared state
    (``shared_state``: DRY; every user-defined step, which usersteps marks so: it was
    written for the engine thread) is sampled on the calling thread; other chains may
    leave it. The row decides, not the step's name or origin."""
    from clickpaca.sampling import usersteps
    from clickpaca.sampling import registry as R

    seen = []

    V = 512
    block = np.random.default_rng(1).standard_normal((8, V)).astype(np.float32)
    built_in = SamplerParams(top_k=0, top_p=0.9)  # made before the registration: without it
    assert plan(built_in, False, V).thread_safe
    assert not plan(SamplerParams(dry_multiplier=0.8, dry_sequence_breakers=()), True, V).thread_safe

    @usersteps.step("where_29", off=lambda p, h: False)
    def where(ids, logits, p, ctx):
        seen.append(threading.current_thread())
        return ids, logits

    try:
        assert where.step.shared_state and R.step("where_29") is where.step
        user = SamplerParams(samplers=["where_29", "top_k"], seed=0)
        assert not plan(user, False, V).thread_safe
        samplers = [SequenceSampler(user.replace(seed=i), V) for i in range(8)]
        sample_tick(samplers, block, list(range(8)), threads=2)
        assert seen and all(t is threading.current_thread() for t in seen)
    finally:
        R.unregister("where_29")
    R.register(R.Step("plain_29", R.GENERAL, run=lambda ids, logits, p, ctx: (ids, logits),
                      off=lambda p, h: False))  # a row that does not say it: may leave the thread
    try:
        assert plan(SamplerParams(samplers=["plain_29", "top_k"]), False, V).thread_safe
        assert not plan(SamplerParams(samplers=["plain_29", "dry"], dry_multiplier=0.8,
                                      dry_sequence_breakers=()), True, V).thread_safe
    finally:
        R.unregister("plain_29")
