"""A job per request kind that runs over ticks: what an active sequence is doing.

A sequence (sequences.py) is a slot, its one token history and its KV cells; while a
request runs on it, it holds that request's job, and only the job knows its kind:

- what it sets while it runs (`begin`, `end`: a sequence's control-vector strength),
- what it wants from a tick (`want`, for the planner: plan.py),
- what it does with its share of the decode (`fed`: its logits rows, its end),
- how it ends (`done`: the `done` event of a cancel, a shutdown or its own end),
- the events it sends, through the protocol's constructors.

Fork and load are ways a held sequence starts (no job: nothing to run), not kinds. A
new request kind that runs over ticks is one class here, its protocol dataclass and its
handler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..protocol import done_event, prefilled_event, scored_event
from ..scoring import score_rows
from ..usersteps import step_ms
from .plan import Feed, Want
from .text import StopMatcher, Utf8Assembler

if TYPE_CHECKING:
    from .readout import JobCapture
    from ..sampling import SequenceSampler
    from .runtime import Runtime
    from .sequences import Sequence, Sequences


@dataclass
class Tick:
    """What a job's `fed` may use after a successful decode."""

    rt: "Runtime"
    seqs: "Sequences"
    logits: np.ndarray
    now: float
    sampling: list = field(default_factory=list)  # (sequence, row) that sample this tick
    captured: dict = field(default_factory=dict)  # sequence -> its captured rows or CaptureError (readout.py)


@dataclass(eq=False)
class Job:
    kind: ClassVar[str]
    n_prompt: int = 0  # tokens this request feeds (the `done` stats, accounting)
    t_prompt: float | None = None  # when its first prompt chunk went into a batch
    capture: "JobCapture | None" = None  # the activations it reads (readout.py)

    def begin(self, seq: "Sequence") -> None:
        """It starts on the sequence (Sequences.start), before any of its tokens is decoded."""

    def end(self, seq: "Sequence") -> None:
        """It is over (held, finished, failed or released): undo what `begin` set."""

    def want(self, seq: "Sequence") -> Want:
        raise NotImplementedError

    def reads(self, w: Want) -> Want:
        """Its Want with the logits rows its capture needs (readout.JobCapture.widen)."""
        return w if self.capture is None else self.capture.widen(w)

    def read(self, tick: Tick, seq: "Sequence") -> bool:
        """Keep this tick's captured rows, before `fed`; False: the capture failed and the
        request ended with an error naming it."""
        got = tick.captured.get(seq)
        if got is None:
            return True
        if isinstance(got, Exception):
            tick.seqs.fail(seq, str(got))
            return False
        self.capture.took(got)
        return True

    def captured(self, seq: "Sequence") -> dict:
        """`capture` for its end event, when it asked (readout.JobCapture.event_field)."""
        if self.capture is None:
            return {}
        return {"capture": self.capture.event_field(seq.seq_id)}

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        """Its plan entry's tokens are in the KV cells now (seq.n_past moved on)."""
        raise NotImplementedError

    def overflow(self, seq: "Sequence", n_ctx_seq: int) -> str | None:
        """Why it cannot go on in the context's room, before a tick (None: it can)."""
        return None

    def done(self, seq: "Sequence", reason: str, stop: str | None, now: float) -> dict:
        """The `done` event that ends it (cancelled, shutdown), with what it captured so far."""
        return done_event(seq.seq_id, reason, request=self.kind, **self.captured(seq))


