"""Sequences, their slots, and how each request ends.

A `Session` is one client's namespace of seq_ids and grammar ids (stdio has exactly
one). A `Sequence` is what one seq_id holds: a slot (llama.cpp's sequence id), its one
token history (`tokens`: the prompt from the moment it arrives, each sampled token from
the moment it is accepted; the first `n_past` of them are in its KV cells), and the job
of the request running on it (jobs.py; none: held). `Sequences` owns the slots and the
active order (the sequences with a job, in arrival order: `start`, `hold`), and every
ending goes through it: `finish` (a `done` event), `fail` (an `error` event) or
`release` (silently), each of which frees the slot and its KV cells at once, so the
seq_id is reusable by the next request.

Every request ends exactly once: the books first (the sequence leaves the active
order), then its one end event (`answer`); when that event cannot be built (a capture
file that cannot be written) or sent, an `error` naming the stage goes in its place.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ..llama import core
from ..wire.protocol import ProtocolError, error_event
from . import faults
from .jobs import Job


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
    deferred: list = field(default_factory=list)  # its (request, Prepared) held until those are done


@dataclass(eq=False)
class Sequence:
    """What one seq_id holds: a slot, its one token history (`tokens`: the prompt from the
    moment it arrives, each sampled token from the moment it is accepted; the first
    `n_past` are in its KV cells; an infer's sampler reads this list, it keeps no copy)
    and, while a request runs on it, that request's job (jobs.py). With no job it is
    held (or loading, while a `load` reads its file)."""

    session: Session
    seq_id: int
    slot: int
    tokens: list[int] = field(default_factory=list)  # its context, in order
    n_past: int = 0  # how many of `tokens` are in its KV cells (fed by a decode)
    job: Job | None = None  # set and cleared only by Sequences (start, hold, release)
    loading: bool = False  # a `load` reads its file: taken, not yet held
    kv_wait: bool = False  # a decode found no KV room for its prompt: retried when cells free up
    # its cells hold what a request's own patch or steering made of them (patches.py,
    # activations/steering.py): never another prompt's prefix; a fork inherits it
    altered: bool = False

    @property
    def held(self) -> bool:
        """Its cells are kept with nothing running on them (after a prefill, a fork, a load;
        an infer's end frees them)."""
        return self.job is None and not self.loading


class Sequences:
    """The slots of one context, the active (not held) sequences in arrival order, and
    every ending."""

    def __init__(self, ctx: core.Context, frozen: Callable[[], bool] = lambda: False) -> None:
        self.ctx = ctx
        self.free_slots = list(range(ctx.n_seq_max - 1, -1, -1))
        self.order: list[Sequence] = []  # active (not held) sequences in arrival order
        self.taken: list[Sequence] = []  # slots taken by the request being handled (give_back)
        self.ticks = 0  # the engine's ticks so far (Engine.tick): a job counts its tokens' gaps in them
        self._frozen = frozen

    @property
    def frozen(self) -> bool:
        """After a lost RPC worker (the engine's `lost`, asked, not copied): the context
        belongs to the engine thread, blocked for good inside llama.cpp, so endings only
        keep the books (no KV calls)."""
        return self._frozen()

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
        seq = Sequence(session=session, seq_id=seq_id, slot=self.free_slots.pop())
        session.seqs[seq_id] = seq
        self.taken.append(seq)
        return seq

    def start(self, seq: Sequence, job: Job) -> None:
        """A request's job starts running on the sequence: it joins the active order."""
        seq.job = job
        self.order.append(seq)
        job.begin(seq)

    def hold(self, seq: Sequence) -> None:
        """Its job is over and its cells are kept (a prefill's end)."""
        self._end_job(seq)
        self.order.remove(seq)

    def _end_job(self, seq: Sequence) -> None:
        job, seq.job = seq.job, None
        if not self.frozen:  # (after a lost worker the context is not ours to call)
            job.end(seq)

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
        """Free the sequence's KV cells and slot at once; its seq_id is reusable now.
        The books come first: should a KV call raise, the sequence is still over."""
        try:
            if not self.frozen:
                self.ctx.seq_rm(seq.slot, -1, -1)
        finally:
            job, seq.job = seq.job, None
            if job is not None:
                self.order.remove(seq)
            if seq.session.seqs.get(seq.seq_id) is seq:
                del seq.session.seqs[seq.seq_id]
            self.free_slots.append(seq.slot)
            for other in self.order:
                other.kv_wait = False
        if job is not None and not self.frozen:
            job.end(seq)
        if len(self.free_slots) == self.ctx.n_seq_max and not self.frozen:
            # Nothing is held or running: start the next requests from the first cells.
            # Otherwise new cells land after the freed ones and every later decode
            # attends over the larger span (measured: 64 sequences ran ~35% slower).
            self.ctx.clear()

    def send(self, seq: Sequence, event: dict) -> None:
        """Send one of the sequence's events (stage `send`: a failure raises StageFailed)."""
        faults.hit("send", seq.seq_id)
        try:
            seq.session.send(event)
        except Exception as e:  # noqa: BLE001 - named for the sequence's error
            raise faults.StageFailed("send", f"send: its event could not be sent: {type(e).__name__}: {e}") from e

    def answer(self, seq: Sequence, kind: str | None, event: "dict | Callable[[], dict]") -> None:
        """Send the one event that ends the sequence's request (or build it first: a
        callable); when it cannot be built or sent, an `error` naming the stage instead."""
        try:
            if callable(event):
                faults.hit("end", seq.seq_id)
                event = event()
            self.send(seq, event)
            return
        except Exception as e:  # noqa: BLE001 - the request must still end
            if not isinstance(e, faults.StageFailed):
                traceback.print_exc(file=sys.stderr)
            message = faults.describe("end", e)
        try:
            seq.session.send(error_event(message, seq.seq_id, kind))
        except Exception:  # noqa: BLE001 - nothing more can reach this client
            traceback.print_exc(file=sys.stderr)

    def finish(self, seq: Sequence, reason: str, stop: str | None = None, notify: bool = True) -> None:
        """End a request with a `done` event (none when not ``notify``)."""
        now = time.perf_counter()
        job = seq.job
        try:
            self.release(seq)
        finally:
            if notify:
                self.answer(seq, job.kind, lambda: job.done(seq, reason, stop, now))

    def fail(self, seq: Sequence, message: str) -> None:
        """End a request with an `error` event."""
        kind = seq.job.kind if seq.job is not None else None
        try:
            self.release(seq)
        finally:
            self.answer(seq, kind, error_event(message, seq.seq_id, kind))

    def finish_all(self, reason: str, notify: bool = True) -> None:
        for seq in list(self.order):
            self.finish(seq, reason, notify=notify)

    def fail_all(self, message: str) -> None:
        """End every active request with an `error` (a tick that cannot go on): each one,
        whatever ending another raises."""
        for seq in list(self.order):
            try:
                self.fail(seq, message)
            except Exception:  # noqa: BLE001 - its error went out (fail's finally); the next
                traceback.print_exc(file=sys.stderr)

    def close_session(self, session: Session) -> None:
        """A client went away: end its sequences silently and free their KV cells."""
        for seq in list(session.seqs.values()):
            if seq.job is None:
                self.release(seq)
            else:
                self.finish(seq, "cancelled", notify=False)
