"""SamplerParams: defaults, protocol mapping, and one error (naming the field) per bad value."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clickpaca.sampling import SamplerParamError, SamplerParams, step_names


def test_defaults():
    p = SamplerParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.7, 40, 0.95, 0.0)
    assert (p.penalty_repeat, p.penalty_freq, p.penalty_present, p.penalty_last_n) == (1.0, 0.0, 0.0, 64)
    assert p.logit_bias == () and p.seed is None and p.n_probs == 0
    assert p.samplers == step_names()
    assert p.samplers[0] == "grammar"
    assert p.steps == ("logit_bias", "penalties", "dry", "top_n_sigma", "top_k", "typical_p", "min_p", "top_p",
                       "xtc", "temperature", "dynatemp", "mirostat", "mirostat_v2")
    # llama.cpp's steps are all off by default: the default chain is what it was
    assert (p.dry_multiplier, p.top_n_sigma, p.typical_p, p.xtc_probability, p.dynatemp_range, p.mirostat) == (
        0.0, -1.0, 1.0, 0.0, 0.0, 0)
    assert (p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n, p.dry_sequence_breakers) == (
        1.75, 2, -1, ("\n", ":", '"', "*"))
    assert (p.xtc_threshold, p.dynatemp_exponent, p.mirostat_tau, p.mirostat_eta) == (0.1, 1.0, 5.0, 0.1)


def test_llama_cpp_steps_on_the_wire():
    p = SamplerParams.from_request({
        "dryMultiplier": 0.8, "dryBase": 2, "dryAllowedLength": 3, "dryPenaltyLastN": 128,
        "drySequenceBreakers": ["\n", "###"], "topNSigma": 1.5, "typicalP": 0.9, "xtcProbability": 0.5,
        "xtcThreshold": 0.2, "dynatempRange": 0.3, "dynatempExponent": 2, "mirostat": 2, "mirostatTau": 3,
        "mirostatEta": 0.2, "samplers": ["dry", "topNSigma", "typicalP", "xtc", "dynaTemp", "mirostatV2"]})
    assert p.dry_sequence_breakers == ("\n", "###") and p.dry_base == 2.0 and p.mirostat == 2
    assert p.steps == ("dry", "top_n_sigma", "typical_p", "xtc", "dynatemp", "mirostat_v2")
    assert SamplerParams.from_request(p.to_request()) == p


def test_from_request_maps_camel_case():
    p = SamplerParams.from_request({
        "temperature": 0, "topK": 1, "topP": 0.5, "minP": 0.1, "penaltyRepeat": 1.1,
        "penaltyFreq": 0.2, "penaltyPresent": 0.3, "penaltyLastN": -1,
        "logit_bias": {"5": -1e9, "7": 2.5}, "seed": 42, "nProbs": 3,
        "samplers": ["grammar", "topK", "temperature"],
        "prompt": "ignored: not a sampler field", "maxTokens": 10,
    })
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert (p.top_k, p.top_p, p.min_p) == (1, 0.5, 0.1)
    assert (p.penalty_repeat, p.penalty_freq, p.penalty_present, p.penalty_last_n) == (1.1, 0.2, 0.3, -1)
    assert p.logit_bias == ((5, -1e9), (7, 2.5))
    assert (p.seed, p.n_probs) == (42, 3)
    assert p.samplers == ("grammar", "top_k", "temperature")


def test_logit_bias_forms_and_arrays():
    a = SamplerParams(logit_bias={3: 1.0, 1: -2})
    b = SamplerParams.from_request({"logit_bias": [[1, -2], [3, 1.0]]})
    assert a == b and a.logit_bias == ((1, -2.0), (3, 1.0))
    ids, vals = a.bias_arrays
    assert ids.dtype == np.int32 and ids.tolist() == [1, 3] and vals.tolist() == [-2.0, 1.0]
    assert hash(a) == hash(b)


def test_null_means_default_and_empty_samplers_allowed():
    p = SamplerParams.from_request({"topK": None, "seed": None, "samplers": []})
    assert p.top_k == 40 and p.seed is None and p.samplers == ()


def test_grammar_may_be_left_out_of_samplers():
    assert SamplerParams(samplers=["temperature", "top_k"]).steps == ("temperature", "top_k")


BAD = [
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": True}, "temperature", "number"),
    ({"temperature": math.nan}, "temperature", "finite"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"topK": -1}, "topK", ">= 0"),
    ({"topK": 2.0}, "topK", "integer"),
    ({"topK": True}, "topK", "integer"),
    ({"topP": 1.5}, "topP", "[0, 1]"),
    ({"topP": -0.1}, "topP", "[0, 1]"),
    ({"topP": math.nan}, "topP", "finite"),
    ({"minP": 2}, "minP", "[0, 1]"),
    ({"minP": "x"}, "minP", "number"),
    ({"penaltyRepeat": 0}, "penaltyRepeat", "> 0"),
    ({"penaltyRepeat": -1.0}, "penaltyRepeat", "> 0"),
    ({"penaltyRepeat": math.inf}, "penaltyRepeat", "finite"),
    ({"penaltyFreq": math.nan}, "penaltyFreq", "finite"),
    ({"penaltyPresent": "1"}, "penaltyPresent", "number"),
    ({"penaltyLastN": -2}, "penaltyLastN", ">= -1"),
    ({"penaltyLastN": 1.5}, "penaltyLastN", "integer"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "token id"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias", "token id"),
    ({"logit_bias": [[-3, 1.0]]}, "logit_bias", ">= 0"),
    ({"logit_bias": {"3": math.nan}}, "logit_bias", "NaN"),
    ({"logit_bias": {"3": "big"}}, "logit_bias", "number"),
    ({"logit_bias": {"3": True}}, "logit_bias", "number"),
    ({"logit_bias": [[True, 1.0]]}, "logit_bias", "integer"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias", "pairs"),
    ({"logit_bias": [[1, 1.0], [1, 2.0]]}, "logit_bias", "more than once"),
    ({"logit_bias": {"1": 1.0, "01": 2.0}}, "logit_bias", "more than once"),
    ({"logit_bias": 5}, "logit_bias", "object"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"seed": 1.0}, "seed", "integer"),
    ({"seed": False}, "seed", "integer"),
    ({"nProbs": -1}, "nProbs", ">= 0"),
    ({"nProbs": "5"}, "nProbs", "integer"),
    ({"samplers": "top_k"}, "samplers", "list"),
    ({"samplers": ["top_k", "nucleus"]}, "samplers", "unknown step"),
    ({"samplers": ["top_k", "topK"]}, "samplers", "more than once"),
    ({"samplers": ["top_k", "grammar"]}, "samplers", "'grammar' must come first"),
    ({"samplers": [1]}, "samplers", "unknown step"),
    ({"top_k": 5}, "top_k", "did you mean topK?"),
    ({"dryMultiplier": -1}, "dryMultiplier", ">= 0"),
    ({"dryBase": 0.5}, "dryBase", ">= 1"),
    ({"dryAllowedLength": -1}, "dryAllowedLength", ">= 0"),
    ({"dryPenaltyLastN": -2}, "dryPenaltyLastN", ">= -1"),
    ({"drySequenceBreakers": "\n"}, "drySequenceBreakers", "list of strings"),
    ({"drySequenceBreakers": [""]}, "drySequenceBreakers", "non-empty"),
    ({"drySequenceBreakers": ["x" * 41]}, "drySequenceBreakers", "at most 40"),
    ({"drySequenceBreakers": ["a"] * 65}, "drySequenceBreakers", "at most 64"),
    ({"topNSigma": math.inf}, "topNSigma", "finite"),
    ({"typicalP": 1.5}, "typicalP", "[0, 1]"),
    ({"xtcProbability": -0.1}, "xtcProbability", "[0, 1]"),
    ({"xtcThreshold": 2}, "xtcThreshold", "[0, 1]"),
    ({"dynatempRange": -1}, "dynatempRange", ">= 0"),
    ({"dynatempExponent": -1}, "dynatempExponent", ">= 0"),
    ({"mirostat": 3}, "mirostat", "<= 2"),
    ({"mirostat": 1.0}, "mirostat", "integer"),
    ({"mirostatTau": -1}, "mirostatTau", ">= 0"),
    ({"mirostatEta": "x"}, "mirostatEta", "must be a number, got \"x\""),  # the value as JSON, as every field's
    ({"typ_p": 0.5}, "typ_p", "did you mean typicalP?"),
    ({"dry_multiplier": 0.5}, "dry_multiplier", "did you mean dryMultiplier?"),
    ({"mirostat_tau": 0.5}, "mirostat_tau", "did you mean mirostatTau?"),
    ({"repeat_penalty": 1.1}, "repeat_penalty", "did you mean penaltyRepeat?"),
]


@pytest.mark.parametrize("request_, field, why", BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
def test_bad_values_name_the_field(request_, field, why):
    with pytest.raises(SamplerParamError) as e:
        SamplerParams.from_request(request_)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    assert why in str(e.value)


def test_example_message():
    with pytest.raises(SamplerParamError, match=r"^topP: must be in \[0, 1\], got 1.5$"):
        SamplerParams(top_p=1.5)


def test_constructor_uses_protocol_names_too():
    with pytest.raises(SamplerParamError, match="^penaltyLastN: "):
        SamplerParams(penalty_last_n=-5)


def test_validate_needs_vocab():
    p = SamplerParams(logit_bias={99: 1.0}, n_probs=5)
    assert p.validate(100) is p
    with pytest.raises(SamplerParamError, match=r"^logit_bias: token id 100 out of range \[0, 100\)"):
        SamplerParams(logit_bias={100: 1.0}).validate(100)
    with pytest.raises(SamplerParamError, match="^nProbs: "):
        SamplerParams(n_probs=11).validate(10)
    with pytest.raises(SamplerParamError, match="^logit_bias: "):
        SamplerParams.from_request({"logit_bias": {"10": 1}}, n_vocab=10)


def test_integers_beyond_float_range_are_infinite_not_overflow():
    # only in-process (JSON numbers that large arrive as inf): still a SamplerParamError
    with pytest.raises(SamplerParamError, match="^temperature: must be finite"):
        SamplerParams(temperature=10**400)
    with pytest.raises(SamplerParamError, match="^penaltyFreq: must be finite"):
        SamplerParams(penalty_freq=-10**400)
    assert SamplerParams(logit_bias={1: 10**400, 2: -10**400}).logit_bias == ((1, math.inf), (2, -math.inf))


def test_request_must_be_an_object():
    with pytest.raises(SamplerParamError):
        SamplerParams.from_request([("topK", 1)])


def test_numpy_scalars_accepted():
    p = SamplerParams(top_k=np.int64(5), temperature=np.float32(0.5))
    assert p.top_k == 5 and type(p.top_k) is int and type(p.temperature) is float


@settings(max_examples=150, deadline=None)
@given(
    temperature=st.floats(-2, 5), top_k=st.integers(0, 1000), top_p=st.floats(0, 1),
    min_p=st.floats(0, 1), repeat=st.floats(0.01, 5), freq=st.floats(-2, 2), present=st.floats(-2, 2),
    last_n=st.integers(-1, 500), bias=st.dictionaries(st.integers(0, 1000), st.floats(-1e10, 1e10), max_size=5),
    seed=st.none() | st.integers(0, 2**63), n_probs=st.integers(0, 20),
    samplers=st.permutations(step_names()[1:]).flatmap(lambda s: st.integers(0, len(s)).map(lambda k: s[:k])),
    grammar=st.booleans(),
)
def test_request_round_trip(temperature, top_k, top_p, min_p, repeat, freq, present, last_n, bias, seed,
                            n_probs, samplers, grammar):
    p = SamplerParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, penalty_repeat=repeat,
                      penalty_freq=freq, penalty_present=present, penalty_last_n=last_n, logit_bias=bias,
                      seed=seed, n_probs=n_probs, samplers=(("grammar",) if grammar else ()) + tuple(samplers))
    assert SamplerParams.from_request(p.to_request()) == p


@settings(max_examples=100, deadline=None)
@example(a={"penalty_present": 0}, b={"seed": 3})  # a default given explicitly: the same chain
@given(a=st.dictionaries(st.sampled_from(["temperature", "top_k", "penalty_present", "seed"]),
                         st.integers(0, 3), max_size=4),
       b=st.dictionaries(st.sampled_from(["temperature", "top_k", "penalty_present", "seed"]),
                         st.integers(0, 3), max_size=4))
def test_params_share_a_chain_exactly_when_only_the_seed_differs(a, b):
    """SamplerParams.chain (what a tick groups rows by) is one object for params that
    differ only in the seed, and another as soon as any other value differs."""
    p, q = SamplerParams(**a), SamplerParams(**b)
    d = SamplerParams()
    same = all(a.get(k, getattr(d, k)) == b.get(k, getattr(d, k)) for k in ("temperature", "top_k", "penalty_present"))
    assert (p.chain is q.chain) == same == (p.chain_key == q.chain_key)
    assert p.chain is p.replace(seed=12345).chain
