"""A job per request kind that runs over ticks: what an active sequence is doing.

A sequence (sequences.py) is a slot, its one token history and its KV cells; while a
request runs on it, it holds that request's job, and only the job knows its kind:

- what it sets while it runs (`begin`, `end`: a sequence's control-vector strength),
- what it wants from a tick (`want`, for the planner: plan.py),
- the grammar its sampled row is masked by (`grammar`: filled during the decode),
- what it does with its share of the decode (`fed`: its logits rows; a row to sample
  is asked of the tick, `Tick.draw`),
- what it does with a token drawn for it (`sampled`: accept it, or end),
- how it ends (`done`: the `done` event of a cancel, a shutdown or its own end),
- the events it sends, through the protocol's constructors.

The scheduler calls only this interface. The rows that the tick's jobs asked for are
sampled in one call (tick_sampling.TickSampler.sample, whichever route each row takes)
and each token goes back to its job.

Fork and load are ways a held sequence starts (no job: nothing to run), not kinds. A
new request kind that runs over ticks is one class here, its protocol dataclass and its
handler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..wire.protocol import done_event, prefilled_event, scored_event, token_event
from ..wire.scoring import score_rows
from ..sampling.usersteps import StepFailed, step_ms
from . import faults, jump
from .plan import Feed, Want
from .text import StopMatcher, Utf8Assembler

if TYPE_CHECKING:
    from ..grammar.grammars import Matcher
    from .patches import JobPatch
    from .readout import JobCapture
    from ..sampling import SampleResult, SequenceSampler
    from ..sampling.fastpath import FastStats
    from .runtime import Runtime
    from .sequences import Sequence, Sequences


@dataclass
class Tick:
    """What a job's `fed` and `sampled` may use after a successful decode, and the rows
    the jobs ask to sample (`draw`)."""

    rt: "Runtime"
    seqs: "Sequences"
    logits: np.ndarray
    now: float
    captured: dict = field(default_factory=dict)  # sequence -> its captured rows or CaptureError (readout.py)
    draws: list = field(default_factory=list)  # (sequence, row, sampler) to sample, in plan order
    preselected: set = field(default_factory=set)  # rows that hold pre-selected values (llama/presample/)
    #: a pre-selected row's whole row, or None where it is not kept (tick_sampling.py sets it)
    whole_row: Any = None

    def row(self, i: int) -> np.ndarray:
        """The whole raw logits row i: `logits[i]`, or for a pre-selected row the copy
        the pre-selection kept (`whole_row`: presample.Presampler.full_row)."""
        if i in self.preselected:
            full = self.whole_row(i)
            if full is None:
                raise RuntimeError("the whole row is needed and this build does not keep pre-selected rows")
            return full
        return self.logits[i]

    def draw(self, seq: "Sequence", row: int, sampler: "SequenceSampler") -> None:
        """Sample a token for `seq` from logits row `row` with its sampler, together with
        the tick's other rows, after every job's `fed` (TickSampler.sample); the result
        comes back through the job's `sampled`."""
        self.draws.append((seq, row, sampler))


