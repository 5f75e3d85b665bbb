"""The scheduler: every tick is one llama_decode for all active sequences.

A tick is planned once (plan.py: one token for each generating sequence, then prompt
and scoring chunks, fewest tokens left first, up to nBatch tokens) and the batch is
filled from the plan. The scheduler knows no request kind and calls only the Job
interface (jobs.py): each active sequence's job says what it wants from a tick and which
grammar masks its sampled row (filled while the decode runs: mask_ahead.py); after the
decode each sequence advances by the tokens its plan entry fed and its job takes its
share (`fed`: score, hold, end, or ask for a row to sample); then every row asked for is
sampled in one batched call (sampling.batch.sample_tick) and each token handed back to
its job (`sampled`).

Failures stay local: a decode that finds no KV room first defers prompt chunks, then
ends the sequence that holds the most cells; a failed decode ends only the sequences
that were in it. Every `infer` ends in exactly one `done` or `error`.
"""

from __future__ import annotations

import time

from ..sampling.batch import sample_tick
from ..sampling.usersteps import StepFailed
from .jobs import Tick
from .mask_ahead import MaskJob
from .plan import Feed, plan_tick
from .runtime import Runtime
from .sequences import Sequences


class Scheduler:
    def __init__(self, rt: Runtime, seqs: Sequences) -> None:
        self.rt, self.seqs = rt, seqs
        self._prompt_tick = False  # deterministic mode: this tick feeds one prompt chunk only

    def tick(self) -> None:
        """Plan and fill one batch, decode it, then sample / score / finish what it produced."""
        ctx = self.rt.ctx
        for seq in list(self.seqs.order):
            why = seq.job.overflow(seq, ctx.n_ctx_seq)
            if why is not None:
                self.seqs.fail(seq, why)
        if self.rt.deterministic:
            self._prompt_tick = self._next_is_prompt_tick()
        plan = self._plan(defer_prompts=False)
        job = self._start_masks(plan)  # runs while the decode does (mask_ahead.py)
        try:
            while plan:
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

    def _start_masks(self, plan: list[Feed]) -> MaskJob:
        """Start filling the masks of the rows that sample this tick, for the jobs that
        have a grammar."""
        pairs = []
        for f in plan:
            if f.samples:
                matcher = f.key.job.grammar()
                if matcher is not None:
                    pairs.append((f.key.slot, matcher))
        return self.rt.masks.start(pairs)

    def _next_is_prompt_tick(self) -> bool:
        """Deterministic mode never mixes generated tokens and prompt chunks in one decode
        (llama.cpp's split of such a batch can leave a prompt token alone in a micro-batch):
        with both waiting, prompt and generation ticks alternate."""
        wants = [seq.job.want(seq) for seq in self.seqs.order]
        kinds = {w.generating for w in wants if w.generating or not w.waiting}
        if kinds == {True, False}:
            return not self._prompt_tick
        return kinds == {False}

    def _plan(self, defer_prompts: bool) -> list[Feed]:
        """Plan the tick (plan.py) and fill the batch from it."""
        batch = self.rt.batch
        wants = [seq.job.want(seq) for seq in self.seqs.order]
        if self.rt.deterministic:
            plan = plan_tick(wants, batch.capacity, one_prompt=True) if self._prompt_tick \
                else plan_tick(wants, batch.capacity, defer_prompts=True)
        else:
            plan = plan_tick(wants, batch.capacity, defer_prompts)
        batch.clear()
        now = time.perf_counter()
        for f in plan:
            seq = f.key
            batch.add(seq.tokens[f.pos:f.pos + f.count], f.pos, seq.slot, output_last=False)
            if f.rows:
                first = f.at + f.row_pos - f.pos
                batch.logits[first:first + len(f.rows)] = 1
            if not f.generating and seq.job.t_prompt is None:
                seq.job.t_prompt = now
        self.rt.readout.arm(plan, batch)  # the rows the jobs capture in this decode (readout.py)
        return plan

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
        tick = Tick(self.rt, self.seqs, self.rt.ctx.logits(), time.perf_counter(),
                    captured=self.rt.readout.take())
        for f in plan:
            seq = f.key
            seq.n_past += f.count
            if seq.job.read(tick, seq):
                seq.job.fed(tick, seq, f)
        if tick.draws:
            self._sample(tick, masks)

    def _sample(self, tick: Tick, masks: MaskJob) -> None:
        """Sample every row the jobs asked for (`Tick.draw`) at once and hand each job its
        token (`sampled`). sampling.batch.sample_tick takes the tick's rows together:
        greedy and top-k chains without a grammar share passes over the block, every
        other row runs its own chain, spread over the decode's threads (idle while the
        host samples); the results are bit for bit the per-sequence ones
        (tests/test_sampling_batch.py). A user-defined step that raises (StepFailed)
        costs only its own sequence."""
        draws = tick.draws
        # the mask job was started for exactly the plan's sampling entries with a grammar
        mask_rows = [masks.row(seq.slot) for seq, _, _ in draws]  # None: no grammar
        results = sample_tick([sampler for _, _, sampler in draws], tick.logits, [row for _, row, _ in draws],
                              mask_rows, isolate=(StepFailed,), threads=self.rt.ctx.n_threads)
        for (seq, row, _), mask, res in zip(draws, mask_rows, results):
            seq.job.sampled(tick, seq, row, mask, res)
