"""The sampler chain: composes the steps exactly but cheaply; per-sequence state."""

from __future__ import annotations

import copy
import functools
import secrets
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .bitmask import allowed_ids, allows, as_words, count_allowed
from .candidates import Candidates, Dense, gather, raw_logprobs
from .cut import RowView
from .params import SamplerParams
from .steps import FORCE
from . import registry as R
from .registry import ELEMENTWISE, NO_HIST, SCALE, TRUNCATION, Step, StepContext
from .table import LOGIT_BIAS as _LOGIT_BIAS, TEMPERATURE as _TEMPERATURE
from .trace import trace

__all__ = ["Candidates", "SampleResult", "SequenceSampler", "StepContext", "apply_chain"]

#: With a grammar allowing at most this many tokens, the allowed ids are listed outright.
EXPLICIT_MAX = 4096


@dataclass(slots=True)
class SampleResult:
    """One sampled token (a value: nothing changes it once made; not frozen, because a
    frozen dataclass's __init__ costs 4x, about 1 us per token per sequence).

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
    trace: dict | None = None  # with params.trace: what every step did (sampling/trace.py)
    path: str = "host"  # "graph": decided on the decode's pre-selected values (fastpath.py)
    fallback: str | None = None  # with pre-selection, why a host-path token took it (route.Fallback)


PLAN_CACHE_MAX_BIAS = 64  # params with more logit_bias entries are planned uncached (memory)


@functools.lru_cache(maxsize=1024)
def steps_to_run(p: SamplerParams, has_hist: bool, n_allowed: int) -> tuple[tuple[Step, ...], int | None]:
    """(active steps, index of the first truncating one or None), cached: params are
    frozen and the answer depends only on them, on whether there is a penalty history
    and on how many tokens the grammar allows (the same every tick without a grammar).
    Active: the listed steps minus those that are identities for these params. The first
    "truncating" step is the first that the implicit fast path cannot carry: one that
    may drop candidates, or a general step (which may use every candidate)."""
    active = R.active(p, has_hist)
    if p.temperature <= 0 and _TEMPERATURE in active:
        # Greedy: every truncation keeps the canonical first candidate, so the truncations
        # that run right before greedy cannot change the result. Only those with nothing
        # else between them and greedy: a step that reads the set (typical-p, a general
        # step) or changes logits (elementwise) after a truncation sees what it dropped.
        t = active.index(_TEMPERATURE)
        first = t
        while first > 0 and active[first - 1].kind == TRUNCATION and not active[first - 1].stateful:
            first -= 1
        active = active[:first] + active[t:]
    first = next((i for i, s in enumerate(active)
                  if s.kind not in (ELEMENTWISE, TRUNCATION, SCALE) or s.truncates(p, n_allowed)), None)
    return tuple(active), first


def prefix_and_tail(p: SamplerParams, has_hist: bool,
                    n_vocab: int) -> tuple[tuple[Step, ...], tuple[Step, ...]] | None:
    """A chain's active steps split at its first truncation (`steps_to_run`): the steps
    the implicit fast path carries, and the rest; None with a trace (kept step by step)
    or without a truncation. What the shortcuts (`greedy_tail`, forms.shape) start from."""
    if p.trace:
        return None
    active, first = steps_to_run(p, has_hist, n_vocab)
    if first is None:
        return None
    return active[:first], active[first:]


@functools.lru_cache(maxsize=1024)
def greedy_tail(p: SamplerParams, has_hist: bool, n_vocab: int) -> tuple[tuple[Step, ...], float] | None:
    """(steps from the first truncation on, tau before it) when the chain without a
    grammar reduces to "the canonical first raw token" (one argmax pass), else None.
    That is: no elementwise step is active before the first truncation (nothing is
    touched), the first truncation keeps one token (top-k 1 or greedy temperature), and
    only stateless steps whose rows say they keep a one-token set (``keeps_one``) follow it. ``apply_chain``
    would give the same candidates (its cut is the same argmax); this skips its set-up."""
    split = prefix_and_tail(p, has_hist, n_vocab)
    if split is None:
        return None
    prefix, tail = split
    if any(s.kind == ELEMENTWISE for s in prefix):
        return None
    head = tail[0]
    keeps_one_k = R.form(head) == R.KEEP_K and head.batched.value(p) == 1
    if not (keeps_one_k or (head is _TEMPERATURE and p.temperature <= 0)):
        return None
    if any(not s.keeps_one or s.stateful for s in tail):
        return None
    return tail, (p.temperature if _TEMPERATURE in prefix else 1.0)


# The plans are made from the registry's rows: a registration or removal drops them.
R.on_change(steps_to_run.cache_clear)
R.on_change(greedy_tail.cache_clear)

_NO_IDS = np.empty(0, np.int32)
_NO_LOGITS = np.empty(0, np.float64)


def apply_chain(row: np.ndarray, params: SamplerParams, words: np.ndarray | None = None,
                hist: tuple[np.ndarray, np.ndarray] = NO_HIST, *, view: RowView | None = None,
                timings: dict | None = None, explicit_max: int = EXPLICIT_MAX,
                ctx: StepContext | None = None) -> Candidates:
    """Run the sampler chain on one raw logits row; return the candidates to sample from.

    Default order: the registry's (``registry.steps()``: the built-in rows of ``table``,
    then any registered later), grammar first (-> sample, done by ``Candidates.sample``).
    ``params.samplers`` may reorder or drop every step but the grammar, which always
    runs first when ``words`` (uint32 bitmask words, see ``bitmask.as_words``) is given:
    a hard constraint no other step may override. ``hist`` is (ids sorted, counts) of the
    penalty window. ``view`` lets the caller reuse the row's column maxima (and tests
    shape them); ``explicit_max`` (tests) moves the explicit-grammar threshold. ``ctx``
    (``SequenceSampler`` passes one) carries the history, step states and random
    streams; without it, ``hist`` alone and fresh ones.

    The result is exactly that of running the ``steps`` functions in order over the
    whole vocabulary, without doing so. Up to the first truncating step the steps are
    elementwise (bias, penalties, positive temperature), and bias and penalties touch
    only a small set T of tokens. Every truncation keeps an upper set, so its result
    over the whole row equals its result over T (adjusted) united with a large enough
    upper set of the raw tokens outside T (rescaled by temperature), which
    ``cut.upper_ids`` finds from column maxima (the step's ``cut`` hook). A first
    truncating step without a hook, or a general step, gets every candidate instead. Top-p needs the total mass, so it
    costs one exp over the row when it is the first truncation. From the first
    truncation on, the steps run on the small explicit set. With no truncation at all,
    the untouched tokens stay implicit (``candidates.Dense``). The row is never written.
    """
    if ctx is None:
        ctx = StepContext(hist)
    hist = ctx.hist
    tick = time.thread_time_ns if timings is not None else None
    t0 = tick() if tick else 0

    def lap(key, t0):
        t1 = tick()
        timings[key] = timings.get(key, 0) + (t1 - t0)
        return t1

    n = row.shape[0]

    n_allowed, frac = n, 1.0
    if words is not None:
        n_allowed = count_allowed(words, n)
        if n_allowed == 0:
            return Candidates(_NO_IDS, np.empty(0), "grammar")
        frac = n_allowed / n
    if words is None and len(params.logit_bias) <= PLAN_CACHE_MAX_BIAS:
        active, first = steps_to_run(params, hist[0].size > 0, n_allowed)
    else:  # n_allowed changes every tick (or a key this big): do not fill the cache with it
        active, first = steps_to_run.__wrapped__(params, hist[0].size > 0, n_allowed)

    def run(steps, ids, logits, t0):
        for step in steps:
            ids, logits = step.run(ids, logits, params, ctx)
            if tick:
                t0 = lap(step.name, t0)
            if ids.size == 0:
                return Candidates(ids, logits, step.name)
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
    tail = () if first is None else active[first:]

    # T: the tokens the elementwise steps touch, and their values after the prefix steps.
    touched_sets = [step.touches(params, ctx) for step in prefix if step.touches is not None]
    if len(touched_sets) > 1:
        touched = np.concatenate(touched_sets)
        touched.sort()
        touched = touched[np.concatenate(([True], touched[1:] != touched[:-1]))]
    else:
        touched = touched_sets[0] if touched_sets else _NO_IDS
    t_ids = touched[allows(words, touched)] if words is not None and touched.size else touched
    n_dense = n_allowed - t_ids.size
    t_logits = gather(row, t_ids) if t_ids.size else _NO_LOGITS
    if tick:
        t0 = lap("cut", t0)
    for step in prefix:
        t_ids, t_logits = step.run(t_ids, t_logits, params, ctx)
        if tick:
            t0 = lap(step.name, t0)
    if _LOGIT_BIAS in prefix:
        bias_ids, bias = params.bias_arrays
        forced = bias_ids[bias >= FORCE]
        if forced.size and (words is None or allows(words, forced).any()):
            # The bias step left only the forced tokens: nothing else to consider.
            return run(tail, t_ids, t_logits, t0)
    if n_dense == 0:
        if t_ids.size == 0:
            return Candidates(t_ids, t_logits, _LOGIT_BIAS.name)
        return run(tail, t_ids, t_logits, t0)
    tau = params.temperature if _TEMPERATURE in prefix else 1.0

    if first is None:
        return Candidates(t_ids, t_logits, dense=Dense(view, tau, words, frac, touched, n_dense))

    if tail[0].cut is None:
        # No superset hook: the step sees every candidate (correct, just slower).
        ids = Dense(view, tau, words, frac, touched, n_dense).ids()
        if tick:
            t0 = lap("cut", t0)
        return run(tail, np.concatenate((ids, t_ids)), np.concatenate((gather(row, ids, tau), t_logits)), t0)

    # The first truncation: its row says how to find a superset of what it keeps.
    ids, rest_mass = tail[0].cut(view, params, tau, words, frac, touched, t_logits)
    ids = ids.astype(np.int32)
    if tick:
        t0 = lap("cut", t0)
    if t_ids.size:
        u_ids = np.concatenate((ids, t_ids))
        u_logits = np.concatenate((gather(row, ids, tau), t_logits))
    else:
        u_ids, u_logits = ids, gather(row, ids, tau)
    if rest_mass:  # the step needs the mass left out (top-p): run it here with that mass
        ctx.rest_mass = rest_mass
        u_ids, u_logits = tail[0].run(u_ids, u_logits, params, ctx)
        ctx.rest_mass = 0.0
        if tick:
            t0 = lap(tail[0].name, t0)
        tail = tail[1:]
    return run(tail, u_ids, u_logits, t0)


_NO_TOKENS = np.empty(0, np.int64)
_NO_TOKENS.flags.writeable = False


class SequenceSampler:
    """The sampler of one sequence: params, a numpy Generator seeded from ``params.seed``
    (a fresh random seed when None; read it back from ``seed`` to reproduce a run), and
    the token history the repetition penalties look at.

    History: every token of the sequence's context counts, prompt tokens included, as
    llama-server's slots do (they accept the whole prompt before the first draw). Either
    the sampler keeps its own (``prompt_tokens``, then ``accept(token)`` for every token
    that enters the context: ``sample`` does not add the drawn one), or it reads the
    caller's: ``history`` is a list it never copies (the engine passes the sequence's
    ``tokens``, so the context is kept once and appended once). That list may only grow
    (or shrink through ``truncate``); the penalty window's counts follow it when next
    read.

    Randomness: each ``sample`` call draws exactly one uniform number, whatever the params
    (greedy included), so the k-th sampled token always uses the k-th draw of the stream.
    A step that needs randomness (XTC) draws from a stream of its own, seeded from the
    same seed (``StepContext.uniform``), so it never shifts the final draw's stream.

    Step state: the states of stateful steps (mirostat's mu) live here, one per step,
    made on first use; ``fork`` deep-copies them with the RNG streams. ``vocab`` is
    handed to the steps that need token text (DRY's sequence breakers); ``prepared``, by
    step name, what the request's preparation made for them off the engine thread (DRY's
    breaker table: engine/prepare.py), held for the sampler's life and shared by forks.
    """

    def __init__(self, params: SamplerParams, n_vocab: int, prompt_tokens: Iterable[int] = (),
                 vocab=None, *, history: list[int] | None = None, prepared: dict | None = None):
        self._n_vocab = int(n_vocab)
        self._params = params.validate(self._n_vocab)
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._rng = np.random.default_rng(self._seed)
        self._next: float | None = None  # the stream's next uniform, once peek() took it
        self._history: list[int] = [] if history is None else history
        self._seen = 0  # how many of _history the window's counts have taken in
        self._counts: dict[int, int] = {}
        self._hist_arrays = None
        self._order_counts = None  # fastpath.order_many's (touched ids, their window counts)
        self._hist_np: np.ndarray | None = None  # int64 mirror of _history[:_hist_np_len] (window_array)
        self._hist_np_len = 0
        self._states: dict = {}
        self._streams: dict = {}
        self._vocab = vocab
        self._prepared = prepared
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

    @property
    def states(self) -> dict:
        """The stateful steps' states by step name (made on first use)."""
        return self._states

    def step_context(self, hist: tuple[np.ndarray, np.ndarray], n_vocab: int) -> StepContext:
        """What the steps see of this sequence for one row: ``hist`` (its penalty window,
        or NO_HIST), its history, vocab, step states and streams, and its seed."""
        return StepContext(hist, self._history, self._vocab, self._states, self._streams, self._seed, n_vocab,
                           self._prepared)

    def set_params(self, params: SamplerParams) -> None:
        """Switch params mid-sequence. The RNG stream continues unless the new params
        name a different seed, which restarts it from that seed."""
        params.validate(self._n_vocab)
        old, self._params = self._params, params
        if params.seed is not None and params.seed != self._seed:
            self._seed = params.seed
            self._rng = np.random.default_rng(self._seed)
            self._next = None
            self._streams = {}
        if params.penalty_last_n != old.penalty_last_n:
            self._recount()

    def fork(self, seed: int | None = None) -> "SequenceSampler":
        """An independent copy (for a forked sequence). Without ``seed`` it continues the
        same RNG stream (and so draws the same tokens given the same rows)."""
        other = object.__new__(SequenceSampler)
        other._n_vocab = self._n_vocab
        other._params = self._params
        other._history = list(self._history)
        other._seen = self._seen
        other._counts = dict(self._counts)
        other._hist_arrays = self._hist_arrays
        other._order_counts = self._order_counts  # the same window: an order's counts hold for both
        other._hist_np, other._hist_np_len = None, 0
        other._states = copy.deepcopy(self._states)
        other._vocab = self._vocab
        other._prepared = self._prepared
        if seed is None:
            other._seed = self._seed
            other._rng = copy.deepcopy(self._rng)
            other._next = self._next
            other._streams = copy.deepcopy(self._streams)
        else:
            other._seed = int(seed)
            other._rng = np.random.default_rng(other._seed)
            other._next = None
            other._streams = {}
        return other

    def _window(self) -> int:
        n = self._params.penalty_last_n
        return len(self._history) if n < 0 else n

    def _recount(self) -> None:
        self._counts = {}
        for t in self.window_tokens():
            self._counts[t] = self._counts.get(t, 0) + 1
        self._seen = len(self._history)
        self._hist_arrays = self._order_counts = None
        self._hist_np_len = 0  # the mirror is made again at its next read

    def _sync(self) -> None:
        """Take the tokens the history gained since the last read into the penalty
        window's counts (each in, and the one it pushes out of a full window out)."""
        h = self._history
        end = len(h)
        if end == self._seen:
            return
        if end < self._seen:
            self._recount()
            return
        n = self._params.penalty_last_n
        if n != 0:
            counts = self._counts
            for i in range(self._seen, end):
                t = h[i]
                counts[t] = counts.get(t, 0) + 1
                if 0 < n <= i:
                    old = h[i - n]
                    c = counts[old] - 1
                    if c:
                        counts[old] = c
                    else:
                        del counts[old]
        self._seen = end
        self._hist_arrays = self._order_counts = None

    def accept(self, token: int) -> None:
        """Add a token that entered the context to the history (and the penalty window).
        Not for a ``history`` the caller appends to itself: that would add it twice."""
        t = int(token)
        if not 0 <= t < self._n_vocab:
            raise ValueError(f"token {t} out of range [0, {self._n_vocab})")
        self._history.append(t)
        self._sync()

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
        self._sync()
        if self._hist_arrays is None:
            if self._counts:
                ids = np.fromiter(self._counts.keys(), np.int32, len(self._counts))
                cnt = np.fromiter(self._counts.values(), np.float64, len(self._counts))
                o = np.argsort(ids)
                self._hist_arrays = (ids[o], cnt[o])
            else:
                self._hist_arrays = NO_HIST
        return self._hist_arrays

    @property
    def penalizes(self) -> bool:
        """Whether the penalties step runs for the next token: its params are active and
        the window holds a token (what decides the chain's plans; no arrays are built)."""
        if not self._params.penalties_active:
            return False
        self._sync()
        return bool(self._counts)

    def window_tokens(self) -> list[int]:
        """The penalty window's tokens in context order, repeats kept (the counts of
        `penalty_window` are how often each id appears here)."""
        w = self._window()
        return self._history[max(0, len(self._history) - w):] if w else []

    def window_array(self) -> np.ndarray:
        """`window_tokens` as int64: a view of a buffer that mirrors the history, taking
        in only the tokens added since the last read, so that a tick's windows join with
        one concatenate (fastpath.order_many) where a list's Python ints would each be
        converted. Read it before the history changes again."""
        self._sync()
        h, buf, have = self._history, self._hist_np, self._hist_np_len
        end = len(h)
        if end < have:  # shorter than mirrored: made again (a guard: _sync's recount clears it first)
            have = 0
        if end > have:
            if buf is None or end > buf.size:
                grown = np.empty(max(64, 2 * end), np.int64)
                if have:
                    grown[:have] = buf[:have]
                buf = self._hist_np = grown
            buf[have:end] = h[have:end]
        self._hist_np_len = end
        w = self._window()
        return buf[max(0, end - w):end] if w and end else _NO_TOKENS

    def order_counts(self, touched: np.ndarray) -> np.ndarray | None:
        """The window counts (float64) of ``touched`` (a touched-id array an order of
        fastpath.order_many made, that very object) when that order's window is still
        this sequence's; None once a token entered the window or it was recounted."""
        self._sync()
        oc = self._order_counts
        return oc[1] if oc is not None and oc[0] is touched else None

    def keep_order_counts(self, touched: np.ndarray, counts: np.ndarray) -> None:
        """Record what `order_counts` hands back for ``touched`` (order_many, per order)."""
        self._sync()
        self._order_counts = (touched, counts)

    # -- sampling --------------------------------------------------------------------

    def draw(self) -> float:
        """The one uniform number a ``sample`` call draws (``batch.sample_tick`` takes it
        for the rows it samples itself, so the stream stays where ``sample`` leaves it)."""
        u = self._next
        if u is None:
            return float(self._rng.random())
        self._next = None
        return u

    def peek(self) -> float:
        """The uniform the next ``draw`` will give, without taking it (the pre-selection
        needs it before the decode: fastpath.py). Taken from the generator once and kept
        for that draw: a peek is as cheap as a draw, and the stream's values are the same."""
        if self._next is None:
            self._next = float(self._rng.random())
        return self._next

    def undraw(self, u: float) -> None:
        """Take back ``u``, the uniform ``draw`` just gave: the next draw gives it again."""
        self._next = u

    def sample(self, logits_row: np.ndarray, allowed_bitmask: np.ndarray | None = None, *,
               timings: dict | None = None) -> SampleResult:
        """Sample the next token from one raw logits row (float, length n_vocab; only
        read). ``allowed_bitmask``: the grammar's int32 words (None = no grammar).
        ``timings``, if given, accumulates thread CPU ns per stage (for the bench)."""
        row = np.asarray(logits_row)
        if row.ndim != 1 or row.shape[0] != self._n_vocab:
            raise ValueError(f"logits row must have shape ({self._n_vocab},), got {row.shape}")
        p = self._params
        u = self.draw()
        words = as_words(allowed_bitmask, self._n_vocab) if allowed_bitmask is not None else None
        view = RowView(row)
        hist = self.penalty_window() if p.penalties_active else NO_HIST
        ctx = self.step_context(hist, self._n_vocab)
        if p.trace:  # the trace reruns the steps on copies taken before they run
            before = StepContext(hist, self._history, self._vocab, copy.deepcopy(self._states),
                                 copy.deepcopy(self._streams), self._seed, self._n_vocab, self._prepared)
        short = greedy_tail(p, hist[0].size > 0, self._n_vocab) if words is None else None
        cand = _greedy(row, view, p, short, ctx, timings) if short is not None else None
        if cand is None:
            cand = apply_chain(row, p, words, view=view, timings=timings, ctx=ctx)
        if cand.empty_step is not None:
            return SampleResult(-1, True, empty_reason(cand.empty_step))
        t0 = time.thread_time_ns() if timings is not None else 0
        tok = cand.sample(u)
        if timings is not None:
            t1 = time.thread_time_ns()
            timings["sample"] = timings.get("sample", 0) + t1 - t0
            t0 = t1
        if tok < 0:
            return SampleResult(-1, True, empty_reason("sample"))
        for step in ctx.used:  # stateful steps that ran learn the drawn token (mirostat)
            if step.sampled is not None:
                step.sampled(self._states[step.name], tok, p)
        tr = None
        if p.trace:
            tr = trace(row, p, words, before, tok)
            if timings is not None:
                t1 = time.thread_time_ns()
                timings["trace"] = timings.get("trace", 0) + t1 - t0
                t0 = t1
        if p.n_probs <= 0:
            return SampleResult(tok, n_candidates=cand.size, trace=tr)
        lp, top = raw_logprobs(view, tok, p.n_probs)
        res = SampleResult(tok, False, None, cand.size, lp, top, cand.logprob(tok), cand.top(p.n_probs), tr)
        if timings is not None:
            timings["probs"] = timings.get("probs", 0) + time.thread_time_ns() - t0
        return res


def _greedy(row: np.ndarray, view: RowView, p: SamplerParams, short, ctx: StepContext,
            timings: dict | None) -> Candidates | None:
    """``apply_chain`` for a ``greedy_tail`` plan: the canonical first token (one argmax
    pass), then the steps from the first truncation on over that one-token set, as the
    chain runs them. None when the row's top is NaN or -inf (the chain handles those)."""
    tick = time.thread_time_ns if timings is not None else None
    t0 = tick() if tick else 0
    first = view.first()
    if first < 0:
        return None
    tail, tau = short
    ids = np.array([first], np.int32)
    logits = gather(row, ids, tau)
    for i, step in enumerate(tail):
        ids, logits = step.run(ids, logits, p, ctx)
        if tick:
            t1 = tick()
            key = "cut" if i == 0 else step.name  # the argmax is the first truncation's cut
            timings[key] = timings.get(key, 0) + t1 - t0
            t0 = t1
        if ids.size == 0:
            return Candidates(ids, logits, step.name)
    return Candidates(ids, logits)


def empty_reason(step: str) -> str:
    """The result's reason when ``step`` left no candidate (the registry's own, else a
    generic one)."""
    return R.empty_reasons().get(step, f"no candidate left after {step}")
