"""clickpaca.sampling.registry: a step added by one row is accepted, checked, documented
and run by the chain with no other change (the way issue #24's steps were added)."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.sampling import SamplerParamError, SamplerParams, SequenceSampler, apply_chain
from clickpaca.sampling import registry as R
from clickpaca.sampling.params import misspellings, protocol_names


def _drop_odd(ids, logits, p, ctx):
    """A general step with no superset hook: keeps the even ids, shifted by ``p.odd_shift``,
    and counts its calls in its state."""
    st = ctx.state(STEP, p)
    st["calls"] += 1
    keep = ids % 2 == 0
    return ids[keep], logits[keep] + p.odd_shift


STEP = R.Step("drop_odd", R.GENERAL, run=_drop_odd, alias="dropOdd",
              params=(R.Param("odd_shift", "oddShift", 0.0, R.real(-5, 5), ("odd_shift",), "test only"),
                      R.Param("odd_on", "oddOn", 0, R.integer(0, 1), (), "1 = on")),
              off=lambda p, has_hist: p.odd_on == 0,
              state=lambda p: {"calls": 0, "seen": []},
              sampled=lambda st, tok, p: st["seen"].append(tok))


@pytest.fixture
def registered():
    R.register(STEP, before="temperature")
    yield STEP
    R.unregister("drop_odd")


def test_a_registered_step_is_a_parameter_a_name_and_a_docs_row(registered):
    p = SamplerParams.from_request({"oddShift": 1.5, "oddOn": 1})
    assert p.odd_shift == 1.5 and p.odd_on == 1
    names = list(p.samplers)
    assert names[names.index("drop_odd") + 1] == "temperature"  # inserted before temperature
    assert SamplerParams(samplers=["dropOdd"]).samplers == ("drop_odd",)
    assert protocol_names()["odd_shift"] == "oddShift" and misspellings()["odd_shift"] == "oddShift"
    with pytest.raises(SamplerParamError, match=r"^oddShift: must be in \[-5, 5\], got 9.0$"):
        SamplerParams.from_request({"oddShift": 9})
    with pytest.raises(SamplerParamError, match=r"unknown field \(did you mean oddShift\?\)$"):
        SamplerParams.from_request({"odd_shift": 1})
    assert "| `oddShift` | drop_odd | 0.0 | test only |" in R.docs_table()
    assert SamplerParams.from_request(p.to_request()) == p


def test_the_chain_runs_it_on_every_candidate_with_state(registered):
    V = 4096
    rng = np.random.default_rng(0)
    row = rng.normal(0, 3, V).astype(np.float32)
    p = SamplerParams(odd_on=1, odd_shift=2.0, top_k=0, top_p=1.0, temperature=1.0, seed=3)
    ids, logits = apply_chain(row, p).materialize()
    assert sorted(ids.tolist()) == list(range(0, V, 2))  # the full set, not a cut
    np.testing.assert_array_equal(logits[np.argsort(ids)], row[::2].astype(np.float64) + 2.0)
    s = SequenceSampler(p, V)
    toks = [s.sample(row).token for _ in range(5)]
    assert all(t % 2 == 0 for t in toks)
    assert s.states["drop_odd"] == {"calls": 5, "seen": toks}
    f = s.fork()
    f.sample(row)
    assert s.states["drop_odd"]["calls"] == 5 and f.states["drop_odd"]["calls"] == 6


def test_names_and_parameters_must_be_new():
    with pytest.raises(ValueError, match="already registered"):
        R.register(R.Step("top_k", R.GENERAL, run=_drop_odd, off=lambda p, h: True))
    with pytest.raises(ValueError, match="already registered"):
        R.register(R.Step("x_new", R.GENERAL, run=_drop_odd, off=lambda p, h: True,
                          params=(R.Param("top_k", "xTopK", 0, R.integer(0)),)))
    with pytest.raises(ValueError, match="touches"):
        R.register(R.Step("x_new", R.ELEMENTWISE, run=_drop_odd, off=lambda p, h: True))
    assert "x_new" not in R.aliases()


def test_the_protocol_reads_the_live_registry():
    """One registry, no copies: a step registered after the protocol was imported is an
    infer field at once (no call to refresh anything), and gone once unregistered."""
    from clickpaca.wire.protocol import REQUESTS, ProtocolError, sampler_fields, validate

    line = {"type": "infer", "seq_id": 0, "prompt": "x", "oddShift": 1.5, "oddOn": 1}
    with pytest.raises(ProtocolError, match="^oddShift: unknown field for infer"):
        validate(line)
    R.register(STEP, before="temperature")
    try:
        assert {"oddShift", "oddOn"} <= set(sampler_fields()) and "oddShift" in REQUESTS["infer"]
        req = validate(line)
        assert (req.params.odd_shift, req.params.odd_on) == (1.5, 1)
        assert "drop_odd" in req.params.samplers
        with pytest.raises(ProtocolError, match=r'^oddShift: must be a number, got "x"$'):
            validate({**line, "oddShift": "x"})
        with pytest.raises(ProtocolError, match=r"^odd_shift: unknown field for infer \(did you mean oddShift\?\)$"):
            validate({"type": "infer", "seq_id": 0, "odd_shift": 1})
    finally:
        R.unregister("drop_odd")
    assert "oddShift" not in sampler_fields() and "oddShift" not in REQUESTS["infer"]
    with pytest.raises(ProtocolError, match="^oddShift: unknown field for infer"):
        validate(line)


def test_no_plan_outlives_the_rows_it_was_made_from():
    """The chain caches its plans by params; a step removed and registered again under
    its name with another row is run as the new row (and says so to the chain's route plan)."""
    from clickpaca.sampling.route import plan

    V = 64
    row = np.zeros(V, np.float32)
    for keep, shared in ((7, False), (9, True)):
        R.register(R.Step("again_38", R.GENERAL, run=lambda ids, logits, p, ctx, k=keep: (ids[ids == k], logits[ids == k]),
                          off=lambda p, h: False, shared_state=shared))
        try:  # equal params both times: the same cache keys
            p = SamplerParams(samplers=["again_38"], temperature=1.0, top_k=0, top_p=1.0, seed=1)
            assert SequenceSampler(p, V).sample(row).token == keep
            assert plan(p, False, V).thread_safe is not shared
        finally:
            R.unregister("again_38")
