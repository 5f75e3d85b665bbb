"""The composed chain against a plain reference over the whole vocabulary.

``reference`` below is the specification written for clarity, not speed: a full-length
logit array plus an ``alive`` mask, full sorts, Python loops over bias and penalty
entries. The chain must produce the same candidate set (and logits) after every step,
on tiny vocabularies with the fast paths forced on, and at the real 262,144.
"""

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from clickpaca.sampling import SamplerParams, SequenceSampler, apply_chain
from clickpaca.sampling.bitmask import as_words
from clickpaca.sampling.cut import RowView

STEPS = ("logit_bias", "penalties", "top_k", "min_p", "top_p", "temperature")


class Ambiguous(Exception):
    """A float lands on a threshold: rounding, not the definition, decides the result."""


def reference(row, params, allowed=None, history=(), tol=1e-6):
    """[(step, alive ids, logits over the whole vocab)] after the grammar and each step.

    Definitions (default order grammar, logit_bias, penalties, top_k, min_p, top_p,
    temperature; the grammar always first):
      grammar: drop tokens the mask forbids.
      logit_bias: if any alive token has bias >= 1e9, keep only those (logits unchanged,
        but -inf raised to -1e30 so forcing wins);
        else drop tokens with bias <= -1e9 and add the bias to the others.
      penalties: for each alive token seen c > 0 times in the last N history tokens:
        x = x / repeat if x > 0 else x * repeat; x -= c * freq + present.
      top_k: keep the k first in (logit desc, id asc) order, when 0 < k < alive.
      min_p: keep exp(x - max) >= p, when p > 0.
      top_p: keep the shortest prefix of (logit desc, id asc) with cumulative prob >= p.
      temperature: t > 0 divides; t <= 0 keeps the argmax (smallest id).
    """
    V = row.size
    lg = row.astype(np.float64)
    alive = np.ones(V, bool) if allowed is None else allowed.copy()
    trace = [("grammar", np.flatnonzero(alive), lg.copy())]
    n = params.penalty_last_n
    window = [] if n == 0 else list(history) if n < 0 else list(history)[max(0, len(history) - n):]
    counts = Counter(window)
    bias = dict(params.logit_bias)

    def canonical(ids):
        return ids[np.lexsort((ids, -lg[ids]))]

    for step in params.steps:
        ids = np.flatnonzero(alive)
        if ids.size == 0:
            break
        if step == "logit_bias":
            forced = [t for t, b in bias.items() if b >= 1e9 and alive[t]]
            if forced:
                alive[:] = False
                alive[forced] = True
                lg[forced] = np.maximum(lg[forced], -1e30)
            else:
                for t, b in bias.items():
                    if alive[t]:
                        if b <= -1e9:
                            alive[t] = False
                        else:
                            lg[t] = lg[t] + b
        elif step == "penalties":
            for t, c in counts.items():
                if alive[t]:
                    x = float(lg[t])
                    x = x / params.penalty_repeat if x > 0 else x * params.penalty_repeat
                    lg[t] = x - (c * params.penalty_freq + params.penalty_present)
        elif step == "top_k":
            if 0 < params.top_k < ids.size:
                alive[canonical(ids)[params.top_k:]] = False
        elif step == "min_p":
            m = lg[ids].max()
            if params.min_p > 0 and np.isfinite(m) and ids.size > 1:
                r = np.exp(lg[ids] - m)
                if np.any(np.abs(r - params.min_p) <= 1e-12 * params.min_p):
                    raise Ambiguous
                alive[ids[r < params.min_p]] = False
        elif step == "top_p":
            m = lg[ids].max()
            if params.top_p < 1 and np.isfinite(m) and ids.size > 1:
                order = canonical(ids)
                e = np.exp(lg[order] - m)
                z = e.sum()
                cum = np.cumsum(e)
                target = params.top_p * z
                cut = int(np.argmax(cum >= target)) if cum[-1] >= target else ids.size - 1
                if abs(cum[cut] - target) <= tol * z or (cut and abs(cum[cut - 1] - target) <= tol * z):
                    raise Ambiguous  # the cut itself sits on the boundary
                alive[order[cut + 1:]] = False
        elif step == "temperature":
            if params.temperature > 0:
                lg = lg / params.temperature
            else:
                best = canonical(ids)[0]
                alive[:] = False
                alive[best] = True
        trace.append((step, np.flatnonzero(alive), lg.copy()))
    return trace


