"""The scheduler: every tick is one llama_decode for all active sequences.

A tick is planned once (plan.py: one token for each generating sequence, or with the
tokens its grammar forces after it, jump.py; then prompt and scoring chunks, fewest
tokens left first, up to nBatch tokens). The scheduler knows no
request kind and calls only the Job interface (jobs.py): after the decode each sequence
advances by the tokens it fed and its job takes its share (`fed`: score, hold, end, or ask
for a row to sample). Then the rows asked for are sampled: with a presampler (init
`preselect`) the rows the decode pre-selected first (sampling.fastpath.sample_tick; a row
whose values cannot decide is sampled on its whole row), then every other row in one
batched host call (sampling.batch.sample_tick); each token goes back to its job (`sampled`).

Failures stay local: a decode that finds no KV room first defers prompt chunks, then
ends the sequence that holds the most cells; a failed decode ends only the sequences
that were in it. Every stage that serves one sequence (faults.STAGES: its preparation,
capture arm, order, mask, capture take, readout, feed, read, sampling, accept, events,
capture file) runs guarded (`_guard`): a failure there ends that sequence alone with an
`error` naming the stage, and the others in the tick go on. The calls that serve
several sequences at once (the mask fill, the capture's arm and take, the
pre-selection's orders and reads, the sampling) go through faults.each: on failing,
they are redone one sequence at a time to find whose it was. A sequence that ends while
the batch is filled (`_plan`) or its grammar rows are ordered is taken out of the batch,
which is filled again: its tokens must not reach cells it no longer owns. Only what
serves the whole batch (planning, the decode, its logits) can fail a tick; the server
then ends every request in it with an error (Sequences.fail_all). Every `infer` ends in
exactly one `done` or `error`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from typing import Any, Callable

from ..sampling import fastpath
from ..sampling.batch import sample_tick
from ..sampling.usersteps import StepFailed
from . import faults
from .jobs import Tick
from .mask_ahead import MaskJob
from .plan import Feed, plan_tick
from .runtime import Runtime
from .sequences import Sequence, Sequences

_FAILED = object()  # what `_guard` returns for a stage that failed
_GRAMMAR = object()  # `_route`: pre-selected once its grammar mask is made


class Scheduler:
    def __init__(self, rt: Runtime, seqs: Sequences) -> None:
        self.rt, self.seqs = rt, seqs
        self._prompt_tick = False  # deterministic mode: this tick feeds one prompt chunk only
        # logits rows whose pages stay resident between requests (a generating tick uses
        # one per sequence); those past it are given back once no decode needs them
        self._keep_rows = max(64, rt.ctx.n_seq_max)
        self._host_why: dict = {}  # with a presampler: why a sampled row came back whole
        self._grammar_wait: list = []  # with a presampler: rows to order once their masks are made

    def tick(self) -> None:
        """Plan and fill one batch, decode it, then sample / score / finish what it produced."""
        ctx = self.rt.ctx
        for seq in list(self.seqs.order):
            why = self._guard(seq, "prepare", seq.job.overflow, seq, ctx.n_ctx_seq)
            if why is not None and why is not _FAILED:
                self.seqs.fail(seq, why)
        if self.rt.deterministic:
            self._prompt_tick = self._next_is_prompt_tick()
        plan = self._plan(defer_prompts=False)
        job = self._start_masks(plan)  # runs while the decode does (mask_ahead.py)
        try:
            while plan:
                if self._grammar_orders(job, plan):  # one in the batch ended: filled again without it
                    plan = self._plan(defer_prompts=False)
                    job = self._start_masks(plan)
                    continue
                for f in plan:  # the tests' way to fail the tick itself (faults.py)
                    faults.hit("decode", f.key.seq_id)
                rc = ctx.decode(self.rt.batch)
                if rc == 0:
                    break
                job.wait()  # the matchers must be idle before any sequence ends
                plan = self._recover(plan, rc)
                job = self._start_masks(plan)
        finally:
            job.wait()
        if plan:
            self._consume(plan, job)
        # the tick's logits are read: once no decode needs many rows (the requests that
        # wrote them are over, or nothing runs), their pages go back (core.release_logits)
        if ctx.n_outputs <= self._keep_rows or not self.seqs.order:
            ctx.release_logits(self._keep_rows)

    def _guard(self, seq: Sequence, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), one stage of serving `seq`; when it raises, `seq` alone ends with an
        `error` naming the stage (unless its request was answered already) and this
        returns _FAILED. faults.hit is the tests' way in (faults.py)."""
        try:
            faults.hit(stage, seq.seq_id)
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the others in the tick go on
            self._fail(seq, stage, e)
            return _FAILED

    def _fail(self, seq: Sequence, stage: str, e: BaseException) -> None:
        """End `seq` alone with an `error` naming `stage`, where `e` was raised (unless
        its request was answered already)."""
        if not isinstance(e, faults.StageFailed):
            traceback.print_exception(e, file=sys.stderr)
        if seq.job is not None:  # still running: its request has had no end event
            self.seqs.fail(seq, faults.describe(stage, e))

    def _wants(self) -> list:
        """Each active sequence's Want (stage `prepare`)."""
        wants = [self._guard(seq, "prepare", seq.job.want, seq) for seq in list(self.seqs.order)]
        return [w for w in wants if w is not _FAILED]

    def _start_masks(self, plan: list[Feed]) -> MaskJob:
        """Start filling the masks of the rows that sample this tick, for the jobs that
        have a grammar."""
        pairs = []
        for f in plan:
            if f.samples:
                matcher = f.key.job.grammar()
                if matcher is not None:
                    pairs.append((f.key, matcher))
        return self.rt.masks.start(pairs)

    def _next_is_prompt_tick(self) -> bool:
        """Deterministic mode never mixes generated tokens and prompt chunks in one decode
        (llama.cpp's split of such a batch can leave a prompt token alone in a micro-batch):
        with both waiting, prompt and generation ticks alternate."""
        wants = self._wants()
        kinds = {w.generating for w in wants if w.generating or not w.waiting}
        if kinds == {True, False}:
            return not self._prompt_tick
        return kinds == {False}

    def _plan(self, defer_prompts: bool) -> list[Feed]:
        """Plan the tick (plan.py) and fill the batch from it. A sequence that ends while
        the batch is filled (its entry, its capture's rows or its row's order failed)
        would leave its tokens in the batch, to land in cells it no longer owns: the
        batch is then planned and filled again without it."""
        while True:
            plan = self._fill(defer_prompts)
            if all(f.key.job is not None for f in plan):
                return plan

    def _fill(self, defer_prompts: bool) -> list[Feed]:
        """One try of `_plan`: the plan, the batch filled, the capture armed and the rows
        pre-selected, each sequence's part guarded; stops early once one has ended."""
        batch = self.rt.batch
        wants = self._wants()
        if self.rt.deterministic:
            plan = plan_tick(wants, batch.capacity, one_prompt=True) if self._prompt_tick \
                else plan_tick(wants, batch.capacity, defer_prompts=True)
        else:
            plan = plan_tick(wants, batch.capacity, defer_prompts)
        batch.clear()
        now = time.perf_counter()
        for f in plan:
            self._guard(f.key, "prepare", self._add, f, now)
        if any(f.key.job is None for f in plan):
            return plan
        # the rows the jobs capture in this decode (readout.py); a job whose part failed ends
        for seq, e in self.rt.readout.arm(plan, batch).items():
            self._fail(seq, "arm", e)
        if any(f.key.job is None for f in plan):
            return plan
        self._preselect(plan)
        return plan

    def _add(self, f: Feed, now: float) -> None:
        """One plan entry's tokens (and logits rows) into the batch."""
        batch, seq = self.rt.batch, f.key
        batch.add(seq.job.feed_tokens(seq)[f.pos:f.pos + f.count], f.pos, seq.slot, output_last=False)
        if f.rows:
            first = f.at + f.row_pos - f.pos
            batch.logits[first:first + len(f.rows)] = 1
        if not f.generating and seq.job.t_prompt is None:
            seq.job.t_prompt = now

    def _preselect(self, plan: list[Feed]) -> None:
        """With a presampler (init preselect): tell it the rows whose chain runs on
        pre-selected values (sampling/fastpath.py); every other row comes back whole,
        and why is kept for its token's `path`."""
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
            if isinstance(got, str):
                self._host_why[seq] = got
            elif got is _GRAMMAR:
                self._grammar_wait.append(seq)
            elif got is not _FAILED:
                ready.append(seq)
        ps.order(self._orders(ready, [None] * len(ready)))

    def _grammar_orders(self, job: MaskJob, plan: list[Feed]) -> bool:
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
                self._host_why[seq] = "grammar mask failed"
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
        paths = getattr(seq.job, "paths", None)
        return paths.k if paths is not None else fastpath.K_MIN

    @staticmethod
    def _route(seq: Sequence, f: Feed) -> Any:
        """None when the sequence's row is ordered now (without a grammar), _GRAMMAR when
        once its mask is made, or why its row comes back whole."""
        if len(f.rows) != 1:
            return "more than one row"  # a capture asked for logits rows beside the sampled one
        grammar = seq.job.grammar() is not None
        why = fastpath.route(seq.job.drawer(), grammar=grammar)
        if why is not None:
            return why
        return _GRAMMAR if grammar else None  # a grammar's row: ordered in _grammar_orders

    def _recover(self, plan: list[Feed], rc: int) -> list[Feed]:
        """The decode failed: end only the sequences concerned, rebuild, and retry."""
        seqs = self.seqs
        if rc != 1:  # aborted or an internal error: the sequences in the batch end
            for seq in {f.key for f in plan}:
                seqs.fail(seq, f"decode failed (llama_decode returned {rc})")
            return self._plan(defer_prompts=False) if seqs.order else []
        prompt_seqs = [f.key for f in plan if not f.generating]
        gen_seqs = [f.key for f in plan if f.generating]
        if prompt_seqs and gen_seqs:
            for seq in prompt_seqs:  # let generation go on; retry prompts when cells free up
                seq.kv_wait = True
            return self._plan(defer_prompts=True)
        victims = prompt_seqs or gen_seqs
        victim = victims[-1] if prompt_seqs else max(victims, key=lambda s: s.n_past)
        seqs.fail(victim, "KV cache full: no room for this sequence's tokens "
                          f"(nCtx {self.rt.ctx.n_ctx} cells shared by all sequences)")
        return self._plan(defer_prompts=False)

    def _consume(self, plan: list[Feed], masks: MaskJob) -> None:
        """The decode succeeded: each sequence's fed tokens are in its KV cells now."""
        # each sequence's captured rows, or the error of its part of the take (readout.py)
        tick = Tick(self.rt, self.seqs, self.rt.ctx.logits(), time.perf_counter(),
                    captured=self.rt.readout.take())
        for f in plan:
            seq = f.key
            if seq.job is None:  # ended earlier in this tick
                continue
            seq.n_past += f.count
            if self._guard(seq, "readout", seq.job.read, tick, seq) is True:
                self._guard(seq, "feed", seq.job.fed, tick, seq, f)
        if tick.draws:
            self._sample(tick, masks)

    def _sample(self, tick: Tick, masks: MaskJob) -> None:
        """Sample every row the jobs asked for (`Tick.draw`) at once and hand each job its
        token (`sampled`). sampling.batch.sample_tick takes the tick's rows together:
        greedy and top-k chains without a grammar share passes over the block, every
        other row runs its own chain, spread over the decode's threads (idle while the
        host samples); the results are bit for bit the per-sequence ones
        (tests/test_sampling_batch.py). A user-defined step that raises (StepFailed)
        costs only its own sequence, as does any failure of one row (stage `sampling`)."""
        # the mask job was started for exactly the plan's sampling entries with a grammar
        draws, mask_rows = [], []
        for d in tick.draws:
            if d[0].job is None:
                continue
            try:  # None: no grammar (the tests' hook reached `mask` in the fill: mask_ahead.py)
                row = masks.row(d[0])
            except Exception as e:  # noqa: BLE001 - its own mask failed; the others go on
                self._fail(d[0], "mask", e)
                continue
            draws.append(d)
            mask_rows.append(row)
        if not draws:
            return
        ps = self.rt.ctx.presampler
        if ps is not None:  # the pre-selected rows first, each on its own (fastpath.py)
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
        why = self._host_why if ps is not None else None
        for (seq, row, _), mask, res in zip(draws, mask_rows, results):
            if why is not None and not isinstance(res, Exception):
                res = dataclasses.replace(res, path=f"host: {why.get(seq, 'host')}")
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
                    self._host_why[seq] = "the row came back whole"
            else:
                fast.append((d, mask, pre))
                tick.preselected.add(row)
        if not fast:
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
            if isinstance(res, str):
                res = self._guard(seq, "sampling", self._whole_row, ps, seq, row, sampler, mask, res, n_out, pre)
                if res is _FAILED:
                    continue
            self._guard(seq, "accept", seq.job.sampled, tick, seq, row, mask, res)
        return rest, rest_masks

    @staticmethod
    def _whole_row(ps: Any, seq: Sequence, row: int, sampler: Any, mask: Any, why: str, n_out: int,
                   pre: Any = None) -> Any:
        """The host path on a pre-selected row's whole row, when its values could not
        decide (`why`: the result's `path` says it; `pre`: the row's pack)."""
        full = ps.full_row(row, n_out, pre)
        if full is None:
            raise RuntimeError(f"the whole row is needed ({why}) and this build does not keep it")
        paths = getattr(seq.job, "paths", None)
        if paths is not None and why == fastpath.PAST_K:
            paths.k = min(paths.k * 2, fastpath.K_MAX)  # ask for more next time
        return dataclasses.replace(sampler.sample(full, mask), path=f"host: {why}")
