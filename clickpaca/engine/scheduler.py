"""The scheduler: every tick is one llama_decode for all active sequences.

A tick is planned once (plan.py: one token for each generating sequence, then prompt
and scoring chunks, fewest tokens left first, up to nBatch tokens) and the batch is
filled from the plan. After the decode, each sequence advances by the tokens its plan
entry fed and its output rows go to it: a generating sequence samples from it (generation.py),
a scoring one adds its rows' NLL, and a prompt that is fully in the KV cache moves its
sequence on (to generating, to held after a prefill, or to its end with maxTokens 0).

Failures stay local: a decode that finds no KV room first defers prompt chunks, then
ends the sequence that holds the most cells; a failed decode ends only the sequences
that were in it. Every `infer` ends in exactly one `done` or `error`.
"""

from __future__ import annotations

import time

import numpy as np

from ..mask_ahead import MaskJob
from ..protocol import prefilled_event, scored_event
from ..scoring import score_rows
from . import generation
from .plan import Feed, Want, plan_tick
from .runtime import Runtime
from .sequences import Sequence, Sequences


def want(seq: Sequence) -> Want:
    """What the sequence asks of the tick, for the planner."""
    n = len(seq.tokens)
    if seq.state == "generate":  # its last sampled token, then a row to sample the next
        return Want(seq, True, seq.n_past, n, seq.n_past, seq.n_past, True)
    if seq.kind == "score":  # rows from the window's first scored position to the last but one
        return Want(seq, False, seq.n_past, n, seq.windows[seq.window][1], n - 2, False, seq.kv_wait)
    samples = seq.kind == "infer" and seq.max_tokens > 0  # a prefill only fills cells
    return Want(seq, False, seq.n_past, n, n - 1 if samples else n, n - 1, samples, seq.kv_wait)


class Scheduler:
    def __init__(self, rt: Runtime, seqs: Sequences) -> None:
        self.rt, self.seqs = rt, seqs
        self._prompt_tick = False  # deterministic mode: this tick feeds one prompt chunk only

    def tick(self) -> None:
        """Plan and fill one batch, decode it, then sample / score / finish what it produced."""
        ctx = self.rt.ctx
        for seq in list(self.seqs.order):
            if seq.state == "generate" and seq.n_past >= ctx.n_ctx_seq:
                self.seqs.fail(seq, f"context full: sequence reached {ctx.n_ctx_seq} tokens "
                                    f"(nCtx per sequence) after {seq.n_predicted} generated tokens")
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
        """Start filling the masks of the constrained sequences that sample this tick."""
        return self.rt.masks.start([(f.key.slot, f.key.matcher) for f in plan
                                    if f.samples and f.key.matcher is not None])

    def _next_is_prompt_tick(self) -> bool:
        """Deterministic mode never mixes generated tokens and prompt chunks in one decode
        (llama.cpp's split of such a batch can leave a prompt token alone in a micro-batch):
        with both waiting, prompt and generation ticks alternate."""
        kinds = {seq.state == "generate" for seq in self.seqs.order
                 if seq.state == "generate" or not seq.kv_wait}
        if kinds == {True, False}:
            return not self._prompt_tick
        return kinds == {False}

    def _plan(self, defer_prompts: bool) -> list[Feed]:
        """Plan the tick (plan.py) and fill the batch from it."""
        batch = self.rt.batch
        wants = [want(seq) for seq in self.seqs.order]
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
            if not f.generating and seq.t_prompt is None:
                seq.t_prompt = now
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

    def _consume(self, plan: list[Feed], job: MaskJob) -> None:
        """The decode succeeded: each sequence's fed tokens are in its KV cells now."""
        logits = self.rt.ctx.logits()
        now = time.perf_counter()
        sampling: list[tuple[Sequence, int]] = []
        for f in plan:
            seq = f.key
            seq.n_past += f.count
            if seq.kind == "score":
                self._advance_score(seq, f, logits[f.rows.start:f.rows.stop])
            elif f.samples:
                if not f.generating:
                    seq.state = "generate"
                    seq.t_first = now
                sampling.append((seq, f.rows[-1]))
            elif f.ends and seq.kind == "prefill":
                seq.state = "held"
                self.seqs.order.remove(seq)
                ms = (now - seq.t_prompt) * 1000 if seq.t_prompt else 0.0
                seq.session.send(prefilled_event(seq.seq_id, seq.n_past, ms))
            elif f.ends:  # an infer with maxTokens 0
                seq.t_first = now
                self.seqs.finish(seq, "max_tokens")
        if sampling:
            generation.sample(self.rt, self.seqs, sampling, logits, job)

    def _advance_score(self, seq: Sequence, f: Feed, rows: np.ndarray) -> None:
        toks, _ = seq.windows[seq.window]
        if len(rows):
            lo = f.row_pos  # the row at position p predicts the token at p + 1
            seq.nll.extend(score_rows(rows, toks[lo + 1: lo + 1 + len(rows)]).tolist())
        if f.ends:
            seq.window += 1
            self.rt.ctx.seq_rm(seq.slot, -1, -1)
            if seq.window < len(seq.windows):
                seq.tokens, seq.n_past = seq.windows[seq.window][0].tolist(), 0
            else:
                self._scored(seq)

    def _scored(self, seq: Sequence) -> None:
        ev = scored_event(seq.seq_id, seq.nll, len(seq.windows), seq.per_token)
        session = seq.session
        self.seqs.release(seq)
        session.send(ev)
