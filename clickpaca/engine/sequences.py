"""Sequences, their slots, and how each request ends.

A `Session` is one client's namespace of seq_ids and grammar ids (stdio has exactly
one). A `Sequence` is what one seq_id holds: a slot (llama.cpp's sequence id), its one
token history (`tokens`: the prompt from the moment it arrives, each sampled token from
the moment it is accepted; the first `n_past` of them are in its KV cells), and what it
is doing (kind infer, score or prefill; state prompt -> generate, or held). `Sequences` owns the slots and the active order, and every
ending goes through it: `finish` (a `done` event), `fail` (an `error` event) or
`release` (silently), each of which frees the slot and its KV cells at once, so the
seq_id is reusable by the next request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import core
from ..protocol import ProtocolError, done_event, error_event
from ..sampling import SequenceSampler
from ..text import StopMatcher, Utf8Assembler
from ..usersteps import step_ms


@dataclass(eq=False)
class Session:
    """One client's namespace of seq_ids and grammar ids (stdio has exactly one)."""

    send: Callable[[dict], None]
    name: str = "stdio"
    seqs: dict[int, "Sequence"] = field(default_factory=dict)
    grammars: dict[str, Any] = field(default_factory=dict)
    grammar_bytes: int = 0  # their texts together (accounting.py: the per-session bound)
    max_seqs: int | None = None  # slots this client may hold at once (socket: --max-seqs-per-client)
    namespace: str | None = None  # its private state-file namespace (statedir.py); None = the root
    io_pending: int = 0  # its state-file jobs in flight (stateio.py)
    deferred: list = field(default_factory=list)  # its requests held until those are done


@dataclass(eq=False)
class Sequence:
    session: Session
    seq_id: int
    slot: int
    kind: str  # "infer" | "score" | "prefill"
    state: str = "prompt"  # "prompt" -> "generate" | "held"; "loading" -> "held" (load)
    tokens: list[int] = field(default_factory=list)  # its context, in order
    n_past: int = 0  # how many of `tokens` are in its KV cells (fed by a decode)
    sampler: SequenceSampler | None = None
    matcher: Any = None
    stops: StopMatcher | None = None
    utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    max_tokens: int = 0
    n_predicted: int = 0
    n_prompt: int = 0
    n_reused: int = 0
    t_arrival: float = 0.0
    t_prompt: float | None = None
    t_first: float | None = None
    kv_wait: bool = False
    # scoring
    windows: list = field(default_factory=list)
    window: int = 0
    nll: list = field(default_factory=list)
    per_token: bool = False

    def append(self, token: int) -> None:
        """A sampled token enters the context: the history and the sampler's penalty
        window take it at the same moment (the next tick feeds it to the KV cells)."""
        self.tokens.append(token)
        self.sampler.accept(token)


def done(seq: Sequence, reason: str, stop: str | None, now: float) -> dict:
    """The `done` event that ends a request, with the sequence's timings."""
    if seq.kind in ("score", "prefill") and reason in ("cancelled", "shutdown"):
        return done_event(seq.seq_id, reason, request=seq.kind)
    t_prompt_end = seq.t_first or now
    prompt_s = (t_prompt_end - seq.t_prompt) if seq.t_prompt else 0.0
    eval_s = (now - seq.t_first) if seq.t_first else 0.0
    return done_event(
        seq.seq_id, reason, stop, tokens_prompt=seq.n_prompt, tokens_reused=seq.n_reused,
        tokens_predicted=seq.n_predicted, prompt_ms=round(prompt_s * 1000, 3),
        eval_ms=round(eval_s * 1000, 3),
        prompt_tps=round(seq.n_prompt / prompt_s, 2) if prompt_s > 0 else None,
        # the first token comes from the prompt's logits: n tokens take n - 1 decodes
        eval_tps=round((seq.n_predicted - 1) / eval_s, 2) if eval_s > 0 and seq.n_predicted > 1 else None,
        **_tail(seq), **_steps_ms(seq))


def _tail(seq: Sequence) -> dict:
    """`tail`: the bytes of a character the last tokens began but never completed (the
    request ended first: maxTokens, a stop, a cancel), which no token event carried."""
    held = seq.utf8.pending
    seq.utf8.flush()
    return {"tail": held.decode("utf-8", "replace"), "tail_bytes": list(held)} if held else {}


