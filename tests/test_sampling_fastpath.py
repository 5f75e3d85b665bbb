"""The sampler chain on pre-selected values (sampling/fastpath.py) against the host path.

For chains of the steps whose registry rows say ``preselected`` (logit bias with bans
and forces, penalties over a prompt history, top-k, min-p, top-p, temperature with
greedy), in random orders, on synthetic rows (ties, -inf, NaN, vocabularies of 3,000 to
70,000 tokens, sizes that are not multiples of 1,024 or 8) with and without a grammar
bitmask: two identical samplers, one runs ``order`` -> ``presample.reference`` (what the
decode's graph hands back, computed with numpy) -> ``fastpath.sample``, the other the
host path ``SequenceSampler.sample`` on the whole row, for a few tokens in a row. The
contract (fastpath's docstring):

- an answer from the fast path is the host's: the same token, candidate count and
  steered log-probabilities (1e-5 nats), except where the host's own decision lies within
  rounding of a boundary: then the host chain itself, rerun with its draw moved by 1e-6
  or its top-p target by 1e-5 relative, gives the fast path's answer (`near_boundary`).
  Such cases are counted (``hypothesis.event`` and the module's tally) and must stay
  under 2% of each test's answers, so a systematic error cannot pass as rounding;
- the raw log-probabilities are within 1e-5 nats of the row's exact float64 log-softmax;
  the n best ids are the host's (a swap only between values within 1e-5);
- the fast path takes the sequence's uniform exactly when it answers: after an answer
  both samplers' streams are at the same place, and after a reason (nothing drawn) the
  host path on the same sampler gives exactly what the other sampler gave;
- ``route`` sends every chain with an active step whose row is not ``preselected`` to the
  host and names that step, and the rows marked ``preselected`` are exactly the steps this
  file exercises;
- a truncation whose kept set reaches the K-th value (or ties with it) is refused
  (``fastpath.PAST_K``): hand-built ``Preselected`` values, and the property again with a
  bias on the token at the edge of the K best (the floor then is a touched token's).

No model: every row is synthetic.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from clickpaca.llama.presample import BLOCK, Preselected, RowOrder, reference
from clickpaca.sampling import SamplerParams, SequenceSampler, apply_chain
from clickpaca.sampling import fastpath as F
from clickpaca.sampling import registry as R
from clickpaca.sampling.bench import random_mask, synthetic_row
from clickpaca.sampling.bitmask import as_words, count_allowed
from clickpaca.sampling.chain import empty_reason, steps_to_run
from clickpaca.sampling.registry import NO_HIST
from clickpaca.sampling.route import plan as chain_plan

#: the steps whose rows say ``preselected`` (test_preselected_rows_are_the_ones_tested)
PRESELECTED = ("logit_bias", "penalties", "top_k", "min_p", "top_p", "temperature")
#: params that switch on each step that needs the whole row (route must name it)
HOST_ONLY = {
    "dry": dict(dry_multiplier=0.8),
    "typical_p": dict(typical_p=0.9),
    "xtc": dict(xtc_probability=0.5, xtc_threshold=0.1),
    "dynatemp": dict(dynatemp_range=0.5),
    "mirostat": dict(mirostat=1),
    "mirostat_v2": dict(mirostat=2),
    "top_n_sigma": dict(top_n_sigma=1.0),
}
DENSE_TOUCHED = "dense draw with touched tokens"  # route's one reason for a chain of preselected steps

TOL = 1e-5  # nats: log-probabilities, and what counts as a tie
DU = 1e-6  # a draw this close to a cumulative edge is at the boundary
DP = 1e-5  # a top-p target this close (relative) to a cumulative mass is at the boundary
TALLY = {"answers": 0, "near": 0, "tied_ids": 0, "reasons": 0, "routed": 0}


NEAR_LIMIT = 0.02


@pytest.fixture(scope="module", autouse=True)
def report_tally():
    yield
    print(f"\nfastpath vs host: {TALLY}")


@pytest.fixture(autouse=True)
def near_boundary_is_rare(request):
    """The near-boundary rule is for rounding, not a way to pass: at most 2% of each
    test's own answers may have needed it (or a swap of tied ids). Checked as each test
    ends, on that test's counts, so a breach is reported against the test that made it."""
    before = dict(TALLY)
    yield
    got = {k: TALLY[k] - before[k] for k in TALLY}
    if got["answers"]:
        print(f"\n{request.node.name}: {got}")
    for what in ("near", "tied_ids"):
        assert got[what] <= NEAR_LIMIT * got["answers"], (
            f"{request.node.name}: {got[what]} {what} in {got['answers']} answers, over the "
            f"{NEAR_LIMIT * 100:g}% limit ({got})")


def _touched_plan(s: SequenceSampler):
    """route.py's decision that the sequence's row goes through fastpath_touched's pass."""
    return chain_plan(s.params, s.penalizes, s.n_vocab).touched


def note(what: str) -> None:
    """hypothesis.event, when a test runs under hypothesis (the helpers also run alone)."""
    if currently_in_test_context():
        event(what)


# ------------------------------------------------------------------ rows and chains

STYLES = ("synthetic", "synthetic", "ties", "ties", "flat", "neg_inf", "sparse", "nan")


def make_row(rng: np.random.Generator, V: int, style: str) -> np.ndarray:
    """A raw logits row: bench.synthetic_row (Gemma-like), or one with many exact ties
    (a 0.25-nat grid), a flat one (huge nuclei), some or almost all entries -inf, a NaN."""
    row = synthetic_row(rng, V)
    if style == "ties":
        row = np.round(row * 4) / 4
    elif style == "flat":
        row = (rng.standard_normal(V) * 0.3).astype(np.float32)
    elif style == "neg_inf":
        row[rng.random(V) < 0.3] = -np.inf
    elif style == "sparse":  # fewer finite values than K
        keep = rng.choice(V, int(rng.integers(1, 40)), replace=False)
        sparse = np.full(V, -np.inf, np.float32)
        sparse[keep] = row[keep]
        row = sparse
    elif style == "nan":
        row[rng.integers(0, V)] = np.nan
    row = row.astype(np.float32)
    row.flags.writeable = False
    return row


#: the explicit @examples' rows and grammar masks, as literal float32 / int32 arrays
#: ("NAME.rowI", "NAME.maskI"): kept as data, not as the seeds of numpy's streams (numpy
#: does not promise a Generator's output across versions); drawn once with numpy 2.4.6 by
#: make_row and random_mask from default_rng of the seeds the examples were found with
EXAMPLES = Path(__file__).resolve().parent / "data" / "fastpath_examples.npz"


def rows_and_masks(source: int | str, V: int, styles: list[str], density: float | None):
    """An example's rows (one per style) and grammar masks (None without a density): for
    an explicit @example, ``source`` names its stored arrays (EXAMPLES); for hypothesis'
    own, it is the seed of the numpy stream make_row and random_mask draw from."""
    if isinstance(source, str):
        with np.load(EXAMPLES) as data:
            rows = [data[f"{source}.row{i}"] for i in range(len(styles))]
            masks = [data[f"{source}.mask{i}"] if density is not None else None for i in range(len(styles))]
        for row in rows:
            assert row.dtype == np.float32 and row.size == V, (source, row.dtype, row.size)
            row.flags.writeable = False
        return rows, masks
    rng = np.random.default_rng(source)
    rows = [make_row(rng, V, style) for style in styles]
    return rows, [random_mask(rng, V, density) if density is not None else None for _ in rows]


def by_rank(row: np.ndarray, ranks: list[int]) -> list[int]:
    """Token ids for ranks: r < 250 the r-th best of the row (where bias and penalties
    matter), larger r an id spread over the vocabulary."""
    V = row.size
    best = np.argsort(-np.nan_to_num(row, nan=-np.inf), kind="stable")[:250]
    return [int(best[r]) if r < 250 else (r * 7919) % V for r in ranks]


BIASES = (-1e9, 1e9, -3.0, -0.5, 0.5, 2.0, 10.0)
#: token ranks (by_rank): often among the 24 plausible tokens (where the mass is), or at
#: the edge of the K best (K = k + the touched tokens, k among 8, 16, 64, 200), where a
#: touched token moves the floor
RANKS = st.one_of(st.integers(0, 24), st.integers(0, 500),
                  st.sampled_from([7, 8, 9, 10, 15, 16, 17, 18, 63, 64, 65, 66, 199, 200]))
#: ranks far below the best (ids spread over the vocabulary: by_rank)
FAR = st.integers(250, 100_000)