def reference_sample(ids, logits, u, tol=1e-9):
    """Inverse CDF over the candidates in id order: first token whose cumulative mass > u*Z."""
    order = np.argsort(ids)
    ids, logits = ids[order], logits[order]
    m = logits.max()
    if not m > -np.inf:
        return -1
    c = np.cumsum(np.exp(logits - m))
    j = int(np.argmax(c > u * c[-1]))
    if abs(c[j] - u * c[-1]) <= tol * c[-1] or (j and abs(c[j - 1] - u * c[-1]) <= tol * c[-1]):
        raise Ambiguous
    return int(ids[j])


def make_row(rng, V, style, neg_inf=False):
    if style == "coarse":
        row = np.round(rng.standard_normal(V) * 2) / 2  # many exact ties
    elif style == "peaked":
        row = rng.standard_normal(V) * 2
        row[rng.integers(0, V, 4)] += rng.uniform(5, 12, 4)
    else:
        row = rng.standard_normal(V) * rng.choice([0.3, 1.0, 4.0])
    row = row.astype(np.float32)
    if neg_inf:
        row[rng.integers(0, V, max(1, V // 10))] = -np.inf
    row.flags.writeable = False  # any write by the sampler would raise
    return row


def mask_words(allowed):
    V = allowed.size
    padded = np.zeros((V + 31) // 32 * 32, np.uint8)
    padded[:V] = allowed
    return np.packbits(padded, bitorder="little").view(np.int32)


def window_arrays(params, V, history):
    return SequenceSampler(params, V, history).penalty_window()


bias_values = st.one_of(st.floats(-8, 8), st.sampled_from([-1e9, 1e9, -math.inf, 2e9]))


@st.composite
def cases(draw, max_v=300):
    V = draw(st.integers(8, max_v))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = make_row(rng, V, draw(st.sampled_from(["normal", "coarse", "peaked"])), draw(st.booleans()))
    order = list(draw(st.permutations(STEPS)))
    steps = order[: draw(st.integers(0, len(STEPS)))] if draw(st.booleans()) else list(STEPS)
    params = SamplerParams(
        temperature=draw(st.one_of(st.sampled_from([0.0, -1.0, 0.7, 1.0]), st.floats(0.05, 3))),
        top_k=draw(st.one_of(st.integers(0, 5), st.integers(0, V + 5))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0, 1))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0, 1))),
        penalty_repeat=draw(st.sampled_from([1.0, 1.3, 0.7])),
        penalty_freq=draw(st.sampled_from([0.0, 0.5, -0.2])),
        penalty_present=draw(st.sampled_from([0.0, 1.0])),
        penalty_last_n=draw(st.sampled_from([-1, 0, 1, 5, 64])),
        logit_bias=draw(st.dictionaries(st.integers(0, V - 1), bias_values, max_size=6)),
        samplers=["grammar", *steps] if draw(st.booleans()) else steps,
    )
    history = draw(st.lists(st.integers(0, min(V - 1, 20)) | st.integers(0, V - 1), max_size=40))
    density = draw(st.sampled_from([None, None, 0.0, 0.03, 0.3, 0.9, 1.0]))
    allowed = None if density is None else rng.random(V) < density
    fast = dict(
        view=RowView(row, cols=draw(st.integers(1, 32)), dense_frac=draw(st.sampled_from([0.25, 2.0]))),
        explicit_max=draw(st.sampled_from([0, 4096])),
    )
    return row, params, allowed, history, fast


def check_against_reference(row, params, allowed, history, fast, u=None):
    V = row.size
    try:
        trace = reference(row, params, allowed, history)
    except Ambiguous:
        assume(False)
    words = None if allowed is None else as_words(mask_words(allowed), V)
    hist = window_arrays(params, V, history)
    for j, (step, ids, lg) in enumerate(trace):
        p = params.replace(samplers=params.steps[:j])
        view = RowView(row, cols=fast["view"].cols, dense_frac=fast["view"].dense_frac)
        cand = apply_chain(row, p, words, hist, view=view, explicit_max=fast["explicit_max"])
        if ids.size == 0:
            assert cand.empty_step == step, (j, step, cand.empty_step)
            return None
        assert cand.empty_step is None, (j, step)
        got_ids, got_lg = cand.materialize()
        o = np.argsort(got_ids)
        assert got_ids[o].tolist() == ids.tolist(), (j, step)
        np.testing.assert_array_equal(got_lg[o], lg[ids], err_msg=f"after {step}")
        last = (cand, ids, lg)
    cand, ids, lg = last
    if u is not None:
        try:
            want = reference_sample(ids, lg[ids], u, tol=1e-5 if cand.dense is not None else 1e-12)
        except Ambiguous:
            return None
        assert cand.sample(u) == want
    return last


