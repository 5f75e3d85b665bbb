"""The sampler chain: composes the steps exactly but cheaply; per-sequence state."""

from __future__ import annotations

import copy
import functools
import math
import secrets
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from . import steps as S
from .bitmask import allowed_ids, allows, as_words, count_allowed
from .candidates import Candidates, Dense, dense_exp, gather, raw_logprobs
from .cut import RowView, isin_sorted, upper_ids
from .params import FORCE, SamplerParams

__all__ = ["Candidates", "SampleResult", "SequenceSampler", "apply_chain", "EMPTY_REASONS"]

#: With a grammar allowing at most this many tokens, the allowed ids are listed outright.
EXPLICIT_MAX = 4096

#: Why a candidate set became empty, by the step that emptied it.
EMPTY_REASONS = {
    "grammar": "the grammar allows no token",
    "logit_bias": "logit_bias bans every token still allowed",
    "sample": "no candidate has a finite logit",
}


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One sampled token.

    token: the token id, or -1 when ``empty`` (then ``reason`` says why; the caller
      should end the sequence with that error rather than decode on).
    n_candidates: size of the final candidate set (0 when empty).
    With n_probs > 0 (else None):
      logprob, top: the token's log-probability and the n_probs best (token, logprob)
        under the RAW model distribution (log-softmax of the unmodified row, temperature 1).
      steered_logprob, steered_top: the same under the distribution actually sampled from
        (softmax over the final candidates, after the whole chain incl. temperature);
        steered_top has at most n_probs entries, only tokens with non-zero probability
        (a single entry, logprob 0.0, when greedy).
    """

    token: int
    empty: bool = False
    reason: str | None = None
    n_candidates: int = 0
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    steered_logprob: float | None = None
    steered_top: tuple[tuple[int, float], ...] | None = None


def _truncates(name: str, p: SamplerParams, n_allowed: int) -> bool:
    if name == "top_k":
        return 0 < p.top_k < n_allowed
    if name == "min_p":
        return p.min_p > 0
    if name == "top_p":
        return p.top_p < 1
    if name == "temperature":
        return p.temperature <= 0
    return False


_ELEMENTWISE = ("logit_bias", "penalties")
_TRUNCATIONS = ("top_k", "min_p", "top_p")


@functools.lru_cache(maxsize=1024)
def _steps_to_run(p: SamplerParams, has_hist: bool, n_allowed: int) -> tuple[tuple[str, ...], int | None]:
    """(active steps, index of the first truncating one or None), cached: params are
    frozen and the answer depends only on them, on whether there is a penalty history
    and on how many tokens the grammar allows (the same every tick without a grammar)."""
    active = _active(p, has_hist)
    if p.temperature <= 0 and "temperature" in active:
        # Greedy: every truncation keeps the canonical first candidate, so one that runs
        # before greedy with no elementwise step after it cannot change the result.
        t = active.index("temperature")
        last_elementwise = max((i for i, s in enumerate(active) if s in _ELEMENTWISE), default=-1)
        active = [s for i, s in enumerate(active)
                  if not (s in _TRUNCATIONS and last_elementwise < i < t)]
    first = next((i for i, s in enumerate(active) if _truncates(s, p, n_allowed)), None)
    return tuple(active), first


def _active(p: SamplerParams, has_hist: bool) -> list[str]:
    """The listed steps minus those that are identities for these params."""
    out = []
    for name in p.steps:
        if name == "logit_bias" and not p.logit_bias:
            continue
        if name == "penalties" and (not has_hist or not p.penalties_active):
            continue
        if name == "top_k" and p.top_k <= 0:
            continue
        if name == "min_p" and p.min_p <= 0:
            continue
        if name == "top_p" and p.top_p >= 1:
            continue
        if name == "temperature" and p.temperature == 1.0:
            continue
        out.append(name)
    return out


def _run(name, ids, logits, p: SamplerParams, hist_ids, hist_counts):
    if name == "logit_bias":
        return S.logit_bias(ids, logits, *p.bias_arrays)
    if name == "penalties":
        return S.penalties(ids, logits, hist_ids, hist_counts, p.penalty_repeat, p.penalty_freq,
                           p.penalty_present)
    if name == "top_k":
        return S.top_k(ids, logits, p.top_k)
    if name == "min_p":
        return S.min_p(ids, logits, p.min_p)
    if name == "top_p":
        return S.top_p(ids, logits, p.top_p)
    if name == "temperature":
        return S.temperature(ids, logits, p.temperature)
    raise AssertionError(name)


_NO_HIST = (np.empty(0, np.int32), np.empty(0, np.float64))
_NO_IDS = np.empty(0, np.int32)
_NO_LOGITS = np.empty(0, np.float64)


def apply_chain(row: np.ndarray, params: SamplerParams, words: np.ndarray | None = None,
                hist: tuple[np.ndarray, np.ndarray] = _NO_HIST, *, view: RowView | None = None,
                timings: dict | None = None, explicit_max: int = EXPLICIT_MAX) -> Candidates:
    """Run the sampler chain on one raw logits row; return the candidates to sample from.

    Default order: grammar -> logit bias -> repetition penalties -> top-k -> min-p ->
    top-p -> temperature (-> sample, done by ``Candidates.sample``). ``params.samplers``
    may reorder or drop every step but the grammar, which always runs first when
    ``words`` (uint32 bitmask words, see ``bitmask.as_words``) is given: a hard
    constraint no other step may override. ``hist`` is (ids sorted, counts) of the
    penalty window. ``view`` lets the caller reuse the row's column maxima (and tests
    shape them); ``explicit_max`` (tests) moves the explicit-grammar threshold.

    The result is exactly that of running the ``steps`` functions in order over the
    whole vocabulary, without doing so. Up to the first truncating step the steps are
    elementwise (bias, penalties, positive temperature), and bias and penalties touch
    only a small set T of tokens. Every truncation keeps an upper set, so its result
    over the whole row equals its result over T (adjusted) united with a large enough
    upper set of the raw tokens outside T (rescaled by temperature), which
    ``cut.upper_ids`` finds from column maxima. Top-p needs the total mass, so it
    costs one exp over the row when it is the first truncation. From the first
    truncation on, the steps run on the small explicit set. With no truncation at all,
    the untouched tokens stay implicit (``candidates.Dense``). The row is never written.
    """
    tick = time.thread_time_ns if timings is not None else None
    t0 = tick() if tick else 0

    def lap(key, t0):
        t1 = tick()
        timings[key] = timings.get(key, 0) + (t1 - t0)
        return t1

    n = row.shape[0]
    hist_ids, hist_counts = hist

    n_allowed, frac = n, 1.0
    if words is not None:
        n_allowed = count_allowed(words, n)
        if n_allowed == 0:
            return Candidates(_NO_IDS, np.empty(0), "grammar")
        frac = n_allowed / n
    if words is None:
        active, first = _steps_to_run(params, hist_ids.size > 0, n_allowed)
    else:  # n_allowed changes every tick: do not fill the cache with it
        active, first = _steps_to_run.__wrapped__(params, hist_ids.size > 0, n_allowed)

    def run(names, ids, logits, t0):
        for name in names:
            ids, logits = _run(name, ids, logits, params, hist_ids, hist_counts)
            if tick:
                t0 = lap(name, t0)
            if ids.size == 0:
                return Candidates(ids, logits, name)
        return Candidates(ids, logits)

    if words is not None and n_allowed <= explicit_max:
        # A narrow grammar state: list the allowed tokens and run every step on them.
        ids = allowed_ids(words, n)
        logits = gather(row, ids)
        if tick:
            t0 = lap("grammar", t0)
        return run(active, ids, logits, t0)
    if tick:
        t0 = lap("grammar", t0)

    view = view or RowView(row)
    prefix = active if first is None else active[:first]
    tail = [] if first is None else active[first:]

    # T: the tokens bias and penalties touch, and their values after the prefix steps.
    bias_ids, bias = params.bias_arrays
    use_bias, use_pen = "logit_bias" in prefix, "penalties" in prefix
    if use_bias and use_pen:
        touched = np.concatenate((bias_ids, hist_ids))
        touched.sort()
        touched = touched[np.concatenate(([True], touched[1:] != touched[:-1]))]
    else:
        touched = bias_ids if use_bias else hist_ids if use_pen else _NO_IDS
    t_ids = touched[allows(words, touched)] if words is not None and touched.size else touched
    n_dense = n_allowed - t_ids.size
    t_logits = gather(row, t_ids) if t_ids.size else _NO_LOGITS
    if tick:
        t0 = lap("cut", t0)
    for name in prefix:
        if name != "temperature" or t_ids.size:
            t_ids, t_logits = _run(name, t_ids, t_logits, params, hist_ids, hist_counts)
        if tick:
            t0 = lap(name, t0)
    if use_bias:
        forced = bias_ids[bias >= FORCE]
        if forced.size and (words is None or allows(words, forced).any()):
            # The bias step left only the forced tokens: nothing else to consider.
            return run(tail, t_ids, t_logits, t0)
    if n_dense == 0:
        if t_ids.size == 0:
            return Candidates(t_ids, t_logits, "logit_bias")
        return run(tail, t_ids, t_logits, t0)
    tau = params.temperature if "temperature" in prefix else 1.0

    if first is None:
        return Candidates(t_ids, t_logits, dense=Dense(view, tau, words, frac, touched, n_dense))

    t1 = tail[0]
    rest_mass = 0.0
    if t1 in ("top_k", "temperature"):  # temperature here is greedy
        k = params.top_k if t1 == "top_k" else 1
        ids = upper_ids(view, k, words, frac, touched)
    elif t1 == "min_p":
        top = upper_ids(view, 1, words, frac, touched)
        vmax = float(gather(row, top, tau).max()) if top.size else -math.inf
        if t_logits.size:
            vmax = max(vmax, float(t_logits.max()))
        if vmax > -math.inf:
            t = (vmax + math.log(params.min_p)) * tau
            t -= (abs(t) + 1.0) * 1e-6  # a slightly larger superset absorbs rounding
            ids = view.ge(t)
            if words is not None:
                ids = ids[allows(words, ids)]
            if touched.size:
                ids = ids[~isin_sorted(ids, touched)]
        else:
            ids = upper_ids(view, n, words, frac, touched)
    else:  # top_p
        ids, rest_mass = _nucleus_superset(view, params.top_p, tau, words, frac, touched, t_logits)
    ids = ids.astype(np.int32)
    if tick:
        t0 = lap("cut", t0)
    if t_ids.size:
        u_ids = np.concatenate((ids, t_ids))
        u_logits = np.concatenate((gather(row, ids, tau), t_logits))
    else:
        u_ids, u_logits = ids, gather(row, ids, tau)
    if rest_mass:
        u_ids, u_logits = S.top_p(u_ids, u_logits, params.top_p, rest_mass)
        if tick:
            t0 = lap("top_p", t0)
        tail = tail[1:]
    return run(tail, u_ids, u_logits, t0)


def _nucleus_superset(view: RowView, p: float, tau: float, words, frac: float,
                      touched: np.ndarray, t_logits: np.ndarray) -> tuple[np.ndarray, float]:
    """(ids, rest_mass) for top-p as the first truncation: untouched allowed tokens that,
    with the touched ones, form a superset of the nucleus, and the mass of the allowed
    untouched tokens left out, relative to the largest candidate logit. One exp pass."""
    top = upper_ids(view, 1, words, frac, touched)
    ref = float(gather(view.row, top, tau).max()) if top.size else -math.inf
    if t_logits.size:
        ref = max(ref, float(t_logits.max()))
    if not ref > -math.inf:
        return upper_ids(view, view.n, words, frac, touched), 0.0
    buf, z_out = dense_exp(view, tau, words, touched, ref)
    t_e = np.exp(t_logits - ref)
    target = p * (z_out + float(t_e.sum())) * (1 + 1e-5)
    for delta in (6.0, 12.0, 24.0, 48.0):
        t_v = ref - delta
        ids = view.ge(t_v * tau)
        if words is not None:
            ids = ids[allows(words, ids)]
        if touched.size:
            ids = ids[~isin_sorted(ids, touched)]
        mass = float(np.add.reduce(buf[ids], dtype=np.float64))
        if mass + float(t_e[t_logits >= t_v].sum()) >= target:
            return ids, max(z_out - mass, 0.0)
    return upper_ids(view, view.n, words, frac, touched), 0.0


class SequenceSampler:
    """The sampler of one sequence: params, a numpy Generator seeded from ``params.seed``
    (a fresh random seed when None; read it back from ``seed`` to reproduce a run), and
    the token history the repetition penalties look at.

    History: every token of the sequence's context counts, prompt tokens included
    (pass them as ``prompt_tokens`` or through ``extend``). ``sample`` does not add the
    drawn token: call ``accept(token)`` for every token that enters the context (sampled
    or injected by the caller), so the history always equals the context.

    Randomness: each ``sample`` call draws exactly one uniform number, whatever the params
    (greedy included), so the k-th sampled token always uses the k-th draw of the stream.
    """

    def __init__(self, params: SamplerParams, n_vocab: int, prompt_tokens: Iterable[int] = ()):
        self._n_vocab = int(n_vocab)
        self._params = params.validate(self._n_vocab)
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._rng = np.random.default_rng(self._seed)
        self._history: list[int] = []
        self._counts: dict[int, int] = {}
        self._hist_arrays = None
        self.extend(prompt_tokens)

    # -- state -----------------------------------------------------------------------

    @property
    def params(self) -> SamplerParams:
        return self._params

    @property
    def seed(self) -> int:
        """The seed in use (drawn at random when params.seed was None)."""
        return self._seed

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(self._history)

    def set_params(self, params: SamplerParams) -> None:
        """Switch params mid-sequence. The RNG stream continues unless the new params
        name a different seed, which restarts it from that seed."""
        params.validate(self._n_vocab)
        old, self._params = self._params, params
        if params.seed is not None and params.seed != self._seed:
            self._seed = params.seed
            self._rng = np.random.default_rng(self._seed)
        if params.penalty_last_n != old.penalty_last_n:
            self._recount()

    def fork(self, seed: int | None = None) -> "SequenceSampler":
        """An independent copy (for a forked sequence). Without ``seed`` it continues the
        same RNG stream (and so draws the same tokens given the same rows)."""
        other = object.__new__(SequenceSampler)
        other._n_vocab = self._n_vocab
        other._params = self._params
        other._history = list(self._history)
        other._counts = dict(self._counts)
        other._hist_arrays = self._hist_arrays
        if seed is None:
            other._seed = self._seed
            other._rng = copy.deepcopy(self._rng)
        else:
            other._seed = int(seed)
            other._rng = np.random.default_rng(other._seed)
        return other

    def _window(self) -> int:
        n = self._params.penalty_last_n
        return len(self._history) if n < 0 else n

    def _recount(self) -> None:
        w = self._window()
        self._counts = {}
        for t in self._history[len(self._history) - w:] if w else ():
            self._counts[t] = self._counts.get(t, 0) + 1
        self._hist_arrays = None

    def accept(self, token: int) -> None:
        """Add a token that entered the context (updates the penalty window)."""
        t = int(token)
        if not 0 <= t < self._n_vocab:
            raise ValueError(f"token {t} out of range [0, {self._n_vocab})")
        self._history.append(t)
        n = self._params.penalty_last_n
        if n != 0:
            self._counts[t] = self._counts.get(t, 0) + 1
            if 0 < n < len(self._history):
                old = self._history[-n - 1]
                c = self._counts[old] - 1
                if c:
                    self._counts[old] = c
                else:
                    del self._counts[old]
        self._hist_arrays = None

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.accept(t)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` history tokens (after the caller rewinds the
        sequence's KV cache)."""
        del self._history[max(0, int(length)):]
        self._recount()

    def penalty_window(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 sorted, counts float64) of the tokens in the penalty window."""
        if self._hist_arrays is None:
            if self._counts:
                ids = np.fromiter(self._counts.keys(), np.int32, len(self._counts))
                cnt = np.fromiter(self._counts.values(), np.float64, len(self._counts))
                o = np.argsort(ids)
                self._hist_arrays = (ids[o], cnt[o])
            else:
                self._hist_arrays = _NO_HIST
        return self._hist_arrays

    # -- sampling --------------------------------------------------------------------

    def sample(self, logits_row: np.ndarray, allowed_bitmask: np.ndarray | None = None, *,
               timings: dict | None = None) -> SampleResult:
        """Sample the next token from one raw logits row (float, length n_vocab; only
        read). ``allowed_bitmask``: the grammar's int32 words (None = no grammar).
        ``timings``, if given, accumulates thread CPU ns per stage (for the bench)."""
        row = np.asarray(logits_row)
        if row.ndim != 1 or row.shape[0] != self._n_vocab:
            raise ValueError(f"logits row must have shape ({self._n_vocab},), got {row.shape}")
        p = self._params
        u = float(self._rng.random())
        words = as_words(allowed_bitmask, self._n_vocab) if allowed_bitmask is not None else None
        view = RowView(row)
        hist = self.penalty_window() if p.penalties_active else _NO_HIST
        cand = apply_chain(row, p, words, hist, view=view, timings=timings)
        if cand.empty_step is not None:
            return SampleResult(-1, True, _reason(cand.empty_step))
        t0 = time.thread_time_ns() if timings is not None else 0
        tok = cand.sample(u)
        if timings is not None:
            t1 = time.thread_time_ns()
            timings["sample"] = timings.get("sample", 0) + t1 - t0
            t0 = t1
        if tok < 0:
            return SampleResult(-1, True, _reason("sample"))
        if p.n_probs <= 0:
            return SampleResult(tok, n_candidates=cand.size)
        lp, top = raw_logprobs(view, tok, p.n_probs)
        res = SampleResult(tok, False, None, cand.size, lp, top, cand.logprob(tok), cand.top(p.n_probs))
        if timings is not None:
            timings["probs"] = timings.get("probs", 0) + time.thread_time_ns() - t0
        return res


def _reason(step: str) -> str:
    return EMPTY_REASONS.get(step, f"no candidate left after {step}")