@st.composite
def chains(draw) -> dict:
    """Params of a chain of preselected steps (bias ids and history as ranks: by_rank)."""
    order = draw(st.permutations(PRESELECTED))
    n = draw(st.integers(0, len(PRESELECTED)))
    samplers = None if draw(st.integers(0, 6)) == 0 else list(order[:n])  # None: the default chain
    return dict(
        samplers=samplers,
        top_k=draw(st.sampled_from([0, 1, 2, 5, 40, 64, 100, 300, 1500])),  # 1500: past K_MAX
        min_p=draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2, 0.9])),
        top_p=draw(st.one_of(st.sampled_from([1.0, 0.99, 0.95, 0.8, 0.5, 0.1]), st.floats(0.0, 1.0))),
        temperature=draw(st.sampled_from([0.0, -1.0, 0.3, 0.7, 1.0, 1.5, 3.0])),
        penalty_repeat=draw(st.sampled_from([1.0, 1.1, 1.5, 0.8])),
        penalty_freq=draw(st.sampled_from([0.0, 0.1, 0.5])),
        penalty_present=draw(st.sampled_from([0.0, 0.3, -0.5])),
        penalty_last_n=draw(st.sampled_from([0, 8, 64, -1])),
        bias=draw(st.lists(st.tuples(RANKS, st.sampled_from(BIASES)), max_size=4, unique_by=lambda t: t[0])),
        history=draw(st.lists(RANKS, max_size=30)),
        n_probs=draw(st.integers(0, 10)),
        seed=draw(st.integers(0, 2**63 - 1)),
    )


def chain_of(**changes) -> dict:
    """A chains() value: every step off but the listed ones, for the explicit examples."""
    base = dict(samplers=None, top_k=0, min_p=0.0, top_p=1.0, temperature=1.0, penalty_repeat=1.0,
                penalty_freq=0.0, penalty_present=0.0, penalty_last_n=0, bias=[], history=[], n_probs=0, seed=0)
    return {**base, **changes}


def params_of(chain: dict, row: np.ndarray) -> tuple[SamplerParams, list[int]]:
    kw = {k: v for k, v in chain.items() if k not in ("bias", "history")}
    ids = by_rank(row, [r for r, _ in chain["bias"]])
    bias = {}
    for t, (_, b) in zip(ids, chain["bias"]):
        bias.setdefault(t, b)  # two ranks may name one id
    return SamplerParams(logit_bias=bias, **kw), by_rank(row, chain["history"])


# ------------------------------------------------------------------ comparing answers


def exact_raw_logprob(row: np.ndarray, tok: int) -> float:
    """log-softmax of the raw row at tok, in float64 (NaN as -inf, as the host takes it)."""
    x = np.fmax(row, -np.inf, dtype=np.float64)
    m = float(x.max())
    return float(x[tok]) - (m + math.log(float(np.exp(x - m).sum())))


def close(a: float, b: float, tol: float = TOL) -> bool:
    """Within tol, or the same infinity."""
    return a == b or abs(a - b) <= tol


def close_tops(a, b, tol: float = TOL) -> bool:
    """Two n-best lists ((id, logprob), ...): the same length, values within tol place by
    place; an id may differ only where its value ties (within tol) with the other's."""
    if a is None or b is None:
        return a is None and b is None
    if len(a) != len(b):
        return False
    if not all(close(x[1], y[1], tol) for x, y in zip(a, b)):
        return False
    if [i for i, _ in a] != [i for i, _ in b]:
        TALLY["tied_ids"] += 1  # the lists are sorted: a swap is between values within tol
        note("n-best ids swapped at a near tie")
    return True


def same_decision(fast, host: "Host") -> bool:
    """The fast path's answer is the host's: token, emptiness, candidate count, and the
    steered log-probabilities within TOL (the set sampled from is the same)."""
    if (fast.token, fast.empty, fast.reason) != (host.token, host.empty, host.reason):
        return False
    if fast.n_candidates != host.n_candidates:
        return False
    if host.steered_logprob is None:
        return fast.steered_logprob is None
    return (fast.steered_logprob is not None and close(fast.steered_logprob, host.steered_logprob)
            and close_tops(fast.steered_top, host.steered_top))


class Host:
    """The host chain's answer as SampleResult's fields (token, empty, reason,
    n_candidates, steered_logprob, steered_top) for a given uniform and params, through
    ``apply_chain`` (what ``SequenceSampler.sample`` runs: check_answer holds it to that)."""

    def __init__(self, row, p, words, window, u):
        cand = apply_chain(row, p, words, hist=window)
        self.empty, self.reason = False, None
        self.token, self.n_candidates = -1, cand.size
        self.steered_logprob = self.steered_top = None
        tok = -1 if cand.empty_step is not None else cand.sample(min(max(u, 0.0), 1.0 - 2**-53))
        if tok < 0:
            self.empty, self.reason = True, empty_reason(cand.empty_step or "sample")
            self.n_candidates = 0
            return
        self.token = tok
        if p.n_probs > 0:
            self.steered_logprob, self.steered_top = cand.logprob(tok), cand.top(p.n_probs)


def near_boundary(fast, row, p, words, window, u) -> str | None:
    """Whether a fast answer that is not the host's is the host's own answer with its
    decision moved by rounding: the draw by +-DU, the top-p target by +-DP relative
    (the fast path takes the mass outside the K best from float32 block sums). Returns
    which move explains it, or None (then it is a real mismatch)."""
    w = as_words(words, row.size) if words is not None else None
    tops = [p.top_p] + ([p.top_p * (1 - DP), min(p.top_p * (1 + DP), 1.0)] if p.top_p < 1.0 else [])
    for tp in tops:
        q = p if tp == p.top_p else p.replace(top_p=tp)
        for du in (0.0, -DU, DU):
            if tp == p.top_p and du == 0.0:
                continue
            if same_decision(fast, Host(row, q, w, window, u + du)):
                return f"draw {du:+g}" if tp == p.top_p else f"top-p {tp / p.top_p - 1:+.0e}, draw {du:+g}"
    return None


def check_answer(fast, host, row, p, words, window, u) -> str:
    """Assert the contract for one answered token (``host``: the host path's
    SampleResult for the same row and uniform u); returns "same" or the near-boundary move."""
    assert fast.path == "graph"
    assert fast.trace is None
    ref = Host(row, p, as_words(words, row.size) if words is not None else None, window, u)
    fields = ("token", "empty", "reason", "n_candidates", "steered_logprob", "steered_top")
    assert repr([getattr(ref, f) for f in fields]) == repr([getattr(host, f) for f in fields])
    how = "same"
    if not same_decision(fast, ref):
        how = near_boundary(fast, row, p, words, window, u)
        assert how is not None, (f"the fast path's answer is not the host's, and not near a boundary:\n"
                                 f"fast {fast}\nhost {host}\nu {u!r}")
    if p.n_probs > 0 and not fast.empty:
        # raw: the row's log-softmax, whatever the chain did
        assert fast.logprob is not None and fast.top is not None
        assert close(fast.logprob, exact_raw_logprob(row, fast.token)), (fast.logprob, fast)
        assert close_tops(fast.top, host.top), (fast.top, host.top)
        for i, lp in fast.top:
            assert close(lp, exact_raw_logprob(row, i)), (i, lp)
    else:
        assert fast.logprob is fast.top is fast.steered_logprob is fast.steered_top is None
    return how


# ------------------------------------------------------------------ the property


def head(s: SequenceSampler, words) -> str:
    """The chain's first truncation for this tick (for the events)."""
    p = s.params
    n_allowed = count_allowed(as_words(words, s.n_vocab), s.n_vocab) if words is not None else s.n_vocab
    active, first = steps_to_run(p, p.penalties_active and s.penalty_window()[0].size > 0, n_allowed)
    return "no truncation" if first is None else active[first].name


VOCABS = st.one_of(st.sampled_from([3000, 4096, 4097, 5001, 8191, 32000, 50257, 65536, 70000]),
                   st.integers(3000, 70000))
DENSITIES = st.sampled_from([None, None, None, 0.0, 0.001, 0.02, 0.3, 0.9, 1.0])


@settings(max_examples=250)
# int32 grammar words (as SequenceSampler.sample takes them) were counted with the sign
# bit wrong by the fast path: n_candidates of a dense draw was off
@example(V=3000, source="greedy_under_a_mask", style="synthetic", density=0.3,
         chain=chain_of(samplers=[], temperature=0.0),
         k=64, ticks=1, batched=False)