@settings(max_examples=150, deadline=None)
@given(case=cases(), u=st.floats(0, 1, exclude_max=True))
def test_chain_matches_reference_after_every_step(case, u):
    row, params, allowed, history, fast = case
    before = np.array(row)
    check_against_reference(row, params, allowed, history, fast, u)
    assert np.array_equal(row, before, equal_nan=True)


@settings(max_examples=80, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**32), data=st.data())
def test_sampled_tokens_respect_grammar_bans_and_forces(case, seed, data):
    row, params, allowed, history, _ = case
    V = row.size
    forced = data.draw(st.lists(st.integers(0, V - 1), max_size=3, unique=True))
    banned = data.draw(st.lists(st.integers(0, V - 1), max_size=3, unique=True))
    bias = {t: 1e9 for t in forced}
    bias.update({t: -1e9 for t in banned if t not in bias})
    if allowed is not None:  # grammar-forbidden tokens with a huge bias stay forbidden
        bias.update({int(t): 1e9 for t in np.flatnonzero(~allowed)[:2]})
    p = SamplerParams(**{**{k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "min_p")},
                         "logit_bias": bias, "seed": seed})
    s = SequenceSampler(p, V, history)
    res = s.sample(row, None if allowed is None else mask_words(allowed))
    ok = np.ones(V, bool) if allowed is None else allowed
    live_forced = [t for t, b in bias.items() if b >= 1e9 and ok[t]]
    if res.empty:
        assert not live_forced
        assert res.reason
        return
    assert ok[res.token], "grammar-forbidden token sampled"
    if live_forced:
        assert res.token in live_forced
    else:
        assert bias.get(res.token, 0) > -1e9, "banned token sampled"


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_greedy_is_argmax_after_bias_and_penalties(case):
    row, params, allowed, history, fast = case
    p = SamplerParams(**{k: getattr(params, k) for k in (
        "temperature", "top_p", "min_p", "penalty_repeat", "penalty_freq", "penalty_present",
        "penalty_last_n", "logit_bias")}, top_k=1)
    try:
        _, ids, lg = reference(row, SamplerParams(**{**{k: getattr(p, k) for k in (
            "penalty_repeat", "penalty_freq", "penalty_present", "penalty_last_n", "logit_bias")},
            "samplers": ["logit_bias", "penalties"]}), allowed, history)[-1]
    except Ambiguous:
        assume(False)
    s = SequenceSampler(p, row.size, history)
    res = s.sample(row, None if allowed is None else mask_words(allowed))
    if ids.size == 0:
        assert res.empty
        return
    best = ids[np.lexsort((ids, -lg[ids]))][0]
    if lg[best] == -np.inf:
        assert res.empty
    else:
        assert res.token == best


@settings(max_examples=60, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**63))
def test_same_seed_same_tokens(case, seed):
    row, params, allowed, history, _ = case
    V = row.size
    p = SamplerParams(**{**{k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "min_p",
                                                             "penalty_repeat", "penalty_last_n")},
                         "seed": seed})
    mask = None if allowed is None else mask_words(allowed)
    runs = []
    for _ in range(2):
        s = SequenceSampler(p, V, history)
        toks = []
        for i in range(5):
            r = s.sample(np.roll(row, i), mask)
            if r.empty:
                break
            toks.append(r.token)
            s.accept(r.token)
        runs.append(toks)
    assert runs[0] == runs[1]


def test_reordering_temperature_and_top_p_changes_the_set_as_defined():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    row.flags.writeable = False
    base = dict(temperature=0.5, top_k=0, top_p=0.5, min_p=0.0)
    after = SamplerParams(**base, samplers=["top_p", "temperature"])   # top-p on T=1: {0, 1}
    before = SamplerParams(**base, samplers=["temperature", "top_p"])  # sharper first: {0}
    a = apply_chain(row, after).materialize()[0]
    b = apply_chain(row, before).materialize()[0]
    assert sorted(a.tolist()) == [0, 1] and sorted(b.tolist()) == [0]
    for p, got in ((after, a), (before, b)):
        assert sorted(got.tolist()) == reference(row, p)[-1][1].tolist()


