"""The sampler chain on the values the decode pre-selected (llama/presample/).

Two halves, before and after the decode:

- route.py decides whether a sequence's chain can run on pre-selected values (`route`,
  re-exported here). `order(sampler, mask)` then says what the graph must hand back
  (`RowOrder`).
- `sample(sampler, pre, words)`: the token (a `SampleResult`) from the K best values, the
  touched tokens' raw values and the block masses, or, when those cannot decide exactly,
  why the whole row is needed (a `route.Fallback` such as `PAST_K`; nothing was drawn,
  the caller runs the host path on the row and `FastStats` counts why).

The contract: the same token as the host path (``chain.SequenceSampler.sample``) except
within rounding of a boundary, log-probabilities within 1e-5 nats
(tests/test_sampling_fastpath.py). Why it holds: docs/BENCHMARKS.md, "Pre-selection inside
the decode".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .batch import topk_draw
from .bitmask import allowed_ids, allows, as_words, count_allowed
from .candidates import Candidates, block_of, index_in_block
from .cut import isin_sorted
from .chain import SampleResult, SequenceSampler, empty_reason, greedy_tail, steps_to_run
from .fastpath_dense import dense_tick
from . import registry as R
from .registry import ELEMENTWISE, NO_HIST, StepContext
from .route import (DENSE_TOUCHED, DRAW_OUTSIDE, HOST, N_PROBS_PAST_K, NO_MASS, NON_FINITE, NOTHING_ALLOWED,
                    OTHER_PLAN, PAST_K, Fallback, per_chain, plan, route)
from .steps import FORCE
from .table import LOGIT_BIAS, PENALTIES, TEMPERATURE
from . import steps as S
from . import fastpath_touched as T
from ..llama.presample import BLOCK, Preselected, RowOrder

__all__ = ["FastStats", "K_MIN", "K_MAX", "PAST_K", "order", "route", "sample", "sample_tick"]

#: the fewest best ids asked for (covers nProbs up to 64 and a top-p nucleus of a few dozen)
K_MIN = 64
#: the most: beyond it the host path is as cheap as the graph's selection
K_MAX = 1024


@dataclass
class FastStats:
    """Per sequence: tokens decided on pre-selected values, and why others were not."""

    graph: int = 0
    host: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    k: int = K_MIN  # the K this sequence asks for (raised when a truncation needed more)

    def took(self, res: SampleResult) -> None:
        """Count a token: decided on pre-selected values, or on the host for its
        ``fallback`` (`HOST` where none was given)."""
        if res.path == "graph":
            self.graph += 1
            return
        self.host += 1
        why = str(res.fallback or HOST)  # a plain str: the done event's JSON takes no subclass
        self.reasons[why] = self.reasons.get(why, 0) + 1

    def widen(self, why: Fallback) -> None:
        """After a host-path token for ``why``: a truncation past the K best asks for
        twice K next time (up to K_MAX)."""
        if why == PAST_K:
            self.k = min(self.k * 2, K_MAX)

    def as_event(self) -> dict:
        return {"graph": self.graph, "host": self.host, "reasons": dict(self.reasons)}


def _plan(s: SequenceSampler, n_allowed: int):
    p, has_hist = s.params, s.penalizes
    active, first = steps_to_run(p, has_hist, n_allowed)
    return p, has_hist, active, first


def _touched(s: SequenceSampler, prefix) -> np.ndarray:
    """The sorted unique ids the prefix steps touch for this sequence now."""
    ctx = StepContext(s.penalty_window() if s.params.penalties_active else NO_HIST)
    sets = [st.touches(s.params, ctx) for st in prefix if st.touches is not None]
    return np.unique(np.concatenate(sets)) if sets else _NO_TOUCHED


@per_chain
def _order_plan(p, has_hist: bool, n_allowed: int, k: int, masked: bool) -> tuple:
    """What an order depends on besides the row's own touched ids, mask and uniform:
    (K before the touched ids, whether the prefix touches, mass, inv_tau, raw, dense,
    greedy, the touched-id sets of the prefix's steps other than the penalties (they
    depend on the params alone), whether the penalties are in the prefix). Kept per chain
    (an order does not depend on the seed)."""
    active, first = steps_to_run(p, has_hist, n_allowed)
    prefix = active if first is None else active[:first]
    tau = p.temperature if TEMPERATURE in prefix else 1.0
    touches = any(st.touches is not None for st in prefix)
    # one more than top_k (when it runs) and nProbs: their last value must lie above the K-th (sample)
    top_k = next((st.batched.value(p) for st in active if R.form(st) == R.KEEP_K), 0)
    need = max(k, p.n_probs + 1, top_k + 1 if top_k > 0 else 0)
    raw = p.n_probs > 0 and (masked or tau != 1.0)
    # masses: for a draw over the whole set, top-p's mass left out, or nProbs' normaliser
    mass = first is None or R.form(active[first]) == R.KEEP_MASS or (p.n_probs > 0 and not raw)
    greedy = p.n_probs <= 0 and greedy_tail(p, False, n_allowed) is not None
    ctx = StepContext()  # the touched ids of a preselected step other than penalties need no window
    own = [st.touches(p, ctx) for st in prefix if st.touches is not None and st is not PENALTIES]
    return need, touches, mass, 1.0 / tau, raw, first is None, greedy, own, PENALTIES in prefix


def order(s: SequenceSampler, words: np.ndarray | None, k: int = K_MIN) -> RowOrder:
    """What the graph must hand back for this sequence's next token (route() said yes).
    ``words``: the grammar's bitmask (int32 words, ``bitmask.as_words``), or None."""
    return order_many([s], [words], [k])[0]