# fewer finite raw values than nProbs: the host lists -inf tokens in the raw n best
@example(V=32000, source="sparse_fewer_finite_than_n_probs", style="sparse", density=None,
         chain=chain_of(temperature=0.0, n_probs=3),
         k=64, ticks=1, batched=False)
# NaN where the grammar masks it, with nProbs: the raw row's mass is NaN (a reason now)
@example(V=3000, source="nan_where_the_grammar_masks", style="nan", density=0.001,
         chain=chain_of(temperature=0.0, n_probs=1),
         k=64, ticks=1, batched=False)
# a top-k that keeps every allowed token (61 allowed, top-k 64) does not truncate, so the
# penalties after it run before the first truncation (min-p): the order was planned for
# the whole vocabulary and did not ask for the penalised token
@example(V=3000, source="top_k_keeps_every_allowed", style="synthetic", density=0.02,
         chain=chain_of(samplers=["top_k", "penalties", "logit_bias", "min_p"], top_k=64, min_p=0.01,
                        temperature=0.0, penalty_repeat=1.1, penalty_last_n=8, history=[0]),
         k=64, ticks=1, batched=False)
# a sparse row (4 finite values): the host's top-k 5 keeps the -inf token 0 too, which the
# bias after it forces; the fast path had dropped the -inf values
@example(V=3000, source="sparse_top_k_keeps_neg_inf", style="sparse", density=None,
         chain=chain_of(samplers=["penalties", "top_k", "logit_bias"], top_k=5, temperature=0.0, bias=[(4, 1e9)]),
         k=64, ticks=1, batched=False)
# the K-th value handed back (K = 16 + 2 touched) is a banned token's: top-p 0.99 kept all
# 16 untouched, every one above that value, yet its nucleus holds 93 tokens
@example(V=3000, source="kth_value_is_a_banned_token", style="synthetic", density=None,
         chain=chain_of(top_p=0.99, temperature=0.3, bias=[(0, -1e9), (17, -1e9)]), k=16, ticks=1, batched=False)
# a narrow grammar (81 allowed) under a top-k 100: no truncation, a dense draw; the bias
# bans an allowed token, so no touched token survives, yet its mass is in the blocks
# (n_candidates 81 for the host's 80; the draw could land on the banned token)
@example(V=5001, source="narrow_grammar_under_top_k_100", style="neg_inf", density=0.02,
         chain=chain_of(top_k=100, temperature=0.3, bias=[(18, -1e9)]), k=64, ticks=2, batched=False)
# a NaN row through sample_tick's batched top-k with nProbs: the raw normaliser from NaN
# masses (sample() refuses such a row; the batched plans did not ask)
@example(V=3000, source="nan_row_batched_top_k", style="nan", density=None,
         chain=chain_of(top_k=2, temperature=0.3, n_probs=1),
         k=64, ticks=1, batched=True)
@given(V=VOCABS, source=st.integers(0, 2**32 - 1), style=st.sampled_from(STYLES), density=DENSITIES,
       chain=chains(), k=st.sampled_from([F.K_MIN, F.K_MIN, 8, 16, 200]),
       ticks=st.integers(1, 3), batched=st.booleans())
def test_fast_path_is_the_host_path(V, source, style, density, chain, k, ticks, batched):
    rows, masks = rows_and_masks(source, V, [style] * ticks, density)
    p, history = params_of(chain, rows[0])
    fast_vs_host(p, history, rows, masks, k, batched)


def by_reference(rows: list[np.ndarray], orders: list[RowOrder]) -> list[Preselected]:
    """What the graph hands back for rows of one decode, from its numpy reference, each
    row at its order's own K (tests/test_presample_graph.py passes the graph's own ops
    run on ggml's CPU backend instead)."""
    return [reference(row, o) for row, o in zip(rows, orders)]


def fast_vs_host(p: SamplerParams, history: list[int], rows: list[np.ndarray], masks: list, k: int,
                 batched: bool = False, preselect=by_reference) -> None:
    """The property for one sequence: two identical samplers, one token per row, the
    fast path on one (``batched``: through ``fastpath.sample_tick``, as the scheduler
    calls it, whose greedy, top-k and top-p-first plans run on [m, K] matrices), the host
    path on the other (see the module doc). ``preselect``: rows and orders of one decode
    to their pre-selections."""
    V = rows[0].size
    fast = SequenceSampler(p, V, prompt_tokens=history)
    host = SequenceSampler(p, V, prompt_tokens=history)
    for row, words in zip(rows, masks):
        why = F.route(fast, words is not None)
        if why is not None:
            assert why == DENSE_TOUCHED, why  # every step is preselected: only this reason
            TALLY["routed"] += 1
            note(f"route: {why}")
            got, want = fast.sample(row, words), host.sample(row, words)
            assert repr(got) == repr(want)
        else:
            u = host.peek()
            o = F.order(fast, words, k)
            assert 0 < o.k <= min(F.K_MAX, V)
            with np.errstate(invalid="ignore"):  # a NaN row (refused below)
                pre = preselect([row], [o])[0]  # what Presampler.read hands back: the order's own k
            got = F.sample_tick([fast], [pre], [words])[0] if batched else F.sample(fast, pre, words)
            want = host.sample(row, words)
            if isinstance(got, str):
                # nothing drawn: the host path on this sampler is the other's, bit for bit
                TALLY["reasons"] += 1
                note(f"reason: {got}")
                got = fast.sample(row, words)
                assert repr(got) == repr(want)
            else:
                TALLY["answers"] += 1
                note("answer: " + ("dense draw" if o.u is not None else f"explicit set ({head(fast, words)})"))
                how = check_answer(got, want, row, p, words,
                                   host.penalty_window() if p.penalties_active else NO_HIST, u)
                if how != "same":
                    TALLY["near"] += 1
                    note(f"near boundary: {how}")
        # one uniform taken on each side: the streams are at the same place
        assert fast.peek() == host.peek()
        if got.token < 0:
            break
        fast.accept(got.token)  # both go on from the fast path's token
        host.accept(got.token)


@st.composite
def wide_chains(draw) -> dict:
    """Chains whose first truncation often keeps many tokens: bias (and penalties, a
    temperature) before a top-p near 1, a low min-p or a top-k near K."""
    pre = draw(st.permutations(["logit_bias", "penalties", "temperature"]))
    head = draw(st.sampled_from(["top_p", "min_p", "top_k"]))
    return chain_of(samplers=list(pre) + [head],
                    top_p=draw(st.sampled_from([0.5, 0.9, 0.99, 0.999, 0.9999])),
                    min_p=draw(st.sampled_from([0.0001, 0.001, 0.01, 0.1])),
                    top_k=draw(st.sampled_from([7, 8, 15, 16, 63])),
                    temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
                    penalty_present=draw(st.sampled_from([0.0, 1.0])), penalty_last_n=64,
                    history=draw(st.lists(RANKS, max_size=6)), n_probs=draw(st.integers(0, 3)),
                    seed=draw(st.integers(0, 2**32)))


@settings(max_examples=150)
@given(V=st.sampled_from([3000, 5001, 32000]), row_seed=st.integers(0, 2**32 - 1),
       style=st.sampled_from(["flat", "ties", "synthetic"]), density=st.sampled_from([None, None, 0.3]),
       chain=st.one_of(wide_chains(), chains()), k=st.sampled_from([8, 16, F.K_MIN]),
       bias=st.sampled_from(BIASES), at=st.sampled_from([0, 1, -1]), batched=st.booleans())
def test_a_touched_token_at_the_edge_of_the_k_best(V, row_seed, style, density, chain, k, bias, at, batched):
    """The property with a logit bias on the K-th best allowed token (or its neighbour):
    the floor of the values handed back is then a touched token's."""
    rng = np.random.default_rng(row_seed)
    row = make_row(rng, V, style)
    words = random_mask(rng, V, density) if density is not None else None
    p, history = params_of(chain, row)
    s = SequenceSampler(p, V, prompt_tokens=history)
    if F.route(s, words is not None) is not None:
        return
    k0 = F.order(s, words, k).k  # K without the new touched token
    y = row if words is None else np.where(np.unpackbits(words.view(np.uint8), bitorder="little")[:V] == 1,
                                           row, -np.inf)
    target = int(np.argsort(-y, kind="stable")[min(k0 + at, V - 1)])  # rank k0: the K-th once touched
    if any(t == target for t, _ in p.logit_bias):
        return
    p = p.replace(logit_bias={**dict(p.logit_bias), target: bias})
    note(f"edge {at:+d}")
    fast_vs_host(p, history, [row], [words], k, batched)


