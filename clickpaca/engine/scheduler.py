"""The scheduler: every tick is one llama_decode for all active sequences.

A tick is planned once (plan.py: one token for each generating sequence, or with the
tokens its grammar forces after it, jump.py; then prompt and scoring chunks, fewest
tokens left first, up to nBatch tokens). The scheduler knows no
request kind and calls only the Job interface (jobs.py): after the decode each sequence
advances by the tokens it fed and its job takes its share (`fed`: score, hold, end, or ask
for a row to sample). Then the rows asked for are sampled in one call (tick_sampling.py,
which owns the pre-selection: the rows it orders before the decode and the route each
row takes after it); each token goes back to its job (`sampled`).

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

import sys
import time
import traceback
from typing import Any, Callable

from . import faults
from .jobs import Tick
from .mask_ahead import MaskJob
from .plan import PROMPT, Feed, next_kind, plan_tick
from .runtime import Runtime
from .sequences import Sequence, Sequences
from .tick_sampling import TickSampler

_FAILED = object()  # what `_guard` returns for a stage that failed


class Scheduler:
    def __init__(self, rt: Runtime, seqs: Sequences) -> None:
        self.rt, self.seqs = rt, seqs
        self._kind: str | None = None  # deterministic mode: this tick's kind (plan.next_kind)
        # logits rows whose pages stay resident between requests (a generating tick uses
        # one per sequence); those past it are given back once no decode needs them
        self._keep_rows = max(64, rt.ctx.n_seq_max)
        self.sampling = TickSampler(rt, seqs, self._fail, self._guard, _FAILED)

    def tick(self) -> None:
        """Plan and fill one batch, decode it, then sample / score / finish what it produced."""
        ctx = self.rt.ctx
        for seq in list(self.seqs.order):
            why = self._guard(seq, "prepare", seq.job.overflow, seq, ctx.n_ctx_seq)
            if why is not None and why is not _FAILED:
                self.seqs.fail(seq, why)
        if self.rt.deterministic:
            self._kind = next_kind(self._wants(), self._kind)
        plan = self._plan(defer_prompts=False)
        job = self._start_masks(plan)  # runs while the decode does (mask_ahead.py)
        try:
            while plan:
                if self.sampling.order_grammar(job, plan):  # one in the batch ended: filled again without it
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
            n_ubatch = self.rt.ctx.n_ubatch
            plan = plan_tick(wants, batch.capacity, one_prompt=True, n_ubatch=n_ubatch) \
                if self._kind == PROMPT \
                else plan_tick(wants, batch.capacity, defer_prompts=True, only=self._kind,
                               pair_rows=max(1, n_ubatch // 2))
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
        self.sampling.order(plan)
        return plan

    def _add(self, f: Feed, now: float) -> None:
        """One plan entry's tokens (and logits rows) into the batch."""
        batch, seq = self.rt.batch, f.key
        if f.refed:  # a token fed again (deterministic mode's pairs, plan.py) goes back into its cell
            self.rt.ctx.seq_rm(seq.slot, f.pos, -1)
        batch.add(seq.job.feed_tokens(seq)[f.pos:f.pos + f.count], f.pos, seq.slot, output_last=False)
        if f.rows:
            first = f.at + f.row_pos - f.pos
            batch.logits[first:first + len(f.rows)] = 1
        if not f.generating and seq.job.t_prompt is None:
            seq.job.t_prompt = now

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
            seq.n_past = f.pos + f.count
            if self._guard(seq, "readout", seq.job.read, tick, seq) is True:
                self._guard(seq, "feed", seq.job.fed, tick, seq, f)
        if tick.draws:
            self._sample(tick, masks)

    def _sample(self, tick: Tick, masks: MaskJob) -> None:
        """Sample every row the jobs asked for (`Tick.draw`) in one call
        (tick_sampling.TickSampler.sample), each with its grammar's mask row; a mask
        that failed costs only its own sequence (stage `mask`)."""
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
        if draws:
            self.sampling.sample(tick, draws, mask_rows)