def test_empty_candidates_are_reported_not_raised():
    V = 64
    row = np.zeros(V, np.float32)
    s = SequenceSampler(SamplerParams(), V)
    r = s.sample(row, np.zeros(2, np.int32))
    assert r.empty and r.token == -1 and "grammar" in r.reason
    s = SequenceSampler(SamplerParams(logit_bias={t: -1e9 for t in range(V)}), V)
    r = s.sample(row)
    assert r.empty and "logit_bias" in r.reason
    r = SequenceSampler(SamplerParams(), V).sample(np.full(V, -np.inf, np.float32))
    assert r.empty and "finite" in r.reason


def test_nan_rows_do_not_crash():
    rng = np.random.default_rng(0)
    for V in (50, 5000):
        row = rng.standard_normal(V).astype(np.float32)
        row[::3] = np.nan
        for p in (SamplerParams(), SamplerParams(top_k=0, n_probs=2), SamplerParams(top_k=0, top_p=1.0)):
            r = SequenceSampler(p, V).sample(row)
            assert r.empty or not np.isnan(row[r.token])
        row[:] = np.nan
        assert SequenceSampler(SamplerParams(), V).sample(row).empty


def test_history_includes_prompt_and_slides():
    V = 16
    row = np.arange(V, dtype=np.float32)  # token 15 is the argmax
    p = SamplerParams(top_k=1, penalty_present=100.0, penalty_last_n=2)
    s = SequenceSampler(p, V, prompt_tokens=[15])
    assert s.sample(row).token == 14  # the prompt token is penalised
    s.accept(14)
    assert s.sample(row).token == 13  # both in the window of 2
    s.accept(3)
    assert s.sample(row).token == 15  # 15 slid out of the window
    assert s.history == (15, 14, 3)
    s.truncate(1)
    assert s.sample(row).token == 14
    s.set_params(SamplerParams(top_k=1, penalty_present=100.0, penalty_last_n=0))
    assert s.sample(row).token == 15
    with pytest.raises(ValueError):
        s.accept(V)


def test_a_history_read_in_place_is_the_callers_list_and_slides_the_same():
    V = 16
    row = np.arange(V, dtype=np.float32)
    p = SamplerParams(top_k=1, penalty_present=100.0, penalty_last_n=2)
    tokens = [15]  # a sequence's context: the sampler reads it, never copies it
    s = SequenceSampler(p, V, history=tokens)
    assert s.sample(row).token == 14
    tokens.append(14)  # appended once, by the owner of the list
    assert s.sample(row).token == 13
    tokens.append(3)
    assert s.sample(row).token == 15 and s.history == (15, 14, 3)
    s.truncate(1)  # truncates the caller's list: there is one history
    assert tokens == [15] and s.sample(row).token == 14


def _window(history, n):
    w = history if n < 0 else history[max(0, len(history) - n):] if n else []
    c = Counter(w)
    ids = sorted(c)
    return ids, [float(c[t]) for t in ids]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 11), max_size=40), prompt=st.integers(0, 40),
       n=st.sampled_from([-1, 0, 1, 2, 3, 7, 64]), reads=st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_window_of_a_history_read_in_place_equals_the_accepted_one(tokens, prompt, n, reads):
    """However the appends and the reads interleave, the penalty window of a sampler
    reading the caller's list equals that of one taking each token through accept, and
    the one computed from the definition (the last n tokens, prompt included)."""
    p = SamplerParams(penalty_repeat=1.5, penalty_last_n=n)
    prompt = min(prompt, len(tokens))
    own = SequenceSampler(p, 12, tokens[:prompt])
    history = list(tokens[:prompt])
    read = SequenceSampler(p, 12, history=history)
    for i, t in enumerate(tokens[prompt:]):
        own.accept(t)
        history.append(t)
        if reads[i]:
            got = read.penalty_window()
            assert [a.tolist() for a in got] == [a.tolist() for a in own.penalty_window()]
    ids, counts = read.penalty_window()
    assert (ids.tolist(), counts.tolist()) == _window(tokens, n)
    assert read.history == own.history == tuple(tokens)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 11), max_size=40), n=st.sampled_from([-1, 0, 1, 3, 7, 64]),
       n2=st.sampled_from([-1, 0, 2, 8, 64]), cut=st.integers(0, 45))