#: chains sample_tick batches (greedy, top-k, top-p first; with nProbs) and one it does not
TICK_CHAINS = [
    dict(temperature=0.0), dict(top_k=1), dict(top_k=40, top_p=0.95, temperature=0.7), dict(top_k=5),
    dict(top_k=5, top_p=1.0, temperature=1.3, n_probs=3), dict(top_k=0, top_p=0.9, samplers=["top_p", "temperature"]),
    dict(top_k=0, top_p=0.5, temperature=0.8, samplers=["top_p", "temperature"]), dict(top_k=8, n_probs=5),
    dict(min_p=0.05, top_k=0),
    # dense draws (fastpath_dense), with and without nProbs; the bench's top-p-only and nProbs chains
    dict(top_k=0, top_p=1.0, temperature=0.9), dict(top_k=0, top_p=1.0, temperature=1.0, n_probs=4),
    dict(top_k=0, top_p=0.95), dict(n_probs=5),
]


@settings(max_examples=60)
# several dense draws in one tick (rows with -inf regions: blocks without mass), one of
# them with nProbs
@example(V=5001, source="several_dense_draws",
         specs=[(9, "synthetic", 1, 64), (9, "neg_inf", 2, 64), (10, "flat", 3, 16), (9, "ties", 4, 9),
                (10, "neg_inf", 5, 64)])
# top-p-only rows (nuclei past K 9 and 16: PAST_K) and the default chain with nProbs 5
@example(V=3000, source="top_p_only_and_n_probs",
         specs=[(11, "flat", 1, 9), (11, "synthetic", 2, 64), (12, "ties", 3, 6), (12, "synthetic", 4, 64),
                (11, "synthetic", 5, 16), (12, "flat", 6, 16)])
@given(V=st.sampled_from([3000, 5001]), source=st.integers(0, 2**32 - 1),
       specs=st.lists(st.tuples(st.sampled_from(range(len(TICK_CHAINS))),
                                st.sampled_from(["synthetic", "ties", "flat", "neg_inf"]),
                                st.integers(0, 2**32), st.sampled_from([6, 9, 16, F.K_MIN])), min_size=2, max_size=8))
def test_a_tick_of_several_sequences_is_each_ones_host_path(V, source, specs):
    """fastpath.sample_tick over several sequences at once (its batched plans stack rows
    of the same plan and K): each answer is its own sequence's host path's, each reason
    leaves its own stream untouched."""
    rows, _ = rows_and_masks(source, V, [style for _, style, _, _ in specs], None)
    params = [SamplerParams(**TICK_CHAINS[c], seed=seed) for c, _, seed, _ in specs]
    tick_vs_host(V, rows, params, [k for _, _, _, k in specs])


def tick_vs_host(V: int, rows: list[np.ndarray], params: list[SamplerParams], ks: list[int],
                 preselect=by_reference) -> None:
    """The tick property: sample_tick over one sequence per row, each answer its own
    sequence's host path's, each row's the same alone in a tick (``preselect``: as in
    fast_vs_host, all rows of the tick one decode)."""
    fast = [SequenceSampler(p, V) for p in params]
    host = [SequenceSampler(p, V) for p in params]
    us = [h.peek() for h in host]
    pres = preselect(rows, [F.order(f, None, k) for f, k in zip(fast, ks)])
    alone = [SequenceSampler(p, V) for p in params]  # each row alone in a tick: the same result
    got = F.sample_tick(fast, pres, [None] * len(fast))
    for a, pre, g in zip(alone, pres, got):
        assert repr(F.sample_tick([a], [pre], [None])[0]) == repr(g)
    for g, f, h, row, p, u in zip(got, fast, host, rows, params, us):
        want = h.sample(row)
        if isinstance(g, str):
            TALLY["reasons"] += 1
            assert repr(f.sample(row)) == repr(want)
        else:
            TALLY["answers"] += 1
            if check_answer(g, want, row, p, None, NO_HIST, u) != "same":
                TALLY["near"] += 1
        assert f.peek() == h.peek()


def test_a_tick_of_dense_draws_is_each_rows_own_draw():
    """fastpath_dense.dense_tick against fastpath.sample (its per-row _dense) bit for bit,
    over one tick of many rows: rows whose draw lands in a block without mass (-inf
    regions), whose blocks handed back miss the draw (a reason, nothing drawn), with and
    without nProbs, float32 masses as Presampler.read hands them back, and vocabularies
    that are not a multiple of BLOCK."""
    for V in (3 * BLOCK + 5, 8 * BLOCK):
        rng = np.random.default_rng(V)
        params, pres, rows = [], [], []
        for i in range(24):
            p = SamplerParams(top_k=0, top_p=1.0, temperature=(0.9, 1.0, 2.5)[i % 3], n_probs=(0, 0, 3)[i % 3 - 1],
                              seed=i)
            row = make_row(rng, V, ("synthetic", "neg_inf", "flat", "ties")[i % 4]).copy()
            if i % 5 == 0:
                row[: 2 * BLOCK] = -np.inf  # the first blocks without mass
            pre = reference(row, F.order(SequenceSampler(p, V), None))
            pre = dataclasses.replace(pre, blocks=pre.blocks.astype(np.float32),
                                      dense={b: c.astype(np.float32) for b, c in pre.dense.items()})
            if i % 7 == 3:  # the graph's blocks around the draw, moved: the draw lands outside
                pre = dataclasses.replace(pre, dense={b + 2: c for b, c in pre.dense.items()})
            if i % 6 == 5:  # block masses above their tokens' sum: draws past a block's end (to
                # its last token with mass), and no longer the host's draw (not compared with it)
                pre = dataclasses.replace(pre, blocks=pre.blocks * np.float32(1.5))
            params.append(p), pres.append(pre), rows.append(row)
        tick = [SequenceSampler(p, V) for p in params]
        got = F.sample_tick(tick, pres, [None] * len(tick))
        reasons = 0
        for i, (p, pre, row, g, t) in enumerate(zip(params, pres, rows, got, tick)):
            one = SequenceSampler(p, V)
            want = F.sample(one, pre, None)
            assert repr(g) == repr(want)
            assert t.peek() == one.peek()
            if isinstance(g, str):
                reasons += 1
                assert t.peek() == SequenceSampler(p, V).peek()  # nothing drawn
            else:
                assert g.path == "graph"
                if i % 6 != 5:
                    u = SequenceSampler(p, V).peek()
                    check_answer(g, SequenceSampler(p, V).sample(row), row, p, None, NO_HIST, u)
        assert 0 < reasons < len(got) // 2


def test_a_dense_row_whose_stream_moved_since_its_order_is_decided_alone():
    """dense_tick draws with the uniform order() peeked and checks the row's draw gives
    it back: when the stream moved between the order and the tick (a stale order), the
    draw is taken back (SequenceSampler.undraw) and the row gets what fastpath.sample
    gives on the moved stream, whatever the other rows; the streams then go on alike."""
    V = 6 * BLOCK
    rng = np.random.default_rng(12)
    p = SamplerParams(top_k=0, top_p=1.0, temperature=0.8, seed=4)
    for moved in range(4):
        rows = [make_row(rng, V, "flat") for _ in range(3)]
        tick = [SequenceSampler(p.replace(seed=4 + i), V) for i in range(3)]
        pres = [reference(r, F.order(t, None)) for r, t in zip(rows, tick)]
        alone = SequenceSampler(p.replace(seed=5), V)
        for t in (tick[1], alone):
            for _ in range(moved):
                t.draw()
        got = F.sample_tick(tick, pres, [None] * 3)
        want = F.sample(alone, pres[1], None)
        assert repr(got[1]) == repr(want)
        assert [tick[1].draw() for _ in range(3)] == [alone.draw() for _ in range(3)]
        assert not isinstance(got[0], str) and not isinstance(got[2], str)
        if moved == 0:  # not stale: the batched draw's answer
            assert not isinstance(got[1], str) and got[1].path == "graph"