def order_many(samplers: list[SequenceSampler], words: list[np.ndarray | None],
               ks: list[int]) -> list[RowOrder]:
    """``[order(s, w, k) ...]`` for a tick's rows: the same orders, with every row's
    touched ids (bias, penalty window) made in one sort over the tick (a row's few dozen
    ids cost their numpy calls, not their sorting). The penalties' touched ids are the
    window's: its tokens go into that sort as they stand, repeats kept, and the sort
    counts them too; each sequence keeps its touched ids' counts for the touched batch
    (``SequenceSampler.order_counts``), so no window is sorted on its own."""
    rows, sets, windows = [], [], []
    for s, w, k in zip(samplers, words, ks):
        mask_bytes = None
        n_allowed = n = s.n_vocab
        if w is not None:
            w = as_words(w, n)
            mask_bytes = w.view(np.uint8)
            n_allowed = count_allowed(w, n)
        need, touches, mass, inv_tau, raw, dense, greedy, own, windowed = _order_plan(
            s.params, s.penalizes, n_allowed, k, mask_bytes is not None)
        sets.append(own if touches else None)
        window = s.window_array() if windowed else None
        windows.append(window if window is not None and window.size else None)
        rows.append((s, n, need, mass, inv_tau, raw, dense, greedy, mask_bytes))
    out = []
    touched_of, counts_of = _unions(sets, windows)
    for (s, n, need, mass, inv_tau, raw, dense, greedy, mask_bytes), touched, counts in zip(rows, touched_of,
                                                                                             counts_of):
        if touched.size:
            need += touched.size
        elif greedy:
            need = 1  # greedy: argmax's id is the canonical first token
        if counts is not None:
            s.keep_order_counts(touched, counts)
        out.append(RowOrder(k=min(need, K_MAX, n), mass=mass, inv_tau=inv_tau, touched=touched,
                            u=s.peek() if dense else None, raw=raw, mask=mask_bytes))
    return out


