"""clickpaca.sampling.table: each row agrees with its step's definition in ``steps``.

The chain trusts the rows: it skips a step the row calls off, treats a step as keeping
everything unless the row says it truncates, and gathers only the ids an elementwise
row says it touches. So each claim is checked here against the definition itself, on
random candidate sets and parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.sampling import DEFAULT_SAMPLERS, SamplerParams
from clickpaca.sampling.registry import StepContext
from clickpaca.sampling.table import (ALIASES, BY_NAME, CONSTRAINT, ELEMENTWISE, EMPTY_REASONS, SCALE,
                                      STEP_NAMES, STEPS, TRUNCATION)

V = 64
RUN = [s for s in STEPS if s.run is not None]

params_st = st.builds(
    SamplerParams,
    temperature=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 3, 40, V]),
    top_p=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    penalty_repeat=st.sampled_from([1.0, 1.3]),
    penalty_freq=st.sampled_from([0.0, 0.5]),
    penalty_present=st.sampled_from([0.0, -0.25]),
    penalty_last_n=st.sampled_from([0, 8, -1]),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.sampled_from([-1e9, -2.0, 3.0, 1e9]), max_size=4),
    dry_multiplier=st.sampled_from([0.0, 0.8]),
    dry_allowed_length=st.sampled_from([1, 2]),
    dry_penalty_last_n=st.sampled_from([-1, 0, 16]),
    dry_sequence_breakers=st.just(()),  # breakers need a vocabulary: tests/test_sampling_oracle.py
    top_n_sigma=st.sampled_from([-1.0, 0.5, 2.0]),
    typical_p=st.sampled_from([0.2, 0.9, 1.0]),
    xtc_probability=st.sampled_from([0.0, 0.5, 1.0]),
    xtc_threshold=st.sampled_from([0.05, 0.1, 0.6]),
    dynatemp_range=st.sampled_from([0.0, 0.5]),
    mirostat=st.sampled_from([0, 1, 2]),
    mirostat_tau=st.sampled_from([1.0, 5.0]),
)


def ctx_for(seed: int, params: SamplerParams) -> StepContext:
    """What SequenceSampler passes: the penalty window, a context history, the vocab size."""
    rng = np.random.default_rng(seed + 2)
    tokens = rng.integers(0, 6, rng.integers(0, 30)).tolist()  # few distinct ids: repeats happen
    return StepContext(history(seed, params), tokens, n_vocab=V, seed=seed)


def candidates(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(V)[: rng.integers(1, V + 1)].astype(np.int32)
    logits = np.round(rng.normal(0, 3, ids.size), 1)  # rounded: ties happen
    return ids, logits


def history(seed: int, params: SamplerParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts) of a penalty window; empty when the penalties are inactive, as
    ``SequenceSampler`` passes it."""
    if not params.penalties_active:
        return np.empty(0, np.int32), np.empty(0, np.float64)
    rng = np.random.default_rng(seed + 1)
    ids, counts = np.unique(rng.integers(0, V, rng.integers(0, 12)), return_counts=True)
    return ids.astype(np.int32), counts.astype(np.float64)


def test_the_table_is_the_default_order_and_the_accepted_names():
    assert STEP_NAMES == DEFAULT_SAMPLERS == tuple(BY_NAME)
    assert STEPS[0].kind == CONSTRAINT and all(s.kind != CONSTRAINT for s in STEPS[1:])
    for spelling, name in ALIASES.items():
        assert SamplerParams(samplers=[spelling]).samplers == (name,)
    assert len({s.alias for s in STEPS if s.alias}) == sum(1 for s in STEPS if s.alias)
    for s in STEPS:
        assert (s.touches is not None) == (s.kind == ELEMENTWISE), s.name
        assert s.cut is None or s.kind in (TRUNCATION, SCALE), s.name  # a cut is optional
        assert (s.sampled is None) or s.stateful, s.name
        assert (s.run is None) == (s.kind == CONSTRAINT), s.name
    assert set(EMPTY_REASONS) <= set(STEP_NAMES) | {"sample"}


@pytest.mark.parametrize("step", RUN, ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_off_means_identity(step, params, seed):
    ids, logits = candidates(seed)
    hist = history(seed, params)
    if not step.off(params, hist[0].size > 0):
        return
    out_ids, out_logits = step.run(ids, logits, params, ctx_for(seed, params))
    assert np.array_equal(out_ids, ids) and np.array_equal(out_logits, logits)


@pytest.mark.parametrize("step", RUN, ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_no_truncation_keeps_every_candidate(step, params, seed):
    ids, logits = candidates(seed)
    if step.kind == ELEMENTWISE or step.truncates(params, ids.size):
        return  # elementwise steps may ban (logit_bias): checked below
    out_ids, _ = step.run(ids, logits, params, ctx_for(seed, params))
    assert sorted(out_ids.tolist()) == sorted(ids.tolist())


@pytest.mark.parametrize("step", [s for s in STEPS if s.kind == ELEMENTWISE], ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_elementwise_changes_only_what_it_touches(step, params, seed):
    ids, logits = candidates(seed)
    hist = history(seed, params)
    touched = step.touches(params, ctx_for(seed, params))
    assert np.array_equal(touched, np.unique(touched))  # sorted, unique
    out_ids, out_logits = step.run(ids, logits, params, ctx_for(seed, params))
    before = dict(zip(ids.tolist(), logits.tolist()))
    after = dict(zip(out_ids.tolist(), out_logits.tolist()))
    untouched = set(before) - set(touched.tolist())
    forced = step.name == "logit_bias" and any(
        b >= 1e9 and t in before for t, b in params.logit_bias)
    if forced:  # a forced token drops every other candidate
        assert set(after) <= set(touched.tolist())
        return
    assert untouched <= set(after)
    assert all(after[t] == before[t] for t in untouched)


def test_docs_table_is_generated_from_the_rows():
    from pathlib import Path

    from clickpaca.sampling import registry

    doc = (Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    block = doc.split("<!-- sampler-table:start -->\n", 1)[1].split("\n<!-- sampler-table:end -->", 1)[0]
    assert block == registry.docs_table()
    for p in registry.all_params():
        assert f"| `{p.wire}` |" in block