def test_the_batched_orders_are_lexsorts():
    """batch._canonical (the canonical order per row by one uint64 key, or two stable
    sorts) is np.lexsort((ids, -v)) per row: ties, -inf, -0.0 next to 0.0, and values
    that are not float32 (the stable sorts)."""
    from clickpaca.sampling.batch import _canonical
    rng = np.random.default_rng(5)
    for f32 in (True, False):
        v = np.round(rng.standard_normal((40, 70)) * 2) / 2
        v[rng.random(v.shape) < 0.1] = -np.inf
        v[rng.random(v.shape) < 0.05] = -0.0
        v[rng.random(v.shape) < 0.05] = 0.0
        if not f32:
            v = v + 1e-12 * rng.standard_normal(v.shape)  # not float32: two stable sorts
        ids = np.stack([rng.permutation(262144)[:70] for _ in range(40)]).astype(np.int32)
        got = _canonical(ids, v)
        for r in range(40):
            assert got[r].tolist() == np.lexsort((ids[r], -v[r])).tolist()
        # rows already canonical (as the pre-selection hands them back) are only checked;
        # one tie with its ids the wrong way round among them has them sorted
        o = np.lexsort((ids, -v), axis=1)
        ids_c, v_c = np.take_along_axis(ids, o, 1), np.take_along_axis(v, o, 1)
        assert _canonical(ids_c, v_c) is None  # nothing to sort
        r, c = next((r, c) for r in range(40) for c in range(69) if v_c[r, c] == v_c[r, c + 1])
        ids_c[r, [c, c + 1]] = ids_c[r, [c + 1, c]]
        got = _canonical(ids_c, v_c)
        assert got[r].tolist() == np.lexsort((ids_c[r], -v_c[r])).tolist() != list(range(70))
        assert all(got[x].tolist() == list(range(70)) for x in range(40) if x != r)
        assert _canonical(ids_c[:1], v_c[:1]) is None or r == 0


@st.composite
def touched_chains(draw) -> dict:
    """Chains fastpath_touched batches: logit bias (bans, no force) and penalties over a
    history, in either order, then top-k [top-p] [temperature]; bias ids and history as
    ranks (by_rank), often among the best tokens and at the edge of the K best, or (as in
    a real window and the bench's bias) all far below the best, where the batch takes the
    K best's own first columns."""
    pre = draw(st.permutations(["logit_bias", "penalties"]))
    ranks = draw(st.sampled_from([RANKS, RANKS, FAR]))
    tail = ["top_k"] + (["top_p"] if draw(st.booleans()) else []) + (["temperature"] if draw(st.booleans()) else [])
    return chain_of(samplers=None if draw(st.integers(0, 3)) == 0 else pre + tail,
                    top_k=draw(st.sampled_from([2, 3, 5, 8, 16, 40, 63, 64, 200])),
                    top_p=draw(st.sampled_from([0.95, 0.8, 0.5, 0.1, 0.999])),
                    temperature=draw(st.sampled_from([0.3, 0.7, 1.5])),
                    penalty_repeat=draw(st.sampled_from([1.0, 1.1, 1.5, 0.8])),
                    penalty_freq=draw(st.sampled_from([0.0, 0.1, 0.5])),
                    penalty_present=draw(st.sampled_from([0.1, 0.3, -0.5])),  # never 0: penalties on
                    penalty_last_n=draw(st.sampled_from([8, 64, -1])),
                    bias=draw(st.lists(st.tuples(ranks, st.sampled_from([b for b in BIASES if b < 1e9])),
                                       max_size=5, unique_by=lambda t: t[0])),
                    history=draw(st.lists(ranks, min_size=1, max_size=40)),
                    seed=draw(st.integers(0, 2**63 - 1)))


def touched_tick(V: int, rows: list[np.ndarray], chains: list[dict], ks: list[int], edges=None,
                 preselect=by_reference) -> None:
    """sample_tick over sequences with touched tokens (fastpath_touched's batch): each
    answer is its own sequence's host path's, each reason leaves its stream untouched, and
    each row's result is the one it gets alone in a tick (nothing depends on the others).
    ``edges[i]``: None, or (bias, at): a bias on the row's token of rank K + at, K the
    order's without it (so the K-th value handed back is a touched token's, or its
    neighbour's), as in test_a_touched_token_at_the_edge_of_the_k_best.
    ``preselect``: as in fast_vs_host."""
    made = [params_of(c, row) for c, row in zip(chains, rows)]
    for i, edge in enumerate(edges or ()):
        if edge is not None:
            (p, h), (bias, at) = made[i], edge
            k0 = F.order(SequenceSampler(p, V, prompt_tokens=h), None, ks[i]).k
            target = int(np.argsort(-rows[i], kind="stable")[min(k0 + at, V - 1)])
            if all(t != target for t, _ in p.logit_bias):
                made[i] = (p.replace(logit_bias={**dict(p.logit_bias), target: bias}), h)
                note(f"edge {at:+d}")
    fast = [SequenceSampler(p, V, prompt_tokens=h) for p, h in made]
    host = [SequenceSampler(p, V, prompt_tokens=h) for p, h in made]
    alone = [f.fork() for f in fast]
    single = [f.fork() for f in fast]
    for f in fast:  # the chains the test is for: every one goes through the batch
        assert _touched_plan(f) is not None, f.params
    us = [h.peek() for h in host]
    pres = preselect(rows, [F.order(f, None, k) for f, k in zip(fast, ks)])
    got = F.sample_tick(fast, pres, [None] * len(fast))
    for g, f, h, a, one, row, (p, _), u, pre in zip(got, fast, host, alone, single, rows, made, us, pres):
        assert repr(F.sample_tick([a], [pre], [None])[0]) == repr(g)  # deterministic: alone, the same
        assert a.peek() == f.peek()
        # fastpath.sample refuses (and why) exactly where the batch does
        ref = F.sample(one, pre, None)
        assert (ref if isinstance(ref, str) else None) == (g if isinstance(g, str) else None), (ref, g)
        want = h.sample(row)
        if isinstance(g, str):
            TALLY["reasons"] += 1
            note(f"reason: {g}")
            assert repr(f.sample(row)) == repr(want)
        else:
            TALLY["answers"] += 1
            note("answer")
            if check_answer(g, want, row, p, None, h.penalty_window(), u) != "same":
                TALLY["near"] += 1
        assert f.peek() == h.peek()


@settings(max_examples=150)
# the bench's chain (bench.SCENARIOS["bias_penalties"]) on two Gemma-like rows: top-k 40,
# top-p 0.95, temperature 0.7 after a bias (two bans, three shifts) and penalties
@example(V=32000, source="bench_bias_penalties_chain",
         specs=[(chain_of(samplers=None, top_k=40, top_p=0.95, temperature=0.7, penalty_repeat=1.1,
                          penalty_freq=0.1, penalty_present=0.1, penalty_last_n=64,
                          bias=[(0, -1e9), (1, 2.0), (300, -1e9), (2, 5.0), (400, -3.0)],
                          history=[0, 3, 5, 7, 300, 301, 3, 2], seed=s), "synthetic", k, None)
                for s, k in ((1, F.K_MIN), (2, 16))])
# a bias lifts a token from outside the K best to the top; another bans the best one
@example(V=3000, source="bias_lifts_and_bans",
         specs=[(chain_of(samplers=["penalties", "logit_bias", "top_k", "temperature"], top_k=5, temperature=1.5,
                          penalty_present=0.3, penalty_last_n=64, bias=[(400, 10.0), (0, -1e9)], history=[1, 2],
                          seed=3), "synthetic", 8, None),
                (chain_of(samplers=["logit_bias", "penalties", "top_k"], top_k=3, penalty_repeat=1.5,
                          penalty_last_n=8, bias=[(9, -0.5)], history=[0, 8, 9, 10], seed=4), "ties", 8, None)])
@given(V=st.sampled_from([3000, 5001, 32000]), source=st.integers(0, 2**32 - 1),
       specs=st.lists(st.tuples(touched_chains(), st.sampled_from(["synthetic", "synthetic", "ties", "flat",
                                                                  "neg_inf", "nan"]),
                                st.sampled_from([8, 16, F.K_MIN]),
                                st.one_of(st.none(), st.tuples(st.sampled_from([b for b in BIASES if b < 1e9]),
                                                               st.sampled_from([-1, 0, 1])))),
                      min_size=1, max_size=6))
def test_a_tick_with_touched_tokens_is_each_ones_host_path(V, source, specs):
    rows, _ = rows_and_masks(source, V, [style for _, style, _, _ in specs], None)
    touched_tick(V, rows, [c for c, _, _, _ in specs], [k for _, _, k, _ in specs], [e for _, _, _, e in specs])