@dataclass(eq=False)
class Job:
    kind: ClassVar[str]
    n_prompt: int = 0  # tokens this request feeds (the `done` stats, accounting)
    t_prompt: float | None = None  # when its first prompt chunk went into a batch
    capture: "JobCapture | None" = None  # the activations it reads (readout.py)
    patch: "JobPatch | None" = None  # the activations it writes (patches.py)
    #: a job that samples with a presampler: its FastStats (the paths its tokens took, the K it asks for)
    paths = None
    #: its own `steer` (activations/steering.RequestSteer): in the table from begin to end
    steering: Any = None

    def begin(self, seq: "Sequence") -> None:
        """It starts on the sequence (Sequences.start), before any of its tokens is decoded."""
        if self.steering is not None:
            self.steering.begin(seq.slot, seq.tokens)

    def end(self, seq: "Sequence") -> None:
        """It is over (held, finished, failed or released): undo what `begin` set."""
        if self.steering is not None:
            self.steering.end()

    def want(self, seq: "Sequence") -> Want:
        raise NotImplementedError

    def reads(self, w: Want) -> Want:
        """Its Want with the logits rows its capture and its patch need (readout.JobCapture.widen,
        patches.JobPatch.widen)."""
        w = w if self.patch is None else self.patch.widen(w)
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
        if self.capture is not None:
            self.capture.took(got)
        return True

    def captured(self, seq: "Sequence") -> dict:
        """`capture` for its end event, when it asked (readout.JobCapture.event_field)."""
        if self.capture is None:
            return {}
        f = self.capture.event_field(seq.seq_id)
        out = {} if f is None else {"capture": f}
        if self.capture.lens is not None and self.kind == "score":  # an infer's lens is in its token events
            out["lens"] = self.capture.lens.event_field()
        return out

    def grammar(self) -> "Matcher | None":
        """The grammar whose mask its sampled row takes this tick (the scheduler fills it
        while the decode runs: mask_ahead.py); None: none, or it does not sample."""
        return None

    def drawer(self) -> "SequenceSampler | None":
        """The sampler that draws from the row its feed asks for this tick (None: it
        draws nothing): the scheduler reads it before the decode to pre-select the row."""
        return None

    def feed_tokens(self, seq: "Sequence") -> list[int]:
        """The tokens its feeds are taken from, by position: the sequence's history, and
        for an infer also the forced tokens fed ahead of their events (jump.py)."""
        return seq.tokens

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        """Its plan entry's tokens are in the KV cells now (seq.n_past moved on); a job
        that samples asks for its row here (`tick.draw`)."""
        raise NotImplementedError

    def sampled(self, tick: Tick, seq: "Sequence", row: int, mask: np.ndarray | None,
                res: "SampleResult | StepFailed") -> None:
        """The token drawn from the row it asked for (`tick.draw`) with its grammar's
        mask (None: no grammar), or the StepFailed a user-defined step raised. Only a
        job that draws is called; it must take the result."""
        raise NotImplementedError(f"{type(self).__name__} asked for a row it does not take")

    def overflow(self, seq: "Sequence", n_ctx_seq: int) -> str | None:
        """Why it cannot go on in the context's room, before a tick (None: it can)."""
        return None

    def done(self, seq: "Sequence", reason: str, stop: str | None, now: float) -> dict:
        """The `done` event that ends it (cancelled, shutdown), with what it captured so far."""
        return done_event(seq.seq_id, reason, request=self.kind, **self.captured(seq))