def test_a_recounted_window_is_the_definitions(tokens, n, n2, cut):
    """truncate and a new penalty_last_n count the window again from the history: the
    last n tokens, also when the history is shorter than n (the recount once took the
    last n - len of them then) and after the window was read."""
    s = SequenceSampler(SamplerParams(penalty_repeat=1.5, penalty_last_n=n), 12, tokens)
    s.penalty_window()
    s.truncate(cut)
    ids, counts = s.penalty_window()
    assert (ids.tolist(), counts.tolist()) == _window(tokens[:cut], n)
    h = tokens[:cut]
    assert s.window_tokens() == (h if n < 0 else h[max(0, len(h) - n):] if n else [])
    assert s.window_array().tolist() == s.window_tokens()
    s.set_params(SamplerParams(penalty_repeat=1.5, penalty_last_n=n2))
    ids, counts = s.penalty_window()
    assert (ids.tolist(), counts.tolist()) == _window(tokens[:cut], n2)
    assert s.penalizes == bool(ids.size)


def test_fork_and_seed():
    V = 1000
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(V).astype(np.float32) for _ in range(6)]
    a = SequenceSampler(SamplerParams(seed=7, temperature=1.5, top_k=0, top_p=0.99), V)
    a.sample(rows[0])
    b = a.fork()
    assert [a.sample(r).token for r in rows] == [b.sample(r).token for r in rows]
    c = SequenceSampler(SamplerParams(temperature=1.5), V)
    assert isinstance(c.seed, int) and c.seed >= 0
    d = SequenceSampler(SamplerParams(seed=c.seed, temperature=1.5), V)
    assert [c.sample(r).token for r in rows] == [d.sample(r).token for r in rows]


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.sampled_from(["draw", "peek", "undraw", "fork", "reseed"]), max_size=30),
       seed=st.integers(0, 2**32))
def test_peek_draw_undraw_keep_the_seeded_stream(ops, seed):
    """The uniforms a sequence draws are its seed's stream in order, whatever peeks,
    take-backs (undraw), forks and re-seeds come between: a model of the stream (a list
    and a position) against the sampler. An undraw comes right after its draw."""
    V = 100
    s = SequenceSampler(SamplerParams(seed=seed), V)
    stream = np.random.default_rng(seed).random(len(ops) + 1).tolist()
    at, last = 0, None
    for op in ops:
        if op == "draw":
            last = s.draw()
            assert last == stream[at]
            at += 1
        elif op == "peek":
            assert s.peek() == stream[at]
            last = None  # undraw takes back only the draw just made
        elif op == "undraw" and last is not None:
            s.undraw(last)
            at, last = at - 1, None
        elif op == "fork":
            f = s.fork()
            assert f.peek() == s.peek() == stream[at]
            s, last = f, None
        elif op == "reseed":
            seed += 1
            s.set_params(SamplerParams(seed=seed))
            stream = np.random.default_rng(seed).random(len(ops) + 1).tolist()
            at, last = 0, None
    assert s.draw() == stream[at]


def test_logprobs():
    V = 300
    rng = np.random.default_rng(5)
    row = make_row(rng, V, "peaked")
    p = SamplerParams(n_probs=4, seed=1, logit_bias={3: 2.0}, temperature=0.8)
    r = SequenceSampler(p, V).sample(row)
    raw = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64) - row.max()).sum()) - row.max()
    assert r.logprob == pytest.approx(raw[r.token], abs=1e-5)
    best = np.lexsort((np.arange(V), -raw))[:4]
    assert [t for t, _ in r.top] == best.tolist()
    assert [lp for _, lp in r.top] == pytest.approx(raw[best].tolist(), abs=1e-5)
    _, ids, lg = reference(row, p)[-1]
    steered = lg[ids] - np.log(np.exp(lg[ids] - lg[ids].max()).sum()) - lg[ids].max()
    assert r.steered_logprob == pytest.approx(steered[ids.tolist().index(r.token)], abs=1e-9)
    assert r.steered_top[0][0] == ids[np.argmax(lg[ids])]
    assert len(r.steered_top) == min(4, ids.size) and r.n_candidates == ids.size
    g = SequenceSampler(SamplerParams(n_probs=2, top_k=1), V).sample(row)
    assert g.steered_logprob == 0.0 and g.steered_top == ((g.token, 0.0),)


def test_dense_logprobs_without_truncation():
    V = 5000
    row = make_row(np.random.default_rng(2), V, "normal")
    p = SamplerParams(n_probs=3, top_k=0, top_p=1.0, temperature=2.0, logit_bias={7: 5.0, 8: -1e9})
    r = SequenceSampler(p, V).sample(row)
    assert r.n_candidates == V - 1
    _, ids, lg = reference(row, p)[-1]
    ls = lg[ids] - lg[ids].max()
    ls -= np.log(np.exp(ls).sum())
    assert r.steered_logprob == pytest.approx(ls[ids.tolist().index(r.token)], abs=1e-5)
    best = ids[np.lexsort((ids, -ls))[:3]]
    assert [t for t, _ in r.steered_top] == best.tolist()