@pytest.mark.parametrize("inside", [False, True])
def test_a_touched_value_that_ties_an_untouched_one_keeps_the_canonical_order(inside):
    """fastpath_touched sorts a row's values stably from the K best's canonical order, so
    a touched token whose value after the bias equals the second best's comes after it
    there, though its smaller id puts it first (canonical order): the row is sorted again
    by (value, id). With top-k 2 the tie decides the set ({500, 100}, not {500, 700}):
    every seed draws what the host path draws. The touched token comes from outside the K
    best (rank far below) or from inside it (rank 3, moved up by the bias to the tie)."""
    V = 3000
    row = np.full(V, -20.0, np.float32)
    row[500], row[700] = 10.0, 9.0  # integers: value + bias is exact, the tie too
    row[100] = 8.0 if inside else 5.0
    for i in range(20):  # the rest of the K best, far from the two
        row[1000 + i] = -10.0 - i
    p = SamplerParams(samplers=["logit_bias", "top_k"], top_k=2, logit_bias={100: 9.0 - float(row[100])})
    drawn = set()
    for seed in range(40):
        q = p.replace(seed=seed)
        fast, host = SequenceSampler(q, V), SequenceSampler(q, V)
        assert _touched_plan(fast) is not None
        got = F.sample_tick([fast], [reference(row, F.order(fast, None, 8))], [None])[0]
        want = host.sample(row)
        assert not isinstance(got, str) and got.token == want.token, (seed, got, want)
        drawn.add(got.token)
    assert drawn == {500, 100}


# ------------------------------------------------------------------ route and the rows


def test_preselected_rows_are_the_ones_tested():
    """The rows that say ``preselected`` are exactly the steps the property above runs;
    every other row (but the grammar, never run by name) has a way to switch it on in
    HOST_ONLY, which route must name. A new row marked preselected fails here until
    the property covers it."""
    rows = R.steps()
    assert {s.name for s in rows if s.preselected} == set(PRESELECTED)
    assert {s.name for s in rows if not s.preselected} == set(HOST_ONLY) | {"grammar"}


@settings(max_examples=60)
@given(name=st.sampled_from(sorted(HOST_ONLY)), order=st.permutations(PRESELECTED), at=st.integers(0, 6),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), n_probs=st.integers(0, 10),
       grammar=st.booleans(), history=st.booleans())
def test_route_names_the_step_that_needs_the_whole_row(name, order, at, temperature, n_probs, grammar, history):
    samplers = list(order)
    samplers.insert(at, name)
    p = SamplerParams(samplers=samplers, temperature=temperature, n_probs=n_probs, top_k=40, top_p=0.9,
                      min_p=0.05, penalty_present=0.5, logit_bias={3: 1.0}, seed=1, **HOST_ONLY[name])
    s = SequenceSampler(p, 5000, prompt_tokens=[1, 2, 3] if history else ())
    assert F.route(s, grammar) == name
    assert F.route(SequenceSampler(p.replace(trace=True), 5000), grammar) == "trace"


def test_route_names_a_user_step():
    """A step registered by a user (usersteps) has no ``preselected``: its chain goes to
    the host, named."""
    step = R.Step("fastpath_test_drop", R.GENERAL, run=lambda ids, logits, p, ctx: (ids, logits),
                  off=lambda p, has_hist: False)
    R.register(step, before="temperature")
    try:
        s = SequenceSampler(SamplerParams(seed=1), 5000)
        assert F.route(s, False) == "fastpath_test_drop"
    finally:
        R.unregister("fastpath_test_drop")
    assert F.route(SequenceSampler(SamplerParams(seed=1), 5000), False) is None


# ------------------------------------------------------------------ the superset check


def hand_built(vals: list[float], V: int = 2 * BLOCK) -> np.ndarray:
    """A row whose best values are ``vals`` (ids 10, 11, ...), the rest far below."""
    row = np.full(V, -30.0, np.float32)
    row[10:10 + len(vals)] = vals
    return row


def fast(p: SamplerParams, row: np.ndarray, k: int = F.K_MIN, pre: Preselected | None = None):
    """fastpath.sample for a fresh sampler of p, on what the graph hands back with K = k
    (``order(..., k)``; or ``pre``); its stream must then be where a fresh one's is
    (nothing drawn: a reason) or one draw on (an answer)."""
    s = SequenceSampler(p, row.size)
    got = F.sample(s, pre if pre is not None else reference(row, F.order(s, None, k)), None)
    fresh = SequenceSampler(p, row.size)
    if not isinstance(got, str):
        fresh.draw()
    assert s.peek() == fresh.peek()
    return got


def test_a_truncation_reaching_the_kth_value_needs_the_whole_row():
    row = hand_built([5.0, 4.0, 3.0, 2.0])
    K4 = RowOrder(k=4)  # hand-built: order() asks one more than a top-k keeps
    # top-k keeps the 4 values handed back: the 4th is the floor, a 5th token may equal it
    p = SamplerParams(samplers=["top_k"], top_k=4, seed=7)
    pre = reference(row, K4)
    assert pre.ids.size == 4 and pre.floor == 2.0
    assert fast(p, row, pre=pre) == F.PAST_K
    # what order() asks (K 5) is answered, as the host answers
    got = fast(p, row, F.K_MIN)
    assert not isinstance(got, str) and got.token == SequenceSampler(p, row.size).sample(row).token
    # top-k 3 keeps the three above the floor: the graph's answer, the host's token
    p3 = p.replace(top_k=3)
    got = fast(p3, row, pre=pre)
    assert not isinstance(got, str) and got.path == "graph"
    assert got.token == SequenceSampler(p3, row.size).sample(row).token
    # min-p and top-p that keep every value handed back, with a temperature before them
    # (the floor compared at the chain's scale) or not
    for q, o in ((SamplerParams(samplers=["min_p"], min_p=0.01, top_k=0, seed=7), K4),
                 (SamplerParams(samplers=["top_p"], top_p=0.9999, top_k=0, seed=7), K4),
                 (SamplerParams(samplers=["temperature", "top_k"], temperature=0.5, top_k=4, seed=7),
                  RowOrder(k=4, inv_tau=2.0)),
                 (SamplerParams(samplers=["temperature", "min_p"], temperature=3.0, min_p=0.2, top_k=0, seed=7),
                  RowOrder(k=4, inv_tau=1 / 3.0))):
        assert fast(q, row, pre=reference(row, o)) == F.PAST_K, q
        # ... and with the K order() asks, answered as the host answers
        got = fast(q, row, F.K_MIN)
        assert not isinstance(got, str) and got.token == SequenceSampler(q, row.size).sample(row).token


def test_a_touched_kth_value_is_no_floor():
    """When the K-th token is touched (here banned), the untouched values handed back all
    lie above the K-th value: a truncation keeping every one of them must still be
    refused, since it would keep the tokens left out too (ids 14, 15 here)."""
    row = hand_built([5.0, 4.0, 3.0, 2.0, 1.9, 1.8])
    p = SamplerParams(samplers=["logit_bias", "min_p"], logit_bias={13: -1e9}, min_p=0.01, top_k=0, seed=7)
    o = F.order(SequenceSampler(p, row.size), None, 3)
    pre = reference(row, o)
    assert o.touched.tolist() == [13] and pre.ids.tolist() == [10, 11, 12, 13] and pre.floor == 2.0
    assert SequenceSampler(p, row.size).sample(row).n_candidates == 5
    assert fast(p, row, 3) == F.PAST_K
    # a min-p that drops the smallest untouched value (3) is decided: the host's answer
    q = p.replace(min_p=0.3)
    got = fast(q, row, 3)
    want = SequenceSampler(q, row.size).sample(row)
    assert not isinstance(got, str) and (got.token, got.n_candidates) == (want.token, want.n_candidates) == (10, 2)


