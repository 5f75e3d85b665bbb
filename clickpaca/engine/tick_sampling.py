"""Sampling a tick's rows: the one owner of the pre-selection in the engine. Before the
decode it orders the rows whose chain runs on pre-selected values (`order`, then
`order_grammar` once the tick's masks are made); after it, `sample` takes every row the
jobs asked for: the pre-selected ones on their values (sampling/fastpath.py), a row whose
values cannot decide on its whole row, every other row in one batched host call
(sampling.batch.sample_tick). Which route a row takes is sampling/route.py's; the K a
sequence asks for and its widening are its FastStats'. The scheduler calls these three
and knows no route.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Any, Callable

from ..sampling import fastpath
from ..sampling import route as R
from ..sampling.batch import sample_tick
from ..sampling.usersteps import StepFailed
from . import faults
from .jobs import Tick
from .mask_ahead import MaskJob
from .plan import Feed
from .runtime import Runtime
from .sequences import Sequence, Sequences

_GRAMMAR = object()  # `_route`: pre-selected once its grammar mask is made


class TickSampler:
    """``fail(seq, stage, e)`` ends one sequence; ``guard(seq, stage, fn, *args)`` runs
    one stage of it and returns ``failed`` when that stage ended it (the scheduler's)."""

    def __init__(self, rt: Runtime, seqs: Sequences, fail: Callable[..., None], guard: Callable[..., Any],
                 failed: object) -> None:
        self.rt, self.seqs = rt, seqs
        self._fail, self._guard, self._failed = fail, guard, failed
        self._host_why: dict = {}  # with a presampler: why a sampled row came back whole
        self._grammar_wait: list = []  # with a presampler: rows to order once their masks are made

    # ------------------------------------------------------------------ before the decode

    def order(self, plan: list[Feed]) -> None:
        """With a presampler (init preselect): tell it the rows whose chain runs on
        pre-selected values; every other row comes back whole, and why is kept for its
        token's `path`."""
        ps = self.rt.ctx.presampler
        if ps is None:
            return
        self._host_why, self._grammar_wait = {}, []
        ready = []  # routed to the graph without a grammar: ordered together below
        for f in plan:
            if not f.samples:
                continue
            seq = f.key
            try:  # (the tests' hook reaches `order` once a tick: in _orders)
                got = self._route(seq, f)
            except Exception as e:  # noqa: BLE001 - this sequence's order; the others go on
                self._fail(seq, "order", e)
                continue
            if isinstance(got, R.Fallback):
                self._host_why[seq] = got
            elif got is _GRAMMAR:
                self._grammar_wait.append(seq)
            else:
                ready.append(seq)
        ps.order(self._orders(ready, [None] * len(ready)))

    def order_grammar(self, job: MaskJob, plan: list[Feed]) -> bool:
        """The pre-selected rows with a grammar need their mask before the decode (the
        graph applies it before selecting): wait for the tick's masks, then order them.
        A mask that failed leaves its row whole (its error comes at the sampling).
        True when a sequence of `plan` ended here (its order failed): the batch must be
        filled again."""
        if not self._grammar_wait or self.rt.ctx.presampler is None:
            return False
        ps = self.rt.ctx.presampler
        job.wait()
        orders = dict(ps.orders)
        ready, masks = [], []
        for seq in self._grammar_wait:
            if seq.job is None:
                continue
            try:
                masks.append(job.row(seq))
            except Exception:  # noqa: BLE001 - reported when its row is sampled
                self._host_why[seq] = R.MASK_FAILED
                continue
            ready.append(seq)
        self._grammar_wait = []
        orders.update(self._orders(ready, masks))
        ps.order(orders)
        return any(f.key.job is None for f in plan)

    def _orders(self, seqs: list[Sequence], masks: list) -> dict[int, Any]:
        """{slot: RowOrder} of sequences routed to the graph, made together
        (fastpath.order_many); if that raises, one at a time (faults.each), so that
        only a sequence whose order fails ends (stage `order`)."""
        if not seqs:
            return {}
        made = faults.each(
            "order", list(zip(seqs, masks)),
            lambda it: fastpath.order(it[0].job.drawer(), it[1], self._k(it[0])),
            lambda its: fastpath.order_many([s.job.drawer() for s, _ in its], [m for _, m in its],
                                            [self._k(s) for s, _ in its]),
            seq_ids=[seq.seq_id for seq in seqs])
        out = {}
        for seq, got in zip(seqs, made):
            if isinstance(got, Exception):
                self._fail(seq, "order", got)
            else:
                out[seq.slot] = got
        return out

    @staticmethod
    def _k(seq: Sequence) -> int:
        """The K best the sequence asks for (its FastStats' K, widened after PAST_K)."""
        paths = seq.job.paths
        return paths.k if paths is not None else fastpath.K_MIN

    @staticmethod
    def _route(seq: Sequence, f: Feed) -> Any:
        """None when the sequence's row is ordered now (without a grammar), _GRAMMAR when
        once its mask is made, or why its row comes back whole (route.route)."""
        grammar = seq.job.grammar() is not None
        why = R.route(seq.job.drawer(), grammar, len(f.rows))
        if why is not None:
            return why
        return _GRAMMAR if grammar else None  # a grammar's row: ordered in order_grammar

    # ------------------------------------------------------------------ after the decode

    def sample(self, tick: Tick, draws: list, mask_rows: list) -> None:
        """Sample every row the jobs asked for and hand each job its token (`sampled`):
        the pre-selected rows first (`_sample_preselected`), then every other row in one
        call. sampling.batch.sample_tick takes those together: greedy and top-k chains
        without a grammar share passes over the block, every other row runs its own
        chain, spread over the decode's threads (idle while the host samples); the
        results are bit for bit the per-sequence ones (tests/test_sampling_batch.py). A
        user-defined step that raises (StepFailed) costs only its own sequence, as does
        any failure of one row (stage `sampling`)."""
        ps = self.rt.ctx.presampler
        if ps is not None:
            draws, mask_rows = self._sample_preselected(tick, ps, draws, mask_rows)
            if not draws:
                return
        # all rows in one call; if it raises, one row at a time, to find whose it is
        results = faults.each(
            "sampling", list(zip(draws, mask_rows)),
            lambda it: it[0][2].sample(tick.logits[it[0][1]], it[1]),
            lambda its: sample_tick([d[2] for d, _ in its], tick.logits, [d[1] for d, _ in its],
                                    [m for _, m in its], isolate=(Exception,), threads=self.rt.ctx.n_threads),
            seq_ids=[d[0].seq_id for d in draws])
        for (seq, row, _), mask, res in zip(draws, mask_rows, results):
            if ps is not None and not isinstance(res, Exception):
                why = self._host_why.get(seq, R.HOST)
                res = dataclasses.replace(res, path=R.path(why), fallback=why)
            if isinstance(res, Exception) and not isinstance(res, StepFailed):
                if not isinstance(res, faults.StageFailed):
                    traceback.print_exception(res, file=sys.stderr)
                self.seqs.fail(seq, faults.describe("sampling", res))
                continue
            self._guard(seq, "accept", seq.job.sampled, tick, seq, row, mask, res)

    def _sample_preselected(self, tick: Tick, ps: Any, draws: list, mask_rows: list) -> tuple[list, list]:
        """Sample the rows the decode pre-selected (fastpath.sample_tick: the plain greedy
        and top-k chains together, the others one at a time) and hand each job its token;
        a row whose values cannot decide takes the host path on its whole row. Return
        the other draws (their rows came back whole) for the batched host path."""
        rest, rest_masks, fast = [], [], []
        n_out = self.rt.ctx.n_outputs
        ordered = [d for d in draws if d[0].slot in ps.orders]
        # every ordered row read in one call; if it raises, one at a time (stage `read`)
        got = faults.each("read", ordered, lambda d: ps.read(d[0].slot, d[1], n_out),
                          lambda ds: ps.read_many([d[0].slot for d in ds], [d[1] for d in ds], n_out),
                          seq_ids=[d[0].seq_id for d in ordered])
        read = {}
        for d, pre in zip(ordered, got):
            if isinstance(pre, Exception):
                self._fail(d[0], "read", pre)
            else:
                read[id(d)] = pre
        for d, mask in zip(draws, mask_rows):
            seq, row, _ = d
            if seq.job is None:  # its read failed
                continue
            pre = read.get(id(d))
            if pre is None:  # not ordered, or its row came back whole
                rest.append(d)
                rest_masks.append(mask)
                if seq.slot in ps.orders:
                    self._host_why[seq] = R.CAME_BACK_WHOLE
            else:
                fast.append((d, mask, pre))
                tick.preselected.add(row)
        if fast:
            tick.whole_row = lambda i: ps.full_row(i, n_out)
        else:
            return rest, rest_masks
        results = faults.each(  # together; if that raises, one row at a time, to find whose it is
            "sampling", fast, lambda it: fastpath.sample(it[0][2], it[2], it[1]),
            lambda its: fastpath.sample_tick([d[2] for d, _, _ in its], [p for _, _, p in its],
                                             [m for _, m, _ in its]),
            seq_ids=[d[0].seq_id for d, _, _ in fast])
        for (d, mask, pre), res in zip(fast, results):
            seq, row, sampler = d
            if isinstance(res, Exception):
                self._fail(seq, "sampling", res)
                continue
            if isinstance(res, R.Fallback):
                res = self._guard(seq, "sampling", self._whole_row, ps, seq, row, sampler, mask, res, n_out, pre)
                if res is self._failed:
                    continue
            self._guard(seq, "accept", seq.job.sampled, tick, seq, row, mask, res)
        return rest, rest_masks

    @staticmethod
    def _whole_row(ps: Any, seq: Sequence, row: int, sampler: Any, mask: Any, why: R.Fallback, n_out: int,
                   pre: Any = None) -> Any:
        """The host path on a pre-selected row's whole row, when its values could not
        decide (`why`: the result's `path` says it; `pre`: the row's pack)."""
        full = ps.full_row(row, n_out, pre)
        if full is None:
            raise RuntimeError(f"the whole row is needed ({why}) and this build does not keep it")
        if seq.job.paths is not None:
            seq.job.paths.widen(why)  # the K policy: more next time
        return dataclasses.replace(sampler.sample(full, mask), path=R.path(why), fallback=why)