# -- the real vocabulary size: fast paths vs the reference --------------------------------------

def llm_like_row(rng, V):
    """A bulk of N(0, 2.5^2) logits (total mass ~e^15.6 at 262k) and 24 plausible tokens
    at +12..+24 above it, so the nucleus usually ends among them, as for a real model."""
    row = rng.standard_normal(V).astype(np.float32) * 2.5
    row[rng.choice(V, 24, replace=False)] += rng.uniform(12, 24, 24).astype(np.float32)
    row.flags.writeable = False
    return row


@pytest.mark.parametrize("name", ["default+bias+penalties", "grammar10%", "top_p_only", "min_p_first",
                                  "no_truncation", "greedy_grammar"])
def test_full_vocab_fast_paths_match_reference(name):
    V = 262_144
    rng = np.random.default_rng(11)
    row = llm_like_row(rng, V)
    top = np.argsort(row)[-50:]
    history = rng.integers(0, V, 100).tolist() + top[-5:].tolist()
    allowed = None
    if name == "default+bias+penalties":
        p = SamplerParams(penalty_repeat=1.3, penalty_freq=0.2, penalty_present=0.5,
                          logit_bias={int(top[-1]): -1e9, int(top[0]): 9.0, 5: 30.0})
    elif name == "grammar10%":
        allowed = rng.random(V) < 0.1
        p = SamplerParams(top_k=40, penalty_repeat=1.2, logit_bias={int(top[-2]): 1e9 * 0 + 3.0})
    elif name == "top_p_only":
        p = SamplerParams(top_k=0, top_p=0.9, temperature=1.2, logit_bias={int(top[-3]): -4.0})
    elif name == "min_p_first":
        p = SamplerParams(min_p=0.02, penalty_freq=0.3, samplers=["temperature", "penalties", "min_p", "top_k"],
                          temperature=1.5, top_k=20)
    elif name == "no_truncation":
        p = SamplerParams(top_k=0, top_p=1.0, temperature=0.9, penalty_present=1.0)
    else:
        allowed = rng.random(V) < 0.5
        p = SamplerParams(temperature=0.0, logit_bias={int(top[-1]): -1e9})
    words = None if allowed is None else as_words(mask_words(allowed), V)
    try:
        _, ids, lg = reference(row, p, allowed, history, tol=1e-6)[-1]
    except Ambiguous:
        pytest.skip("boundary case")
    cand = apply_chain(row, p, words, window_arrays(p, V, history))
    got_ids, got_lg = cand.materialize()
    o = np.argsort(got_ids)
    assert got_ids[o].tolist() == ids.tolist()
    np.testing.assert_array_equal(got_lg[o], lg[ids])
    for u in (0.0, 0.37, 0.999):
        try:
            want = reference_sample(ids, lg[ids], u, tol=1e-5)
        except Ambiguous:
            continue
        assert cand.sample(u) == want


@pytest.mark.parametrize("temperature, samplers", [(1.0, None), (1.3, ["temperature", "top_p"])])
def test_full_vocab_top_p_deep_in_a_flat_row(temperature, samplers):
    """A flat row puts the nucleus boundary among thousands of tiny masses, where float
    rounding (not the definition) picks the last token; check the definition up to that:
    an upper set holding >= p of the mass that would hold < p without its last token."""
    V = 262_144
    row = (np.random.default_rng(4).standard_normal(V) * 1.5).astype(np.float32)
    row.flags.writeable = False
    p = SamplerParams(top_k=0, top_p=0.8, temperature=temperature,
                      samplers=samplers or ["top_p", "temperature"])
    got, _ = apply_chain(row, p).materialize()
    v = row.astype(np.float64) / temperature if samplers else row.astype(np.float64)
    e = np.exp(v - v.max())
    z = e.sum()
    assert v[got].min() >= v[np.setdiff1d(np.arange(V), got)].max()  # an upper set
    mass = e[got].sum()
    assert mass >= 0.8 * z * (1 - 1e-6)
    assert mass - e[got].min() < 0.8 * z * (1 + 1e-6)


def _edge_row(values):
    row = np.array(values, np.float32)
    row.flags.writeable = False
    return row