def test_a_tick_with_touched_tokens_refuses_a_top_k_reaching_the_floor():
    """fastpath_touched's batch: the second best token banned, K = 4 (ids 10-13 handed
    back), so the floor is 2.0 (id 13's, untouched). Top-k 3 keeps ids 10, 12, 13: a value
    not above the floor, refused (PAST_K, nothing drawn) as fastpath.sample refuses it;
    top-k 2 beside it in the same tick stays above it: the host's answer. A presence
    penalty of 2 on id 12 lowers it below id 13: top-k 2 keeps 10 and 13, at the floor
    again: refused; one of 0.5 leaves it above: answered."""
    row = hand_built([5.0, 4.0, 3.0, 2.0, 1.9, 1.8])
    V = row.size
    base = SamplerParams(samplers=["logit_bias", "penalties", "top_k"], logit_bias={11: -1e9}, top_k=3, seed=7)
    cases = [(base, [], F.PAST_K), (base.replace(top_k=2), [], None),
             # the K-th token (13) banned instead: the floor is 3.0 (id 12's), not the K-th
             # value 2.0, as fastpath.sample takes it: top-k 3 keeps 3.0, refused
             (base.replace(logit_bias={13: -1e9}), [], F.PAST_K),
             (base.replace(top_k=2, penalty_present=2.0, penalty_last_n=64), [12], F.PAST_K),
             (base.replace(top_k=2, penalty_present=0.5, penalty_last_n=64), [12], None)]
    ss = [SequenceSampler(p, V, prompt_tokens=h) for p, h, _ in cases]
    assert all(_touched_plan(s) is not None for s in ss)
    pres = [reference(row, F.order(s, None), k=4) for s in ss]  # K 4 (the order asks for more)
    assert all(pre.ids.tolist() == [10, 11, 12, 13] for pre in pres)
    alone = [s.fork() for s in ss]
    got = F.sample_tick(ss, pres, [None] * len(ss))
    for g, s, a, pre, (p, h, want) in zip(got, ss, alone, pres, cases):
        assert F.sample(a, pre, None) == g if isinstance(g, str) else repr(F.sample(a, pre, None)) == repr(g)
        fresh = SequenceSampler(p, V, prompt_tokens=h)
        if want is not None:
            assert g == want
            assert s.peek() == fresh.peek()  # nothing drawn
        else:
            host = fresh.sample(row)
            assert not isinstance(g, str) and (g.token, g.n_candidates, g.path) == (host.token, 2, "graph")
            assert s.peek() == fresh.peek()


@pytest.mark.parametrize("bias, want", [(1e9, 0), (-1e9, -1)])
def test_a_top_k_past_the_finite_values_keeps_neg_inf_tokens(bias, want):
    """A row with 2 finite values (ids 10, 11), top-k 4, then a bias on one of them or on
    the -inf token 0: the host's top-k keeps ids 0 and 1 besides (-inf, the smallest ids),
    so forcing token 0 draws it, and banning both finite ones leaves -inf tokens (empty
    after the draw, not after the bias)."""
    V = 2 * BLOCK + 1
    row = np.full(V, -np.inf, np.float32)
    row[[10, 11]] = [3.0, 2.0]
    bans = {0: bias} if bias > 0 else {10: bias, 11: bias}
    p = SamplerParams(samplers=["top_k", "logit_bias"], top_k=4, temperature=1.0, logit_bias=bans, seed=3)
    host = SequenceSampler(p, V).sample(row)
    got = fast(p, row, 64)
    assert host.token == want and (host.reason is None) == (want >= 0)
    assert not isinstance(got, str), got
    assert (got.token, got.empty, got.reason, got.n_candidates) == (host.token, host.empty, host.reason,
                                                                    host.n_candidates)


def test_a_tie_at_the_kth_value_needs_the_whole_row():
    # values 5, 4, 3, 3, 3 (ids 10..14), K = 4: top-k 3 keeps 5, 4 and one 3 (the smallest
    # id, 12), a value equal to the floor: the K best cannot say which 3 (the graph may
    # hand back any of the tied ids)
    row = hand_built([5.0, 4.0, 3.0, 3.0, 3.0])
    p = SamplerParams(samplers=["top_k"], top_k=3, seed=7)
    pre = reference(row, F.order(SequenceSampler(p, row.size), None, 4))
    assert pre.floor == 3.0 and pre.ids.tolist() == [10, 11, 12, 13]
    assert fast(p, row, 4) == F.PAST_K
    # the same with another tie-break: ids 10, 11, 14, 13
    alt = Preselected(order=pre.order, ids=np.array([10, 11, 14, 13], np.int32),
                      vals=np.array([5, 4, 3, 3], np.float32), top=5.0, blocks=pre.blocks, dense=None,
                      raw_max=None, raw_mass=None, raw_ids=None, raw_vals=None, touched=pre.touched)
    assert fast(p, row, pre=alt) == F.PAST_K
    # sample_tick's batched top-k (the plain top-k chain, with and without a temperature)
    # refuses both too: its floor check on the [m, K] matrix
    for q in (p, SamplerParams(samplers=["top_k", "temperature"], top_k=3, temperature=0.5, seed=7)):
        ss = [SequenceSampler(q, row.size) for _ in range(2)]
        assert F.sample_tick(ss, [pre, alt], [None, None]) == [F.PAST_K, F.PAST_K]
        assert [x.peek() for x in ss] == [SequenceSampler(q, row.size).peek()] * 2
    # top-k 2 stays above the tie: answered, and the host's token, whatever the tie-break
    p2 = p.replace(top_k=2)
    pre2 = reference(row, F.order(SequenceSampler(p2, row.size), None, 4))
    alt2 = dataclasses.replace(alt, order=pre2.order)
    for pp in (pre2, alt2):
        got = fast(p2, row, pre=pp)
        assert not isinstance(got, str) and got.token == SequenceSampler(p2, row.size).sample(row).token
    # ... but nProbs 3 or 4 reach the tie (the host's 4 best: ids 10, 11, 12, 13): refused
    # (hand-built K 4: order() asks one more than nProbs)
    pre_q = reference(row, RowOrder(k=4))
    for n_probs in (3, 4):
        q = p2.replace(n_probs=n_probs)
        for pp in (pre_q, dataclasses.replace(alt, order=pre_q.order, blocks=pre_q.blocks)):
            assert fast(q, row, pre=pp) == "nProbs reach past the K best"
    # and nProbs 2 stay above it: answered, the host's n best
    q = p2.replace(n_probs=2)
    got = fast(q, row, 4)
    assert not isinstance(got, str) and close_tops(got.top, SequenceSampler(q, row.size).sample(row).top)
    assert [i for i, _ in got.top] == [10, 11]


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_top_p_after_penalised_plausible_tokens(top_p):
    """Penalties on the two best tokens before top-p: the mass left out of the K best is
    the block masses minus the K best's and the touched tokens' own (their raw mass
    belongs to no block left out). Seeded rows: most are answered, all as the host."""
    answered = 0
    for seed in range(24):
        rng = np.random.default_rng(seed)
        V = 32000
        row = make_row(rng, V, "synthetic")
        best = np.argsort(-row)[:2].tolist()
        p = SamplerParams(samplers=["penalties", "top_p"], penalty_present=3.0, penalty_last_n=64, top_p=top_p,
                          n_probs=2, seed=seed)
        s = SequenceSampler(p, V, prompt_tokens=best)
        got = F.sample(s, reference(row, F.order(s, None)), None)
        if isinstance(got, str):
            continue
        answered += 1
        want = SequenceSampler(p, V, prompt_tokens=best).sample(row)
        u = SequenceSampler(p, V).peek()
        assert check_answer(got, want, row, p, None, s.penalty_window(), u) == "same", seed
    assert answered >= 12