@dataclass(eq=False)
class InferJob(Job):
    """Feed the prompt, then sample a token a tick until the request is over
    (generation.py samples the rows and decides the end)."""

    kind: ClassVar[str] = "infer"
    sampler: "SequenceSampler | None" = None
    matcher: Any = None
    stops: StopMatcher | None = None
    utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    max_tokens: int = 0
    n_predicted: int = 0
    n_reused: int = 0
    t_first: float | None = None
    generating: bool = False  # the prompt is in: one sampled token a tick
    # its own control-vector strength (controlVectorStrength) on the context's vector
    # (activations/vector.py), for every token it decodes; None: init's, as every sequence
    steer: Any = None
    strength: float | None = None

    def begin(self, seq: "Sequence") -> None:
        if self.steer is not None:
            self.steer.set(seq.slot, self.strength)

    def end(self, seq: "Sequence") -> None:
        if self.steer is not None:
            self.steer.reset(seq.slot)

    def want(self, seq: "Sequence") -> Want:
        n = len(seq.tokens)
        if self.generating:  # its last sampled token, then a row to sample the next
            return self.reads(Want(seq, True, seq.n_past, n, seq.n_past, seq.n_past, True))
        samples = self.max_tokens > 0
        return self.reads(Want(seq, False, seq.n_past, n, n - 1 if samples else n, n - 1, samples, seq.kv_wait))

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        if f.samples:
            if not f.generating:
                self.generating = True
                self.t_first = tick.now
            tick.sampling.append((seq, f.rows[-1]))
        elif f.ends:  # maxTokens 0
            self.t_first = tick.now
            tick.seqs.finish(seq, "max_tokens")

    def overflow(self, seq: "Sequence", n_ctx_seq: int) -> str | None:
        if self.generating and seq.n_past >= n_ctx_seq:
            return (f"context full: sequence reached {n_ctx_seq} tokens (nCtx per sequence) "
                    f"after {self.n_predicted} generated tokens")
        return None

    def done(self, seq: "Sequence", reason: str, stop: str | None, now: float) -> dict:
        """With the request's timings, and the bytes of a character it left unfinished."""
        t_prompt_end = self.t_first or now
        prompt_s = (t_prompt_end - self.t_prompt) if self.t_prompt else 0.0
        eval_s = (now - self.t_first) if self.t_first else 0.0
        return done_event(
            seq.seq_id, reason, stop, tokens_prompt=self.n_prompt, tokens_reused=self.n_reused,
            tokens_predicted=self.n_predicted, prompt_ms=round(prompt_s * 1000, 3),
            eval_ms=round(eval_s * 1000, 3),
            prompt_tps=round(self.n_prompt / prompt_s, 2) if prompt_s > 0 else None,
            # the first token comes from the prompt's logits: n tokens take n - 1 decodes
            eval_tps=round((self.n_predicted - 1) / eval_s, 2) if eval_s > 0 and self.n_predicted > 1 else None,
            **self._tail(), **self._steps_ms(), **self.captured(seq))

    def _tail(self) -> dict:
        """`tail`: the bytes of a character the last tokens began but never completed (the
        request ended first: maxTokens, a stop, a cancel), which no token event carried."""
        held = self.utf8.pending
        self.utf8.flush()
        return {"tail": held.decode("utf-8", "replace"), "tail_bytes": list(held)} if held else {}

    def _steps_ms(self) -> dict:
        """`steps_ms`: the CPU time of the user-defined steps this request ran, when any did."""
        ms = step_ms(self.sampler.states) if self.sampler is not None else None
        return {"steps_ms": ms} if ms else {}


@dataclass(eq=False)
class ScoreJob(Job):
    """Feed each window of the text and add the NLL of its scored tokens; `scored` at
    the end, the sequence then released."""

    kind: ClassVar[str] = "score"
    windows: list = field(default_factory=list)  # (tokens, first scored position) each
    window: int = 0
    nll: list = field(default_factory=list)
    per_token: bool = False

    def want(self, seq: "Sequence") -> Want:
        n = len(seq.tokens)  # rows from the window's first scored position to the last but one
        return self.reads(Want(seq, False, seq.n_past, n, self.windows[self.window][1], n - 2, False, seq.kv_wait))

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        toks, first = self.windows[self.window]
        # the scored rows among its rows (a capture may have asked logits for others too)
        lo, hi = max(f.row_pos, first), min(f.row_pos + len(f.rows), len(toks) - 1)
        if hi > lo:  # the row at position p predicts the token at p + 1
            rows = tick.logits[f.rows.start + lo - f.row_pos:f.rows.start + hi - f.row_pos]
            self.nll.extend(score_rows(rows, toks[lo + 1: hi + 1]).tolist())
        if not f.ends:
            return
        self.window += 1
        tick.rt.ctx.seq_rm(seq.slot, -1, -1)
        if self.window < len(self.windows):
            seq.tokens, seq.n_past = self.windows[self.window][0].tolist(), 0
            return
        ev = scored_event(seq.seq_id, self.nll, len(self.windows), self.per_token,
                          **self.captured(seq))
        tick.seqs.release(seq)
        seq.session.send(ev)


@dataclass(eq=False)
class PrefillJob(Job):
    """Feed the prompt into the cells; the sequence is then held (`prefilled`)."""

    kind: ClassVar[str] = "prefill"

    def want(self, seq: "Sequence") -> Want:
        n = len(seq.tokens)  # no row: a prefill only fills cells
        return self.reads(Want(seq, False, seq.n_past, n, n, n - 1, False, seq.kv_wait))

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        if f.ends:
            tick.seqs.hold(seq)
            ms = (tick.now - self.t_prompt) * 1000 if self.t_prompt else 0.0
            seq.session.send(prefilled_event(seq.seq_id, seq.n_past, ms, **self.captured(seq)))