EDGE = {
    # every allowed token is touched by the penalties: nothing left outside T
    "all_allowed_touched": (_edge_row(np.arange(40) / 7), dict(top_k=3, penalty_present=0.5),
                            np.isin(np.arange(40), [3, 9]), [3, 9, 9]),
    # min-p first over a row of -inf
    "min_p_all_neg_inf": (_edge_row(np.full(40, -np.inf)), dict(min_p=0.1, samplers=["min_p", "temperature"]),
                          None, []),
    # top-p first over a row of -inf
    "top_p_all_neg_inf": (_edge_row(np.full(40, -np.inf)), dict(top_k=0, top_p=0.5), None, []),
    # top-p so close to 1 that the superset search gives up and takes everything
    "top_p_nearly_one": (_edge_row(np.linspace(0, -200, 40)), dict(top_k=0, top_p=0.999995), None, []),
    # forced tokens, one forbidden by the grammar
    "forced_with_grammar": (_edge_row(np.arange(40) / 3), dict(logit_bias={5: 1e9, 6: 1e9, 7: -1e9}),
                            np.arange(40) != 6, []),
}


@pytest.mark.parametrize("name", list(EDGE))
def test_edge_paths_match_reference(name):
    row, kw, allowed, history = EDGE[name]
    p = SamplerParams(**kw)
    for explicit_max in (0, 4096):
        fast = dict(view=RowView(row, cols=4, dense_frac=2.0), explicit_max=explicit_max)
        check_against_reference(row, p, allowed, history, fast, u=0.5)


def test_sampler_state_api():
    V = 50
    row = np.linspace(0, 1, V).astype(np.float32)
    s = SequenceSampler(SamplerParams(seed=1, temperature=2.0, top_k=0, top_p=1.0), V)
    assert s.n_vocab == V and s.params.seed == 1
    a = [s.sample(row).token for _ in range(5)]
    s.set_params(SamplerParams(seed=1, temperature=2.0, top_k=0, top_p=1.0))  # same seed: stream continues
    b = [s.sample(row).token for _ in range(5)]
    s.set_params(SamplerParams(seed=2, temperature=2.0, top_k=0, top_p=1.0))
    s.set_params(SamplerParams(seed=1, temperature=2.0, top_k=0, top_p=1.0))  # a new seed restarts
    assert [s.sample(row).token for _ in range(10)] == a + b
    f1, f2 = s.fork(seed=9), s.fork(seed=9)
    assert f1.seed == 9 and [f1.sample(row).token for _ in range(5)] == [f2.sample(row).token for _ in range(5)]
    with pytest.raises(ValueError, match="shape"):
        s.sample(row[:-1])


# ------------------------------------------------------------------ every registered step

from clickpaca.sampling import registry as R  # noqa: E402
from clickpaca.sampling.registry import StepContext  # noqa: E402

ALL_STEPS = tuple(s.name for s in R.steps() if s.run is not None)


def naive(row, params, allowed, history, hist):
    """The rows' definitions run in order over the whole vocabulary (every step, off or
    not: an off step is an identity), the grammar first."""
    ids = np.arange(row.size, dtype=np.int32)
    lg = np.fmax(row.astype(np.float64), -np.inf)
    if allowed is not None:
        ids, lg = ids[allowed], lg[allowed]
    ctx = StepContext(hist, list(history), n_vocab=row.size, seed=7)
    for name in params.steps:
        if ids.size == 0:
            return ids, lg, name
        ids, lg = R.step(name).run(ids, lg, params, ctx)
    return ids, lg, None


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_registered_step_through_the_fast_chain_equals_the_naive_run(data):
    """Whatever the order, the chain's shortcuts (cuts, implicit rest, explicit grammar,
    the full-set fallback of a step without a cut hook) give what running each step's
    definition over the whole vocabulary gives."""
    draw = data.draw
    V = draw(st.integers(8, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = make_row(rng, V, draw(st.sampled_from(["normal", "coarse", "peaked"])), draw(st.booleans()))
    steps = list(draw(st.permutations(ALL_STEPS)))[: draw(st.integers(1, len(ALL_STEPS)))]
    params = SamplerParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.5])),
        top_k=draw(st.sampled_from([0, 1, 5, 40])), top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
        min_p=draw(st.sampled_from([0.0, 0.05])), penalty_repeat=draw(st.sampled_from([1.0, 1.3])),
        logit_bias=draw(st.dictionaries(st.integers(0, V - 1), bias_values, max_size=4)),
        dry_multiplier=draw(st.sampled_from([0.0, 0.8])), dry_allowed_length=draw(st.sampled_from([1, 2])),
        dry_sequence_breakers=(), top_n_sigma=draw(st.sampled_from([-1.0, 1.0, 3.0])),
        typical_p=draw(st.sampled_from([1.0, 0.9, 0.3])), xtc_probability=draw(st.sampled_from([0.0, 1.0])),
        xtc_threshold=draw(st.sampled_from([0.05, 0.2])), dynatemp_range=draw(st.sampled_from([0.0, 0.5])),
        mirostat=draw(st.sampled_from([0, 1, 2])), samplers=steps)
    history = draw(st.lists(st.integers(0, min(V - 1, 6)), max_size=40))
    density = draw(st.sampled_from([None, None, 0.03, 0.3, 1.0]))
    allowed = None if density is None else rng.random(V) < density
    words = None if allowed is None else as_words(mask_words(allowed), V)
    hist = window_arrays(params, V, history) if params.penalties_active else (np.empty(0, np.int32), np.empty(0))
    want_ids, want_lg, want_empty = naive(row, params, allowed, history, hist)
    view = RowView(row, cols=draw(st.integers(1, 32)), dense_frac=draw(st.sampled_from([0.25, 2.0])))
    ctx = StepContext(hist, list(history), n_vocab=V, seed=7)
    cand = apply_chain(row, params, words, view=view, explicit_max=draw(st.sampled_from([0, 4096])), ctx=ctx)
    if want_ids.size == 0:
        assert cand.empty_step is not None
        return
    got_ids, got_lg = cand.materialize()
    o, w = np.argsort(got_ids), np.argsort(want_ids)
    assert got_ids[o].tolist() == want_ids[w].tolist(), params.steps
    np.testing.assert_allclose(got_lg[o], want_lg[w], rtol=1e-12, atol=0)