def test_fewer_allowed_than_k_is_answered():
    """When the grammar allows fewer tokens than K, the -inf values handed back are not a
    floor: every allowed token is among them, and the fast path answers."""
    V = 3 * BLOCK + 5
    rng = np.random.default_rng(3)
    row = make_row(rng, V, "synthetic")
    allowed = np.zeros((V + 31) // 32 * 32, np.uint8)
    allowed[[7, 900, 2000, V - 1]] = 1
    words = np.packbits(allowed, bitorder="little").view(np.int32)
    p = SamplerParams(samplers=["top_p", "temperature"], top_p=0.5, temperature=0.8, n_probs=3, seed=11)
    s = SequenceSampler(p, V)
    pre = reference(row, F.order(s, words))
    got = F.sample(s, pre, words)
    want = SequenceSampler(p, V).sample(row, words)
    assert not isinstance(got, str), got
    assert check_answer(got, want, row, p, words, NO_HIST, SequenceSampler(p, V).peek()) == "same"


def test_a_top_k_keeping_every_allowed_token_leaves_the_bias_after_it():
    """top-k 40 with a grammar allowing 3 tokens does not truncate, so a logit bias after
    it runs before the first truncation (greedy): the order must ask for the banned token
    (it was planned for the whole vocabulary, and the ban was lost: the fast path drew it)."""
    V = 4 * BLOCK + 3
    row = hand_built([9.0, 8.0, 7.0], V)
    allowed = np.zeros((V + 31) // 32 * 32, np.uint8)
    allowed[[10, 11, 12]] = 1
    words = np.packbits(allowed, bitorder="little").view(np.int32)
    p = SamplerParams(samplers=["top_k", "logit_bias", "temperature"], top_k=40, temperature=0.0,
                      logit_bias={10: -1e9}, n_probs=2, seed=5)
    s = SequenceSampler(p, V)
    o = F.order(s, words)
    got = F.sample(s, reference(row, o), words)
    want = SequenceSampler(p, V).sample(row, words)
    assert want.token == 11
    assert not isinstance(got, str) and got.token == 11, got  # not the banned 10
    assert check_answer(got, want, row, p, words, NO_HIST, SequenceSampler(p, V).peek()) == "same"
    assert o.touched.tolist() == [10]


def test_a_dense_draw_never_lands_on_a_banned_token():
    """A grammar allowing 3 tokens under top-k 40: nothing truncates, the draw is over the
    whole allowed set, and the ban on the dominant one leaves no touched token standing;
    its mass is still in the blocks the graph summed, so the fast path must not draw
    from them (it drew the banned token)."""
    V = 3 * BLOCK
    row = hand_built([20.0, 1.0, 0.5], V)
    allowed = np.zeros(V, np.uint8)
    allowed[[10, 11, 12]] = 1
    words = np.packbits(allowed, bitorder="little").view(np.int32)
    p = SamplerParams(samplers=["logit_bias", "top_k", "temperature"], top_k=40, temperature=1.0,
                      logit_bias={10: -1e9}, seed=3)
    s = SequenceSampler(p, V)
    got = F.sample(s, reference(row, F.order(s, words)), words)
    want = SequenceSampler(p, V).sample(row, words)
    assert want.token in (11, 12)
    assert got == "dense draw with touched tokens", got
    assert repr(s.sample(row, words)) == repr(want)


def test_values_pre_selected_for_another_plan_are_refused():
    """An order made for other params (here without the temperature and the bias) is not
    used: a reason, nothing drawn."""
    V = 2 * BLOCK
    row = hand_built([9.0, 8.0, 7.0], V)
    p = SamplerParams(samplers=["logit_bias", "temperature", "top_k"], top_k=2, temperature=0.5,
                      logit_bias={10: -1e9}, seed=5)
    other = reference(row, F.order(SequenceSampler(p.replace(temperature=1.0, logit_bias={}), V), None))
    assert fast(p, row, pre=other) == "pre-selected for another plan"
    assert not isinstance(fast(p, row), str)


def test_a_tick_refuses_touched_values_pre_selected_for_another_plan():
    """fastpath_touched's batch: an order made before a bias was set, or before the
    history gained a token (the penalty window's), misses a token the chain adjusts: a
    reason, nothing drawn, as fastpath.sample gives; the rows beside them are answered."""
    V = 2 * BLOCK
    row = hand_built([9.0, 8.0, 7.0, 6.5], V)
    p = SamplerParams(samplers=["logit_bias", "penalties", "top_k"], top_k=2, logit_bias={12: 5.0},
                      penalty_present=1.0, penalty_last_n=64, seed=5)
    ss = [SequenceSampler(p, V, prompt_tokens=[11]) for _ in range(4)]
    no_bias = SequenceSampler(p.replace(logit_bias={13: 1.0}), V, prompt_tokens=[11])
    pres = [reference(row, F.order(s, None)) for s in [no_bias] + ss[1:]]
    ss[2].accept(10)  # the window now holds 10, which the order did not ask for
    assert all(_touched_plan(s) is not None for s in ss)
    fresh = [s.fork() for s in ss]
    got = F.sample_tick(ss, pres, [None] * 4)
    assert got[0] == got[2] == "pre-selected for another plan"
    assert [F.sample(f, pre, None) for f, pre in zip(fresh[::2], pres[::2])] == [got[0], got[2]]
    assert [s.peek() for s in ss[::2]] == [f.peek() for f in fresh[::2]]
    for g, s in zip(got[1::2], ss[1::2]):
        assert not isinstance(g, str) and g.token in (10, 12) and g.n_candidates == 2


def test_the_near_boundary_rule_excuses_rounding_only():
    """The helper the property leans on: a token the host draws with u moved by 1e-7 past
    a cumulative edge is near a boundary; a token two edges away is not."""
    V = 3000
    row = hand_built([2.0, 1.5, 1.0, 0.5, 0.0], V)
    p = SamplerParams(samplers=["top_k"], top_k=5, n_probs=3, seed=1)
    cand = apply_chain(row, p)
    ids, logits = cand.materialize()
    o = np.argsort(ids)
    e = np.exp(logits[o] - logits.max())
    cum = np.concatenate(([0.0], np.cumsum(e) / e.sum()))  # token 10 + j: u in [cum[j], cum[j + 1])
    edge = float(cum[2])  # between ids 11 and 12
    u = edge + 1e-7
    host = Host(row, p, None, NO_HIST, u)
    assert host.token == 12 and same_decision(host, host)
    for tok, at, near in ((11, edge - 1e-7, "draw -1e-06"), (13, (cum[3] + cum[4]) / 2, None),
                          (10, cum[1] / 2, None)):
        other = Host(row, p, None, NO_HIST, float(at))
        assert other.token == tok
        assert not same_decision(other, host)
        assert near_boundary(other, row, p, None, NO_HIST, u) == near


_SETS = st.lists(st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(0, 300_000), max_size=80),
                 min_size=1, max_size=4)


#: a row's penalty window: its tokens with repeats (ids of a vocabulary), or None
_WINDOW = st.none() | st.lists(st.integers(0, 40) | st.integers(0, 2**31 - 1), max_size=70)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.none() | _SETS, _WINDOW), min_size=1, max_size=6), st.booleans())
def test_touched_ids_are_the_union_of_each_steps_ids(rows, wide):
    """order_many's touched ids per row (bias and penalty ids together, every row of the
    tick in one sort): sorted, unique, int32, as np.unique gives them from that row's
    sets and window alone (sorted or not, int32 or int64), whatever the other rows hold;
    with a window, each id's count in it, 0 for the sets' other ids."""
    dtype = np.int64 if wide else np.int32
    sets = [None if r is None else [np.array(x, dtype) for x in r] for r, _ in rows]
    ids, counts = F._unions(sets, [np.array(w, np.int64) if w else None for _, w in rows])  # as window_array
    assert len(ids) == len(counts) == len(rows)
    for (r, w), g, c in zip(rows, ids, counts):
        assert g.dtype == np.int32
        every = [np.array(x, np.int64) for x in r or ()] + [np.array(w or [], np.int64)]
        assert np.array_equal(g, np.unique(np.concatenate(every)).astype(np.int32))
        if not w:
            assert c is None
            continue
        assert c.dtype == np.float64
        assert c.tolist() == [float(w.count(t)) for t in g.tolist()]


@settings(max_examples=100, deadline=None)
@given(hists=st.lists(st.lists(st.integers(0, 50), max_size=30), min_size=1, max_size=5),
       n=st.integers(-1, 12), bias=st.lists(st.integers(0, 60), max_size=4, unique=True),
       reads=st.lists(st.booleans(), min_size=5, max_size=5))
def test_each_order_keeps_its_sequences_window_counts(hists, n, bias, reads):
    """order_many hands each sequence the counts of its touched ids in its own penalty
    window (what the touched batch's penalties read), a window read before or not; a
    token accepted after the order, or another order's ids, get None (that row goes
    per sequence)."""
    p = SamplerParams(penalty_last_n=n, penalty_repeat=1.1, logit_bias={t: -0.5 for t in bias}, seed=1)
    tick = [SequenceSampler(p, 100, h) for h in hists]
    for s, read in zip(tick, reads):
        if read:
            s.penalty_window()
    orders = F.order_many(tick, [None] * len(tick), [F.K_MIN] * len(tick))
    for s, o in zip(tick, orders):
        ids, cnt = s.penalty_window()
        assert o.touched.tolist() == sorted(set(ids.tolist()) | set(bias))
        got = s.order_counts(o.touched)
        if not s.penalizes:
            assert got is None
            continue
        window = dict(zip(ids.tolist(), cnt.tolist()))
        assert got.tolist() == [window.get(t, 0.0) for t in o.touched.tolist()]
        assert s.order_counts(o.touched.copy()) is None
        f = s.fork()  # a fork has the same window: the order's counts hold for it, until it moves on
        assert f.order_counts(o.touched) is got
        f.accept(7)
        assert f.order_counts(o.touched) is None and s.order_counts(o.touched) is got
        s.accept(7)
        assert s.order_counts(o.touched) is None
