"""The scheduler: every tick is one llama_decode for all active sequences.

A tick packs, in this order, one token for each generating sequence, then prompt (and
scoring) chunks of waiting sequences, fewest tokens left first, up to nBatch tokens; a long
prompt is split across ticks so it never stalls the others. After the decode, each
output row goes to its sequence: a generating sequence samples from it (generation.py),
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
from ..scoring import score_rows
from . import generation
from .runtime import Runtime
from .sequences import Sequence, Sequences

#: One batch entry: (sequence, what ("gen", "prompt", "score"), first output row, outputs).
Entry = tuple[Sequence, str, int, int]


def prompt_order(order: list[Sequence]) -> list[Sequence]:
    """Waiting prompts, fewest tokens left first (ties: arrival order).

    Arrival order let one long prompt or score take the whole batch, tick after tick,
    while a one-token request behind it waited for all of it (114.6 s behind a
    40,000-character score); fewest-left-first lets short prompts through within a tick
    and gives the long one the rest of the batch. Generating sequences are not affected:
    they always get their token first.
    """
    waiting = [s for s in order if s.state == "prompt"]
    return sorted(waiting, key=lambda s: len(s.pending) - s.fed)


class Scheduler:
    def __init__(self, rt: Runtime, seqs: Sequences) -> None:
        self.rt, self.seqs = rt, seqs

    def tick(self) -> None:
        """Build one batch, decode it, then sample / score / finish what it produced."""
        ctx = self.rt.ctx
        for seq in list(self.seqs.order):
            if seq.state == "generate" and seq.n_past >= ctx.n_ctx_seq:
                self.seqs.fail(seq, f"context full: sequence reached {ctx.n_ctx_seq} tokens "
                                    f"(nCtx per sequence) after {seq.n_predicted} generated tokens")
        plan = self._plan(defer_prompts=False)
        job = self._start_masks(plan)  # runs while the decode does (mask_ahead.py)
        try:
            while plan:
                rc = ctx.decode(self.rt.batch)
                if rc == 0:
                    break
                job.wait()  # the matchers must be idle before any sequence ends
                plan = self._recover(plan, rc)
        finally:
            job.wait()
        if plan:
            self._consume(plan, job)

    def _start_masks(self, plan: list[Entry]) -> MaskJob:
        """Start filling the masks of the constrained sequences that sample this tick."""
        return self.rt.masks.start([(seq.slot, seq.matcher) for seq, what, _, n_out in plan
                                    if seq.matcher is not None and (what == "gen" or (
                                        what == "prompt" and n_out and seq.kind == "infer"))])

    def _plan(self, defer_prompts: bool) -> list[Entry]:
        """Fill the batch. Entries: (seq, what, first output row, number of outputs)."""
        batch = self.rt.batch
        batch.clear()
        plan = []
        row = 0
        for seq in self.seqs.order:
            if seq.state == "generate":
                batch.add([seq.next_token], seq.n_past, seq.slot, output_last=True)
                plan.append((seq, "gen", row, 1))
                row += 1
        now = time.perf_counter()
        for seq in prompt_order(self.seqs.order):
            if seq.state != "prompt" or batch.free == 0 or defer_prompts or seq.kv_wait:
                continue
            take = min(batch.free, len(seq.pending) - seq.fed)
            chunk = seq.pending[seq.fed:seq.fed + take]
            pos0 = seq.n_past
            if seq.t_prompt is None:
                seq.t_prompt = now
            if seq.kind == "score":
                first = seq.windows[seq.window][1]
                last_scored = len(seq.pending) - 2  # the row at p predicts token p + 1
                lo, hi = max(first, pos0), min(pos0 + take - 1, last_scored)
                batch.add(chunk, pos0, seq.slot, output_last=False)
                n_out = max(0, hi - lo + 1)
                if n_out:
                    batch.logits[batch.n - take + (lo - pos0): batch.n - take + (hi - pos0) + 1] = 1
                plan.append((seq, "score", row, n_out))
                row += n_out
            else:
                ends = seq.fed + take == len(seq.pending)
                needs_row = ends and seq.kind == "infer"
                batch.add(chunk, pos0, seq.slot, output_last=needs_row)
                plan.append((seq, "prompt", row, 1 if needs_row else 0))
                row += 1 if needs_row else 0
        return plan

    def _recover(self, plan: list[Entry], rc: int) -> list[Entry]:
        """The decode failed: end only the sequences concerned, rebuild, and retry."""
        seqs = self.seqs
        if rc != 1:  # aborted or an internal error: the sequences in the batch end
            for seq in {entry[0] for entry in plan}:
                seqs.fail(seq, f"decode failed (llama_decode returned {rc})")
            return self._plan(defer_prompts=False) if seqs.order else []
        prompt_seqs = [e[0] for e in plan if e[1] in ("prompt", "score")]
        gen_seqs = [e[0] for e in plan if e[1] == "gen"]
        if prompt_seqs and gen_seqs:
            for seq in prompt_seqs:  # let generation go on; retry prompts when cells free up
                seq.kv_wait = True
            return self._plan(defer_prompts=True)
        victims = prompt_seqs or gen_seqs
        victim = victims[-1] if prompt_seqs else max(victims, key=lambda s: s.n_past)
        seqs.fail(victim, "KV cache full: no room for this sequence's tokens "
                          f"(nCtx {self.rt.ctx.n_ctx} cells shared by all sequences)")
        return self._plan(defer_prompts=False)

    def _consume(self, plan: list[Entry], job: MaskJob) -> None:
        logits = self.rt.ctx.logits()
        now = time.perf_counter()
        sampling: list[tuple[Sequence, int]] = []
        for seq, what, row, n_out in plan:
            if what == "gen":
                seq.tokens.append(seq.next_token)
                sampling.append((seq, row))
            elif what == "prompt":
                self._advance_prompt(seq)
                if seq.fed == len(seq.pending):
                    if seq.kind == "prefill":
                        seq.state = "held"
                        self.seqs.order.remove(seq)
                        ms = (now - seq.t_prompt) * 1000 if seq.t_prompt else 0.0
                        seq.session.send({"type": "prefilled", "seq_id": seq.seq_id,
                                          "tokens": seq.n_past, "prompt_ms": round(ms, 3)})
                    elif seq.max_tokens == 0:
                        seq.t_first = now
                        self.seqs.finish(seq, "max_tokens")
                    else:
                        seq.state = "generate"
                        seq.t_first = now
                        sampling.append((seq, row))
            else:
                self._advance_score(seq, logits[row:row + n_out])
        if sampling:
            generation.sample(self.rt, self.seqs, sampling, logits, job)

    def _advance_prompt(self, seq: Sequence) -> None:
        """Move the prompt tokens this tick's batch held for the sequence into its context."""
        batch = self.rt.batch
        # how many tokens of this sequence went into the batch: count them in the batch
        take = int(np.count_nonzero(batch.seq[:batch.n] == seq.slot))
        seq.tokens.extend(int(t) for t in seq.pending[seq.fed:seq.fed + take])
        seq.fed += take

    def _advance_score(self, seq: Sequence, rows: np.ndarray) -> None:
        pos0 = seq.n_past
        self._advance_prompt(seq)
        toks, first = seq.windows[seq.window]
        if len(rows):
            lo = max(first, pos0)
            seq.nll.extend(score_rows(rows, toks[lo + 1: lo + 1 + len(rows)]).tolist())
        if seq.fed == len(seq.pending):
            seq.window += 1
            self.rt.ctx.seq_rm(seq.slot, -1, -1)
            seq.tokens = []
            if seq.window < len(seq.windows):
                seq.pending, seq.fed = seq.windows[seq.window][0], 0
            else:
                self._scored(seq)

    def _scored(self, seq: Sequence) -> None:
        nll = np.asarray(seq.nll, dtype=np.float64)
        mean = float(nll.mean()) if len(nll) else float("nan")
        ev = {"type": "scored", "seq_id": seq.seq_id, "tokens": len(nll), "nll": mean,
              "ppl": float(np.exp(mean)), "windows": len(seq.windows)}
        if seq.per_token:
            ev["token_nll"] = [round(x, 6) for x in seq.nll]
        session = seq.session
        self.seqs.release(seq)
        session.send(ev)
