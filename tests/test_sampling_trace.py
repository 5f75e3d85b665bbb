"""clickpaca.sampling.trace: what every step did to a sampled token, changing nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clickpaca.sampling import SamplerParamError, SamplerParams, SequenceSampler

V = 5000


def rows(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = (rng.standard_normal(V) * 3).astype(np.float32)
        r[rng.integers(0, V, 5)] += 8
        out.append(r)
    return out


PARAMS = [
    SamplerParams(seed=1),
    SamplerParams(seed=2, mirostat=2, mirostat_tau=3.0, top_k=0, top_p=1.0, temperature=1.0),
    SamplerParams(seed=3, xtc_probability=0.5, xtc_threshold=0.05, typical_p=0.9, top_n_sigma=2.0,
                  dry_multiplier=1.0, dry_sequence_breakers=()),
    SamplerParams(seed=4, mirostat=1, dynatemp_range=0.5, penalty_repeat=1.3, top_k=0),
]


@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_trace_changes_nothing(p):
    hist = list(range(30)) * 2
    plain, traced = SequenceSampler(p, V, hist), SequenceSampler(p.replace(trace=True), V, hist)
    for r in rows(12):
        a, b = plain.sample(r), traced.sample(r)
        assert a.token == b.token and a.trace is None and b.trace is not None
        plain.accept(a.token)
        traced.accept(b.token)
    assert plain.states == traced.states  # mirostat's mu, the same after the same tokens


@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_trace_entries_agree_with_the_result(p):
    s = SequenceSampler(p.replace(trace=True, n_probs=1), V, list(range(30)) * 2)
    for r in rows(6, seed=1):
        res = s.sample(r)
        tr = res.trace
        names = [e["step"] for e in tr["steps"]]
        assert names[0] == "model" and names[1:] == [n for n in p.steps if n in names]
        assert tr["steps"][0]["n"] == V and tr["argmax"] == int(np.argmax(r))
        last = tr["steps"][-1]
        assert last["n"] == res.n_candidates
        assert math.isclose(last["p"], math.exp(res.steered_logprob), rel_tol=1e-5)
        assert math.isclose(tr["steps"][0]["p"], math.exp(res.logprob), rel_tol=1e-4)
        ns = [e["n"] for e in tr["steps"]]
        assert ns == sorted(ns, reverse=True)  # steps only ever remove candidates
        for e in tr["steps"]:
            assert e["rank"] is not None and 0 <= e["rank"] < e["n"] and 0 < e["p"] <= 1 and e["entropy"] >= 0
        s.accept(res.token)


def test_which_step_removed_the_top_token():
    r = rows(1)[0]
    top = int(np.argmax(r))
    s = SequenceSampler(SamplerParams(seed=0, trace=True, logit_bias={top: -1e9}), V)
    tr = s.sample(r).trace
    assert tr["argmax"] == top and tr["argmax_removed_by"] == "logit_bias"
    gone = [e["step"] for e in tr["steps"]]
    assert gone.index("logit_bias") == 1
    s = SequenceSampler(SamplerParams(seed=0, trace=True, xtc_probability=1.0, xtc_threshold=0.01), V)
    tr = s.sample(r).trace
    assert tr["argmax_removed_by"] == "xtc"  # XTC removes the top choices by design
    tr = SequenceSampler(SamplerParams(seed=0, trace=True, temperature=0), V).sample(r).trace
    assert tr["argmax_removed_by"] is None and tr["steps"][-1] == {
        "step": "temperature", "n": 1, "entropy": 0.0, "rank": 0, "p": 1.0}


def test_trace_is_a_boolean():
    with pytest.raises(SamplerParamError, match="^trace: must be true or false"):
        SamplerParams.from_request({"trace": 1})