@dataclass(eq=False)
class InferJob(Job):
    """Feed the prompt, then sample a token a tick until the request is over: its token
    step (the drawn token accepted into the history and the grammar, its text assembled
    into valid UTF-8 and sent, the stop strings watched) and the one decision of when
    it is over (`_over`) are its own."""

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
    # the JSON schema the finished output is checked against (grammar/schema_check.py), and
    # the output's text, kept only then
    check: Any = None
    text: list = field(default_factory=list)
    # with init preselect: which path decided each token (sampling/fastpath.py), for `done`
    paths: "FastStats | None" = None
    # the tick of its last token event and the most ticks between two (`done` max_gap_ticks)
    tick_last: int | None = None
    gap_ticks: int = 0
    # jumpForward (jump.py): the grammar's forced tokens ride the next decode as a chunk;
    # `ahead`: those consumed by the matcher and fed (or to be fed) before their events
    jump: bool = False
    jump_rows: bool = False  # the sampler runs on each forced token's row (jump.needs_rows)
    jump_alone: bool = False  # deterministic mode: a forced chunk is decoded alone, as a prompt chunk
    pairs: bool = False  # each sampled token fed beside the one before it (jump.pairs, plan.py)
    ahead: list = field(default_factory=list)
    n_forced: int = 0

    def begin(self, seq: "Sequence") -> None:
        super().begin(seq)
        if self.steer is not None:
            self.steer.set(seq.slot, self.strength)

    def end(self, seq: "Sequence") -> None:
        super().end(seq)
        if self.steer is not None:
            self.steer.reset(seq.slot)

    def want(self, seq: "Sequence") -> Want:
        n = len(seq.tokens)
        if self.generating and self.ahead:  # its last sampled token and the forced ones after it
            n += len(self.ahead)  # rows: those predicting the forced tokens when it needs them, the last
            first = len(seq.tokens) - 1 if self.jump_rows else n - 1
            if self.jump_alone:
                return self.reads(Want(seq, False, seq.n_past, n, first, n - 1, True, seq.kv_wait))
            return self.reads(Want(seq, True, seq.n_past, n, first, n - 1, True))
        if self.generating and self.pairs and seq.n_past > 0:  # with the token before it, fed again (plan.py)
            return self.reads(Want(seq, True, seq.n_past - 1, n, n - 1, n - 1, True, refed=1,
                                   last_tick=-1 if self.tick_last is None else self.tick_last))
        if self.generating:  # its last sampled token, then a row to sample the next
            return self.reads(Want(seq, True, seq.n_past, n, seq.n_past, seq.n_past, True))
        samples = self.max_tokens > 0
        return self.reads(Want(seq, False, seq.n_past, n, n - 1 if samples else n, n - 1, samples, seq.kv_wait))

    def grammar(self) -> "Matcher | None":
        return self.matcher

    def drawer(self) -> "SequenceSampler | None":
        return self.sampler

    def feed_tokens(self, seq: "Sequence") -> list[int]:
        return seq.tokens + [x.token for x in self.ahead] if self.ahead else seq.tokens

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        if self.ahead:
            self._emit_forced(tick, seq, f)
            if seq.job is not self:  # a forced token ended it
                return
        if f.samples:
            if not self.generating:
                self.generating = True
                self.t_first = tick.now
            tick.draw(seq, f.rows[-1], self.sampler)
        elif f.ends:  # maxTokens 0: the prompt is in and nothing is sampled
            self.t_first = tick.now
            self._end_if_over(tick, seq)

    def sampled(self, tick: Tick, seq: "Sequence", row: int, mask: np.ndarray | None,
                res: "SampleResult | StepFailed") -> None:
        """Accept the drawn token, or end with the reason there is none: a user-defined
        step raised, every token the grammar allows would repeat a key of its object
        (stop_reason repeated_key: grammar/json_keys.py), or nothing can be sampled (a ban
        of a token the grammar forces is first retried with the forced token spelled
        shorter)."""
        try:
            if isinstance(res, StepFailed):
                raise res
            if res.empty and mask is not None and self.matcher.keys is not None and self.matcher.keys.exhausted:
                tick.seqs.finish(seq, "repeated_key")
                return
            if res.empty and mask is not None:
                wider = self.matcher.widen_forced(mask)
                if wider is not None:
                    res = self.sampler.sample(tick.row(row), wider)
        except StepFailed as e:  # a user-defined step raised: this sequence ends, the others go on
            tick.seqs.fail(seq, str(e))
            return
        if self.paths is not None:
            self.paths.took(res)
            if res.trace is not None:
                res.trace["path"] = res.path
        if res.empty:
            tick.seqs.fail(seq, f"no token can be sampled: {res.reason}")
            return
        self._accept(tick, seq, int(res.token), res)
        if self.jump and seq.job is self:
            self._jump(tick, seq)

    def _jump(self, tick: Tick, seq: "Sequence") -> None:
        """The tokens the grammar forces after the accepted one (jump.forced_run): consumed
        by the matcher now, fed with it in the next decode, their events sent once the
        rows that predict them are decoded (`_emit_forced`). The run is cut to maxTokens,
        to the context's room and to one batch."""
        rt = tick.rt
        limit = min(self.max_tokens - self.n_predicted, rt.ctx.n_ctx_seq - len(seq.tokens),
                    rt.batch.capacity - 1)
        if limit > 0:
            self.ahead = jump.forced_run(self.matcher, self.sampler.params, limit, rt.model.is_eog,
                                         keep_masks=self.jump_rows)

    def _emit_forced(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        """The forced tokens whose predicting row this decode fed enter the history and
        are sent (`forced`), as their own ticks would have: each takes its draw of the
        random stream, or with `jump_rows` the sampler runs on its row with its mask."""
        while self.ahead and len(seq.tokens) <= seq.n_past:  # its row, at len - 1, was fed
            x = self.ahead.pop(0)
            if self.jump_rows:
                r = f.rows.start + (len(seq.tokens) - 1 - f.row_pos)
                res = self.sampler.sample(tick.row(r), x.mask)
                if res.empty or int(res.token) != x.token:
                    tick.seqs.fail(seq, f"jump-forward: the sampler drew {res.token} where the grammar "
                                        f"forces {x.token} ({res.reason or 'its row'})")
                    return
            else:
                self.sampler.draw()  # the uniform its own tick's sample would have taken
                res = None
            self.n_forced += 1
            self._accept(tick, seq, x.token, res, forced=x)
            if seq.job is not self:
                return

    def _accept(self, tick: Tick, seq: "Sequence", token: int, res: "SampleResult | None",
                forced: "jump.Forced | None" = None) -> None:
        # A sampled token enters the context: the sequence's one history takes it (the
        # sampler reads that list: its penalty window follows at the next draw; the next
        # tick feeds it to the KV cells); the matcher just below. A forced token
        # (jump.py) was consumed by the matcher when its run was found, and fed already.
        rt = tick.rt
        seq.tokens.append(token)
        if self.steering is not None:  # an `after` trigger may start at the next token
            self.steering.seen(seq.tokens)
        if forced is None and rt.model.is_eog(token):
            self._end_if_over(tick, seq, eog=True)
            return
        if self.matcher is not None and forced is None:
            if not self.matcher.consume(token):
                tick.seqs.fail(seq, f"grammar rejected token {token} (matcher: {self.matcher.error()})")
                return
            faults.hit("accept", seq.seq_id, "consumed")  # the tests' hook: the grammar has moved on
        piece = self.utf8.feed(rt.model.token_to_piece(token, special=True))
        if self.check is not None:
            self.text.append(piece)
        logprobs = None
        if self.sampler.params.n_probs and res is not None:
            logprobs = {"logprob": res.logprob, "top": _top(rt, res.top),
                        "steered_logprob": res.steered_logprob, "steered_top": _top(rt, res.steered_top)}
        if res is not None and res.trace is not None:
            logprobs = {**(logprobs or {}), "trace": res.trace}
        ev = token_event(seq.seq_id, token, piece, logprobs, forced=forced is not None)
        if self.capture is not None and self.capture.lens is not None:
            ev["lens"] = self.capture.lens.next_token()  # the row this token was sampled from (lensjob.py)
        tick.seqs.send(seq, ev)
        faults.hit("accept", seq.seq_id, "sent")  # the tests' hook: its token is out
        if self.tick_last is not None:
            self.gap_ticks = max(self.gap_ticks, tick.seqs.ticks - self.tick_last)
        self.tick_last = tick.seqs.ticks
        self.n_predicted += 1
        self._end_if_over(tick, seq, stop=self.stops.feed(piece) if self.stops else None,
                          stopped=forced.stopped if forced is not None else None)

    def _end_if_over(self, tick: Tick, seq: "Sequence", eog: bool = False, stop: str | None = None,
                     stopped: bool | None = None) -> None:
        reason = self._over(eog, stop, stopped)
        if reason is not None:
            tick.seqs.finish(seq, reason, stop=stop if reason == "stop" else None)

    def _over(self, eog: bool, stop: str | None, stopped: bool | None = None) -> str | None:
        """The one place that decides when an infer is over, and why (the `done` event's
        stop_reason); None: it goes on. Asked when its prompt is in and nothing is to be
        sampled (maxTokens 0), and after each drawn token: `eog` (an end-of-generation
        token, not emitted), `stop` (the stop string the emitted text now contains).
        Errors end it where they are met (context full: `overflow`; a rejected or
        unsamplable token: `sampled`, `_accept`); a cancel or shutdown from outside.
        `stopped`: for a forced token, whether the grammar was stopped after it (the
        matcher itself is further on: jump.py)."""
        if self.max_tokens == 0:
            return "max_tokens"
        if eog:
            return "grammar" if self.matcher is not None and self.matcher.is_accepting() else "eos"
        if stop is not None:
            return "stop"
        if stopped if stopped is not None else (self.matcher is not None and self.matcher.is_stopped()):
            return "grammar"
        if self.n_predicted >= self.max_tokens:
            return "max_tokens"
        return None

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
            **self._tail(), **self._steps_ms(), **self.captured(seq), **self._schema(reason), **self._keys(),
            **({"samplingPath": self.paths.as_event()} if self.paths is not None else {}),
            **({"max_gap_ticks": self.gap_ticks} if self.gap_ticks else {}),
            **({"forced_tokens": self.n_forced} if self.jump else {}))

    def _schema(self, reason: str) -> dict:
        """`schemaValid` of a checked output: the validator's verdict on a finished one
        (stop_reason grammar), null on one cut short; `schema_ms`: what checking cost."""
        if self.check is None:
            return {}
        if reason != "grammar":
            return {"schemaValid": None}
        t0 = time.perf_counter()
        out = self.check.check("".join(self.text))
        return {**out, "schema_ms": round((time.perf_counter() - t0) * 1000, 3)}

    def _keys(self) -> dict:
        """`repeatKeyBans`: how many of its tokens were drawn from a mask the repeated-key
        ban narrowed (grammar/json_keys.py), when any were."""
        keys = self.matcher.keys if self.matcher is not None else None
        return {"repeatKeyBans": keys.acted} if keys is not None and keys.acted else {}

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
        tick.seqs.answer(seq, self.kind, ev)


@dataclass(eq=False)
class PrefillJob(Job):
    """Feed the prompt into the cells; the sequence is then held (`prefilled`)."""

    kind: ClassVar[str] = "prefill"

    def want(self, seq: "Sequence") -> Want:
        n = len(seq.tokens)  # no row: a prefill only fills cells
        return self.reads(Want(seq, False, seq.n_past, n, n, n - 1, False, seq.kv_wait))

    def fed(self, tick: Tick, seq: "Sequence", f: Feed) -> None:
        if f.ends:  # the event first: a capture that cannot be written ends it with an error
            ms = (tick.now - self.t_prompt) * 1000 if self.t_prompt else 0.0
            ev = prefilled_event(seq.seq_id, seq.n_past, ms, **self.captured(seq))
            tick.seqs.hold(seq)
            tick.seqs.answer(seq, self.kind, ev)


def _top(rt: "Runtime", pairs) -> list[dict]:
    return [{"token": t, "piece": rt.piece(t), "logprob": lp} for t, lp in pairs]