def _unions(sets: list[list[np.ndarray] | None], windows: list[np.ndarray | None]
            ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Per row, the sorted unique int32 ids of its sets and of its window's tokens (an
    int64 array with repeats; None: none), and, for a row with a window, how often each of those ids occurs
    in it (float64, 0 for the sets' other ids; None without a window). Every row in one
    sort: an id of row a as ((a * 2^32 + id) * 2 + 1 for a window's token, + 0 for a
    set's), so rows keep apart and in order (ids are int32), an id's entries sit side by
    side and the low bits add up to its count; each row a view of the result."""
    n = len(sets)
    out_ids, out_counts = [_NO_TOUCHED] * n, [None] * n
    idx = [a for a in range(n) if sets[a] or windows[a] is not None]
    if not idx:
        return out_ids, out_counts
    keys = []
    parts = [(i, x) for i, a in enumerate(idx) for x in sets[a] or ()]
    if parts:
        lens = np.fromiter((x.size for _, x in parts), np.intp, len(parts))
        r = np.repeat(np.fromiter((i for i, _ in parts), np.int64, len(parts)) << 32, lens)
        keys.append((np.concatenate([x for _, x in parts]).astype(np.int64) + r) << 1)
    w_rows = [i for i, a in enumerate(idx) if windows[a] is not None]
    if w_rows:
        ws = [windows[idx[i]] for i in w_rows]
        w = np.concatenate(ws).astype(np.int64, copy=False)  # (a copy: the windows are views)
        w += np.repeat(np.array(w_rows, np.int64) << 32, [x.size for x in ws])
        keys.append((w << 1) | 1)
    c = np.concatenate(keys) if len(keys) > 1 else keys[0]
    c.sort()
    u = c >> 1
    first = np.empty(c.size, bool)
    first[:1] = True
    np.not_equal(u[1:], u[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    u = u[starts]
    counts = np.add.reduceat(c & 1, starts).astype(np.float64) if w_rows else None
    row = (u + (1 << 31)) >> 32  # each key's row (ids lie in [-2^31, 2^31))
    ids = (u - (row << 32)).astype(np.int32)
    ends = np.searchsorted(row, np.arange(1, len(idx) + 1)).tolist()
    for a, start, end in zip(idx, [0] + ends[:-1], ends):
        out_ids[a] = ids[start:end]
        if windows[a] is not None:
            out_counts[a] = counts[start:end]
    return out_ids, out_counts


_NO_TOUCHED = np.empty(0, np.int32)
_NO_TOUCHED.flags.writeable = False


def _gather(pre: Preselected, ids: np.ndarray, tau: float) -> np.ndarray:
    """float64 raw values of ids (each in pre.ids or pre.order.touched) / tau."""
    if not ids.size:
        return np.empty(0, np.float64)
    keys = np.concatenate((pre.ids, pre.order.touched))
    vals = np.concatenate((pre.vals, pre.touched))
    o = np.argsort(keys, kind="stable")
    at = np.searchsorted(keys[o], ids)
    v = np.fmax(vals[o][at], -np.inf, dtype=np.float64)
    return v / tau if tau != 1.0 else v


def sample(s: SequenceSampler, pre: Preselected, words: np.ndarray | None) -> SampleResult | Fallback:
    """The next token from pre-selected values, or the reason the whole row is needed
    (then nothing was drawn: the caller runs ``s.sample`` on the row). ``words``: the
    grammar's bitmask words as ``s.sample`` takes them (int32 or uint32), or None."""
    p = s.params
    n = s.n_vocab
    if words is not None:
        words = as_words(words, n)  # uint32: popcounts of int32 words count the sign wrong
    if not (math.isfinite(pre.top) and (pre.blocks is None or np.isfinite(pre.blocks).all())):
        return NON_FINITE
    n_allowed = count_allowed(words, n) if words is not None else n
    if n_allowed == 0:
        return NOTHING_ALLOWED
    _, has_hist, active, first = _plan(s, n_allowed)
    prefix = active if first is None else active[:first]
    tail = () if first is None else active[first:]
    tau = p.temperature if TEMPERATURE in prefix else 1.0
    hist = s.penalty_window() if p.penalties_active else NO_HIST
    ctx = s.step_context(hist, n)

    touched = pre.order.touched
    if 1.0 / tau != pre.order.inv_tau or (prefix and not isin_sorted(_touched(s, prefix), touched).all()):
        return OTHER_PLAN  # the order was made for other params, history or mask
    ids, vals = pre.ids, pre.vals
    finite = vals > -np.inf
    if finite.all():
        floor = pre.floor
    else:  # fewer than K allowed: all of them are here
        floor, ids, vals = -np.inf, ids[finite], vals[finite]
    t_logits = np.fmax(pre.touched, -np.inf, dtype=np.float64)  # as candidates.gather: NaN -> -inf
    if words is not None and touched.size:
        ok = allows(words, touched)
        t_ids, t_logits = touched[ok], t_logits[ok]
    else:
        t_ids = touched
    n_touched = t_ids.size  # allowed touched tokens, before a ban removes any
    for step in prefix:
        t_ids, t_logits = step.run(t_ids, t_logits, p, ctx)
    if LOGIT_BIAS in prefix:
        bias_ids, bias = p.bias_arrays
        forced = bias_ids[bias >= FORCE]
        if forced.size and (words is None or allows(words, forced).any()):
            return _finish(s, pre, _run(tail, t_ids, t_logits, p, ctx))
    if first is None:
        if n_touched:  # their masses are in the blocks as the raw row has them (a ban's too)
            return DENSE_TOUCHED
        return _dense(s, pre, words, n_allowed, tau)
    # the explicit set: the K best outside the touched ones, and the touched ones
    if touched.size:
        out = ~isin_sorted(ids, touched)
        untouched, u_vals = ids[out], vals[out]
    else:
        untouched, u_vals = ids, vals
    u_vals = np.fmax(u_vals, -np.inf, dtype=np.float64)
    if tau != 1.0:
        u_vals = u_vals / tau
    # The truncation is exact when it drops the smallest untouched value handed back: every
    # untouched token left out is at most the K-th value, so at most that one. (Not the
    # K-th value itself: when the K-th token is touched, banned say, a truncation that
    # keeps every candidate keeps values above it, yet would keep the tokens left out.)
    if floor > -np.inf:
        floor = float(u_vals.min()) if u_vals.size else math.inf
    u_ids = np.concatenate((untouched, t_ids)).astype(np.int32) if t_ids.size else untouched
    u_logits = np.concatenate((u_vals, t_logits)) if t_ids.size else u_vals
    head = tail[0]
    keep_k = head.batched.value(p) if R.form(head) == R.KEEP_K else 0
    if keep_k and floor == -np.inf and u_ids.size < keep_k:
        # Fewer finite values allowed than top-k keeps: the host's top-k keeps -inf tokens
        # too (the smallest allowed ids outside the candidates, in canonical order), and a
        # step after it may force one of them (or the set is empty only after the draw).
        fill = _first_allowed(words, n, np.concatenate((u_ids, touched)), keep_k - u_ids.size)
        u_ids = np.concatenate((u_ids, fill))
        u_logits = np.concatenate((u_logits, np.full(fill.size, -np.inf)))
    if R.form(head) == R.KEEP_MASS:
        ctx.rest_mass = _rest_mass(pre, untouched, u_logits, tau, words, touched)
    ids1, logits1 = head.run(u_ids, u_logits, p, ctx)
    ctx.rest_mass = 0.0
    if (ids1.size and floor > -np.inf and not float(logits1.min()) > floor
            and not (pre.first and ids1.size == 1 and ids1[0] == pre.ids[0])):
        return PAST_K
    if ids1.size == 0:
        return _finish(s, pre, Candidates(ids1, logits1, head.name))
    return _finish(s, pre, _run(tail[1:], ids1, logits1, p, ctx))


def _first_allowed(words: np.ndarray | None, n: int, exclude: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` smallest allowed ids outside ``exclude`` (int32)."""
    ids = allowed_ids(words, n) if words is not None else np.arange(min(n, count + exclude.size), dtype=np.int32)
    ids = ids[: count + exclude.size]
    return ids[~np.isin(ids, exclude)][:count].astype(np.int32)


def _run(steps, ids, logits, p, ctx) -> Candidates:
    for step in steps:
        ids, logits = step.run(ids, logits, p, ctx)
        if ids.size == 0:
            return Candidates(ids, logits, step.name)
    return Candidates(ids, logits)


def _rest_mass(pre: Preselected, untouched: np.ndarray, u_logits: np.ndarray, tau: float,
               words: np.ndarray | None, touched: np.ndarray) -> float:
    """Mass exp(v - max(u_logits)) of the allowed untouched tokens outside the K best: the
    block masses' total minus the K best's and the touched tokens' own (those the
    grammar allows), rescaled from the graph's reference (the top) to the chain's."""
    ref = float(u_logits.max()) if u_logits.size else -math.inf
    if not ref > -math.inf:
        return 0.0
    inv = pre.order.inv_tau
    total = float(np.add.reduce(pre.blocks, dtype=np.float64))
    inside = np.concatenate((untouched, touched[allows(words, touched)] if words is not None else touched))
    if inside.size:
        raw = _gather(pre, np.unique(inside), 1.0)
        total -= float(np.exp((raw - pre.top) * inv).sum())
    return max(total, 0.0) * math.exp(pre.top * inv - ref)


def _finish(s: SequenceSampler, pre: Preselected, cand: Candidates) -> SampleResult | Fallback:
    """Draw from an explicit candidate set, then the log-probabilities (nProbs). The
    sequence's one uniform is taken (``draw``) only once the answer is certain, so a
    None-reason leaves the stream where the host path expects it."""
    p = s.params
    if cand.empty_step is not None:
        s.draw()
        return SampleResult(-1, True, empty_reason(cand.empty_step), path="graph")
    tok = cand.sample(s.peek())
    if tok < 0:
        s.draw()
        return SampleResult(-1, True, empty_reason("sample"), path="graph")
    if p.n_probs <= 0:
        s.draw()
        return SampleResult(tok, n_candidates=cand.size, path="graph")
    raw = _raw_logprobs(pre, _raw_value(pre, tok), p.n_probs, s.n_vocab)
    if isinstance(raw, Fallback):
        return raw
    s.draw()
    lp, top = raw
    return SampleResult(tok, False, None, cand.size, lp, top, cand.logprob(tok), cand.top(p.n_probs),
                        path="graph")


def _raw_value(pre: Preselected, tok: int) -> float:
    """The raw logit of a token of the explicit set (one of the K best, or touched)."""
    hit = np.flatnonzero(pre.ids == tok)
    if hit.size:
        return float(pre.vals[hit[0]])
    return float(pre.touched[np.flatnonzero(pre.order.touched == tok)[0]])


def _raw_logprobs(pre: Preselected, v: float, n: int, n_vocab: int):
    """(logprob of the token whose raw logit is v, n best) under the raw row's
    log-softmax, or why the n best cannot be had from the K best."""
    if pre.raw_max is not None:
        if not (math.isfinite(pre.raw_max) and pre.raw_mass > 0 and math.isfinite(pre.raw_mass)):
            return NON_FINITE  # NaN where the grammar masks it (y was finite): the host maps it to -inf
        lse = pre.raw_max + math.log(pre.raw_mass)
    else:  # y is the raw row and the masses are at tau 1
        lse = pre.top + math.log(float(np.add.reduce(pre.blocks, dtype=np.float64)))
    ids, vals = (pre.raw_ids, pre.raw_vals) if pre.raw_ids is not None else (pre.ids, pre.vals)
    finite = vals > -np.inf
    b_ids, b_v = S.top_n(ids[finite], vals[finite].astype(np.float64), n)
    if finite.all() and b_v.size and not b_v[-1] > float(vals.min()):
        return N_PROBS_PAST_K
    top = tuple((int(i), float(x) - lse) for i, x in zip(b_ids, b_v))
    if b_ids.size < n and not finite.all():
        # Fewer than n finite raw values, all among the K best: the rest of the n best
        # are -inf tokens, as the host lists them (raw_logprobs: canonical order, so the
        # smallest ids outside the finite ones; the graph's own tie-break among -inf
        # values may differ, so they are not read from it).
        known = ids[finite]
        pool = np.arange(min(n_vocab, n + known.size), dtype=np.int32)
        pool = pool[~np.isin(pool, known)][: n - b_ids.size]
        top += tuple((int(i), -math.inf) for i in pool)
    return v - lse, top


def _dense(s: SequenceSampler, pre: Preselected, words, n_allowed: int, tau: float) -> SampleResult | Fallback:
    """A draw over every allowed token (no truncation, nothing touched; many rows at
    once: fastpath_dense.dense_tick, which must stay this bit for bit)."""
    blocks = pre.blocks.astype(np.float64)
    cb = np.add.accumulate(blocks)
    total = float(cb[-1])
    if not total > 0:
        return NO_MASS
    u = s.peek()
    target = u * total
    b = block_of(blocks, cb, target)
    chunk = None if pre.dense is None else pre.dense.get(b)
    if chunk is None:
        return DRAW_OUTSIDE
    j = index_in_block(chunk, cb, b, target)
    return _dense_result(s, pre, b * BLOCK + j, float(chunk[j]), total, n_allowed)


def _dense_result(s: SequenceSampler, pre: Preselected, tok: int, m: float, total: float,
                  n_allowed: int) -> SampleResult | Fallback:
    """A dense draw's result for token tok (its mass m in its block, the blocks' total):
    the uniform taken, and the log-probabilities with nProbs (or why they cannot be had,
    nothing drawn)."""
    p = s.params
    if p.n_probs <= 0:
        s.draw()
        return SampleResult(tok, n_candidates=n_allowed, path="graph")
    log_total = math.log(total)
    inv = pre.order.inv_tau
    hit = np.flatnonzero(pre.ids == tok)
    if hit.size:
        x_tok = float(pre.vals[hit[0]])
        steered = (x_tok - pre.top) * inv - log_total
    else:  # from its mass: exp((x - top) * inv) in float32, ~1e-7 relative
        steered = math.log(m) - log_total
        x_tok = pre.top + math.log(m) / inv
    ids, vals = pre.ids, pre.vals
    finite = vals > -np.inf
    b_ids, b_v = S.top_n(ids[finite], vals[finite].astype(np.float64), p.n_probs)
    if finite.all() and b_v.size and not b_v[-1] > float(vals.min()):
        return N_PROBS_PAST_K
    raw = _raw_logprobs(pre, x_tok, p.n_probs, s.n_vocab)
    if isinstance(raw, Fallback):
        return raw
    s.draw()
    steered_top = tuple((int(i), (float(x) - pre.top) * inv - log_total) for i, x in zip(b_ids, b_v))
    return SampleResult(tok, False, None, n_allowed, raw[0], raw[1], steered, steered_top, path="graph")


def _rows(arrays: list[np.ndarray]) -> np.ndarray:
    """np.stack of equal-length 1-D rows, through one concatenate (a third of stack's cost
    at 64 rows: stack makes a view per row first)."""
    return np.concatenate(arrays).reshape(len(arrays), arrays[0].size)


def _nucleus_tick(samplers, pres, js, top_p, temp, out) -> None:
    """Top-p-first rows on [m, K] matrices (batch.topk_draw with k = K): the rest mass
    from the block masses less the K best's own, and the floor check on what it keeps."""
    vals = _rows([pres[j].vals for j in js])
    K = vals.shape[1]
    ok = np.logical_and.reduce(np.isfinite(vals), axis=1)
    for j, good in zip(js, ok.tolist()):
        if not good:
            out[j] = sample(samplers[j], pres[j], None)
    js = [j for j, good in zip(js, ok.tolist()) if good]
    if not js:
        return
    vals = vals[ok].astype(np.float64)
    top = np.array([pres[j].top for j in js])
    # per row as float(np.add.reduce(blocks, dtype=np.float64)): a row of a C-contiguous matrix
    total = np.add.reduce(_rows([pres[j].blocks for j in js]), axis=1, dtype=np.float64)
    inside = np.add.reduce(np.exp(vals - top[:, None]), axis=1)
    rest = np.maximum(total - inside, 0.0)  # relative to the top, which is the K best's max
    floor = np.minimum.reduce(vals, axis=1)
    # a nucleus reaching the floor: PAST_K at once (sample() would redo it all to say so)
    topk_draw(samplers, js, K, top_p, temp, None, out, lambda j: sample(samplers[j], pres[j], None),
              path="graph", rest=rest, floor=floor, past=lambda j: PAST_K,
              best=(floor, _rows([pres[j].ids for j in js]), vals))


def sample_tick(samplers: list[SequenceSampler], pres: list[Preselected],
                masks: list[np.ndarray | None]) -> list[SampleResult | Fallback]:
    """``[sample(s, pre, mask) ...]`` for a tick's pre-selected rows, with the plain
    greedy and top-k chains on [m, K] matrices at once (route.py's ``ChainPlan.tick``, the
    same arithmetic as the host path's batched rows), the top-p-first ones
    (`_nucleus_tick`) and the draws over the whole vocabulary (fastpath_dense) too: a
    reason string where the values cannot decide, as ``sample`` gives (a nucleus that
    reaches the K-th value: PAST_K). Every row's result is what it gets alone in a tick
    (no reduction crosses rows)."""
    out: list = [None] * len(samplers)
    # rows are stacked by plan and by K (each row has its own: presample.Presampler.read)
    greedies, topk, dense, rest, touched = {}, {}, {}, [], {}
    for j, (s, pre, mask) in enumerate(zip(samplers, pres, masks)):
        # (a sum of the masses is finite only when every one is: one pass, not two)
        if not (math.isfinite(pre.top) and (pre.blocks is None or math.isfinite(np.add.reduce(pre.blocks)))):
            rest.append(j)  # a NaN (or all -inf) row: sample() gives the reason
            continue
        p, o = s.params, pre.order
        route = plan(p, s.penalizes, s.n_vocab).tick(mask is not None, o.touched.size > 0, pre.blocks is not None,
                                                     pre.raw_max is not None, pre.dense is not None)
        # a grammar's mask is in the values already (the graph applied it): with all K
        # values finite, more than K tokens are allowed, so top-k and greedy cut as
        # without it (else: per row)
        if route is None or (mask is not None and not np.isfinite(pre.vals).all()):
            rest.append(j)
        elif route[0] == "greedy":
            greedies.setdefault(pre.vals.size, []).append(j)
        elif route[0] == "topk":
            topk.setdefault((route, pre.vals.size), []).append(j)
        elif route[0] == "touched":  # bias / penalties, then top-k [top-p] [temperature]
            touched.setdefault(route, []).append(j)  # (one route per chain: fastpath_touched.tick)
        elif route[1] == o.inv_tau:  # "dense": a draw over the whole vocabulary (fastpath_dense)
            dense.setdefault(pre.blocks.size, []).append(j)
        else:
            rest.append(j)  # pre-selected for another temperature: sample() says so
    for greedy in greedies.values():
        ids = _rows([pres[j].ids for j in greedy])
        vals = _rows([pres[j].vals for j in greedy])
        vmax = np.maximum.reduce(vals, axis=1)
        # the canonical first: the largest value, the smallest id among ties
        tok = np.minimum.reduce(np.where(vals == vmax[:, None], ids, np.iinfo(np.int32).max), axis=1)
        # exact when it beats every token left out (all <= the K-th value)
        ok = ((vmax > np.minimum.reduce(vals, axis=1)) | (vals.shape[1] == 1)) & np.isfinite(vmax)
        for a, j in enumerate(greedy):
            if ok[a]:
                samplers[j].draw()  # the draw sample() makes (the stream stays aligned)
                out[j] = SampleResult(int(tok[a]), n_candidates=1, path="graph")
            else:
                out[j] = sample(samplers[j], pres[j], None)
    for (route, _), js in topk.items():
        k, top_p, temp = route[1:4]
        n_probs = route[4] if len(route) > 4 else 0
        if k is None:  # top-p first: the whole pre-selected set, top-p with the mass left out
            _nucleus_tick(samplers, pres, js, top_p, temp, out)
            continue
        vals = _rows([pres[j].vals for j in js])
        K = vals.shape[1]
        floor = np.minimum.reduce(vals, axis=1)  # NaN with a NaN in the row: not fine below
        # the k kept lie strictly above everything left out (<= the K-th value); a row's
        # values come in canonical order (Preselected), so its k-th best is column k - 1
        fine = (vals[:, k - 1] > floor).tolist() if k < K else [False] * len(js)
        ok_js = [j for j, f in zip(js, fine) if f]
        for j, f in zip(js, fine):
            if not f:
                out[j] = sample(samplers[j], pres[j], None)
        if ok_js:
            sel = slice(None) if len(ok_js) == len(js) else np.flatnonzero(fine)
            ids = _rows([pres[j].ids for j in ok_js])[:, :k]  # (one slice, not one per row)
            best = (floor[sel].astype(np.float64), ids, vals[sel, :k].astype(np.float64))
            raw_lse = None
            if n_probs:  # per row top + log(float(np.add.reduce(blocks, dtype=np.float64)))
                mass = np.add.reduce(_rows([pres[j].blocks for j in ok_js]), axis=1, dtype=np.float64)
                raw_lse = np.array([pres[j].top + math.log(z) for j, z in zip(ok_js, mass.tolist())])
            topk_draw(samplers, ok_js, k, top_p, temp, None, out,
                      lambda j: sample(samplers[j], pres[j], None), path="graph", n_probs=n_probs,
                      raw_lse=raw_lse, best=best)
    if touched:
        T.tick(samplers, pres, touched, out, lambda j: sample(samplers[j], pres[j], None))
    for js in dense.values():
        dense_tick(samplers, pres, js, out, lambda j: sample(samplers[j], pres[j], None),
                   lambda j, tok, m, total: _dense_result(samplers[j], pres[j], tok, m, total, samplers[j].n_vocab))
    for j in rest:
        out[j] = sample(samplers[j], pres[j], masks[j])
    return out