def test_greedy_skips_only_the_truncations_right_before_it():
    """Greedy keeps the canonical first candidate of what reaches it, so truncations just
    before it may be skipped, but not one that a set-reading step follows: top-n-sigma
    then typical-p (which may drop the most likely token) then greedy must give typical-p's
    best of top-n-sigma's set. Hypothesis found the chain skipping top-n-sigma here (the
    token of the whole row's typical set instead)."""
    V = 8
    row = make_row(np.random.default_rng(0), V, "normal", False)
    for steps in (["top_n_sigma", "typical_p", "temperature"], ["typical_p", "top_n_sigma", "temperature"],
                  ["top_k", "typical_p", "min_p", "temperature"]):
        params = SamplerParams(temperature=0.0, top_k=5, top_n_sigma=1.0, typical_p=0.3, min_p=0.05,
                               samplers=steps)
        hist = (np.empty(0, np.int32), np.empty(0))
        want_ids, _, _ = naive(row, params, None, [], hist)
        cand = apply_chain(row, params, None, view=RowView(row, cols=1, dense_frac=0.25), explicit_max=0,
                           ctx=StepContext(hist, [], n_vocab=V, seed=7))
        got_ids, _ = cand.materialize()
        assert sorted(got_ids.tolist()) == sorted(want_ids.tolist()), steps


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("accept"), st.integers(0, 11)),
                              st.tuples(st.just("append"), st.lists(st.integers(0, 11), max_size=90)),
                              st.tuples(st.just("truncate"), st.integers(0, 60)),
                              st.tuples(st.just("last_n"), st.sampled_from([-1, 0, 1, 5, 64])),
                              st.tuples(st.just("fork"), st.none())), max_size=12),
       n=st.sampled_from([-1, 0, 3, 64]))
def test_the_window_array_is_the_window_tokens(ops, n):
    """window_array (an int64 view of the history's mirror, which takes in only what was
    added since its last read) holds window_tokens after any mix of accepted tokens,
    tokens the caller appends to its own history, truncation, a new penalty_last_n and a
    fork, read after each step or not (the mirror grows past its first 64)."""
    hist: list[int] = []
    s = SequenceSampler(SamplerParams(penalty_repeat=1.5, penalty_last_n=n), 12, history=hist)
    for op, x in ops:
        if op == "accept":
            s.accept(x)
        elif op == "append":  # the engine's way: its own list, which the sampler reads
            s._history.extend(x)
        elif op == "truncate":
            s.truncate(x)
        elif op == "last_n":
            s.set_params(SamplerParams(penalty_repeat=1.5, penalty_last_n=x))
        else:
            s = s.fork()
        if len(s.window_tokens()) % 2:  # read now and then, not after every step
            assert s.window_array().tolist() == s.window_tokens()
    assert s.window_array().dtype == np.int64
    assert s.window_array().tolist() == s.window_tokens()