def _steps_ms(seq: Sequence) -> dict:
    """`steps_ms`: the CPU time of the user-defined steps this request ran, when any did."""
    ms = step_ms(seq.sampler.states) if seq.sampler is not None else None
    return {"steps_ms": ms} if ms else {}


class Sequences:
    """The slots of one context, the active (not held) sequences in arrival order, and
    every ending."""

    def __init__(self, ctx: core.Context) -> None:
        self.ctx = ctx
        self.free_slots = list(range(ctx.n_seq_max - 1, -1, -1))
        self.order: list[Sequence] = []  # active (not held) sequences in arrival order
        self.taken: list[Sequence] = []  # slots taken by the request being handled (give_back)
        # Set after a lost RPC worker: the context belongs to the engine thread, blocked for
        # good inside llama.cpp, so endings only keep the books (no KV calls).
        self.frozen = False

    def check_id(self, seq_id: int, kind: str, field_: str = "seq_id") -> None:
        if not 0 <= seq_id < self.ctx.n_seq_max:
            raise ProtocolError(f"{field_}: must be in 0..{self.ctx.n_seq_max - 1} (nSeqMax), "
                                f"got {seq_id}", seq_id, kind)

    def new(self, session: Session, seq_id: int, kind: str) -> Sequence:
        if not self.free_slots:
            raise ProtocolError(f"seq_id: no free sequence slot (all {self.ctx.n_seq_max} in use)",
                                seq_id, kind)
        if session.max_seqs is not None and len(session.seqs) >= session.max_seqs:
            raise ProtocolError(f"seq_id: this client holds {len(session.seqs)} sequences, its share "
                                f"(--max-seqs-per-client {session.max_seqs})", seq_id, kind)
        seq = Sequence(session=session, seq_id=seq_id, slot=self.free_slots.pop(), kind=kind,
                       t_arrival=time.perf_counter())
        session.seqs[seq_id] = seq
        self.taken.append(seq)
        return seq

    def give_back(self) -> None:
        """A request failed: release the slots it took that are still its own (no leak).

        Engine._apply clears `taken` before each request and calls this when one raises,
        so a handler that fails after `new` never needs its own cleanup."""
        taken, self.taken = self.taken, []
        for seq in taken:
            if seq.session.seqs.get(seq.seq_id) is seq:
                self.release(seq)

    # ------------------------------------------------------------ endings

    def release(self, seq: Sequence) -> None:
        """Free the sequence's KV cells and slot at once; its seq_id is reusable now."""
        if not self.frozen:
            self.ctx.seq_rm(seq.slot, -1, -1)
        if seq in self.order:
            self.order.remove(seq)
        if seq.session.seqs.get(seq.seq_id) is seq:
            del seq.session.seqs[seq.seq_id]
        self.free_slots.append(seq.slot)
        for other in self.order:
            other.kv_wait = False
        if len(self.free_slots) == self.ctx.n_seq_max and not self.frozen:
            # Nothing is held or running: start the next requests from the first cells.
            # Otherwise new cells land after the freed ones and every later decode
            # attends over the larger span (measured: 64 sequences ran ~35% slower).
            self.ctx.clear()

    def finish(self, seq: Sequence, reason: str, stop: str | None = None, notify: bool = True) -> None:
        """End a request with a `done` event (none when not ``notify``)."""
        now = time.perf_counter()
        self.release(seq)
        if notify:
            seq.session.send(done(seq, reason, stop, now))

    def fail(self, seq: Sequence, message: str) -> None:
        """End a request with an `error` event."""
        self.release(seq)
        seq.session.send(error_event(message, seq.seq_id, seq.kind))

    def finish_all(self, reason: str, notify: bool = True) -> None:
        for seq in list(self.order):
            self.finish(seq, reason, notify=notify)

    def fail_all(self, message: str) -> None:
        for seq in list(self.order):
            self.fail(seq, message)

    def close_session(self, session: Session) -> None:
        """A client went away: end its sequences silently and free their KV cells."""
        for seq in list(session.seqs.values()):
            if seq.state in ("held", "loading"):
                self.release(seq)
            else:
                self.finish(seq, "cancelled", notify=False)
