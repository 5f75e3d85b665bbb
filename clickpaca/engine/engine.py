"""The Engine: owns the runtime and every sequence of every session once `init` succeeded.

It applies `init` itself (it makes the runtime the others work on), routes every other
request to its handler through handlers.HANDLERS (between ticks) and ticks to the
scheduler; it also holds a session's requests while its state files are read or
written, and keeps the books after a lost RPC worker. The package's __init__ lists the
engine's modules.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from functools import partial
from typing import Callable

from . import statedir
from ..wire.protocol import InitRequest, ProtocolError, Request, error_event
from . import accounting
from .handlers import HANDLERS, Handlers
from .prepare import Prepared, SharedUse, prepare, work_for
from .runtime import Runtime
from .scheduler import Scheduler
from .sequences import Sequence, Sequences, Session
from .stateio import StateIO

__all__ = ["Engine", "Session", "Sequence", "report_bug"]


def report_bug(session: Session, req: Request, e: Exception) -> None:
    """A bug met while applying a request costs that request an `error` event (and a
    traceback on stderr), never the server."""
    traceback.print_exc(file=sys.stderr)
    session.send(error_event(f"internal error: {type(e).__name__}: {e}", req.reply_seq_id, req.type))


class Engine:
    """Owns the runtime and every sequence of every session, once `init` succeeded."""

    def __init__(self, state_dir: str | None = None, allow_any_path: bool = False, *,
                 post: Callable[[Callable[[], None]], None] | None = None,
                 on_worker_lost: Callable[[str], None] | None = None,
                 transport_stats: Callable[[], dict] | None = None) -> None:
        """The transport's callbacks: `post` hands work from a worker thread back to the
        engine thread (the inbox; None = in-process use, state-file jobs run in place),
        `on_worker_lost` takes over after a lost RPC worker (server.take_over), and
        `transport_stats` adds the transport's own books to `stats`."""
        self.state_dir_default = state_dir  # --state-dir; init.stateDir overrides it
        self.allow_any_path = allow_any_path
        # Reader threads tokenize with the model (prepare.py), several at once; shutdown
        # closes it only when none is.
        self.model_lock = SharedUse()
        self.rt: Runtime | None = None
        self.seqs: Sequences | None = None
        self.handlers: Handlers | None = None
        self.scheduler: Scheduler | None = None
        self.post = post
        self.io = StateIO(lambda: self.post, self._resume, refuse=lambda: self.lost)
        # A lost RPC worker (rpc/loss.py): the message every request is answered with from
        # then on, and the server's take-over (server.py) that keeps answering.
        self.lost: str | None = None
        self.on_worker_lost = on_worker_lost
        self._current: tuple[Session, Request] | None = None  # the request being handled
        self.ticks = 0  # decodes run so far (`stats`; tests bound waits in ticks, not seconds)
        self.sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # every session that sent a request
        self.transport_stats = transport_stats

    def prepare(self, req: Request) -> Prepared | None:
        """The reader thread's share of the request's work (prepare.py), to hand to
        `handle` beside the request; None: none was done. Never raises."""
        return prepare(req, lambda: self.rt, self.model_lock)

    @property
    def ready_event(self) -> dict | None:
        """The `ready` event of the successful `init` (None before)."""
        return self.rt.ready_event if self.rt is not None else None

    @property
    def states(self) -> statedir.StateDir | None:
        """The state directory of the successful `init` (None before)."""
        return self.rt.states if self.rt is not None else None

    def init(self, session: Session, req: InitRequest) -> None:
        """Apply `init` (the stdio transport's rule; the socket server's at its start):
        open the runtime and answer `ready`, or an `error` naming the field."""
        self.sessions.add(session)
        self._apply(session, req, self._init)

    def handle(self, session: Session, req: Request, prepared: Prepared | None = None) -> None:
        """Apply one typed request (not init or quit: the transport's rules), with the work
        a reader did for it (`prepare`; None: the engine does it); errors become `error`
        events for that session.

        While the session waits for a state file (stateio.py), its requests are held and
        applied in order afterwards, so it sees the answers in the order it asked."""
        self.sessions.add(session)
        if session.io_pending or session.deferred:
            session.deferred.append((req, prepared))
            return
        self._apply(session, req, partial(self._route, prepared=prepared))

    def _route(self, session: Session, req: Request, prepared: Prepared | None) -> None:
        if self.handlers is None:
            raise ProtocolError(f"{req.type} before init: send an init request first",
                                req.reply_seq_id, req.type)
        HANDLERS[req.type](self.handlers, session, req, work_for(req, self.rt, prepared))  # what no reader did

    def _apply(self, session: Session, req: Request, run: Callable[[Session, Request], None]) -> None:
        kind = req.type
        if self.lost is not None:
            session.send(self.lost_error(req))
            return
        if self.seqs is not None:
            self.seqs.taken = []
        self._current = (session, req)
        try:
            run(session, req)
        except ProtocolError as e:
            self._give_back()
            if e.request is None:
                e.request = kind
            session.send(e.event())
        except BaseException:
            self._give_back()
            raise
        finally:
            self._current = None

    def _resume(self, session: Session) -> None:
        """The session's state files are done: apply its held requests, in order, until
        one starts another state-file job."""
        while session.deferred and not session.io_pending:
            req, prepared = session.deferred.pop(0)
            try:
                self._apply(session, req, partial(self._route, prepared=prepared))
            except Exception as e:  # noqa: BLE001 - as the server loop does for a request
                report_bug(session, req, e)

    def _give_back(self) -> None:
        """The request failed: free the slots it took (sequences.py: give_back)."""
        if self.seqs is not None:
            self.seqs.give_back()

    def _init(self, session: Session, req: InitRequest) -> None:
        if self.rt is not None:
            raise ProtocolError("init: the server is already initialised (one init per process)",
                                request="init")
        self.rt = rt = Runtime.open(req, self.state_dir_default, self.allow_any_path,
                                    on_worker_lost=self._worker_lost)
        self.seqs = Sequences(rt.ctx, frozen=lambda: self.lost is not None)
        self.handlers = Handlers(rt, self.seqs, self.io, stats=self.stats)
        self.scheduler = Scheduler(rt, self.seqs)
        session.send(rt.ready_event)

    def has_work(self) -> bool:
        """Sequences to decode: the server loop ticks while this holds (never after a lost
        RPC worker: the engine thread is blocked then)."""
        return self.lost is None and self.seqs is not None and bool(self.seqs.order)

    # ------------------------------------------------------------ a lost RPC worker

    def _worker_lost(self, message: str) -> None:
        """Called on the thread that lost the worker (rpc/loss.py); the server's take-over
        runs there and never returns. Without one, that thread just stays parked."""
        if self.on_worker_lost is not None:
            self.on_worker_lost(message)

    def lost_error(self, req: Request) -> dict:
        return error_event(self.lost_answer(), req.reply_seq_id, req.type)

    def lost_answer(self) -> str:
        """What every request gets after a lost worker."""
        return f"{self.lost}; this server cannot decode any more (start it again with the workers running)"

    def lose(self, message: str) -> None:
        """The engine thread is blocked for good inside llama.cpp (a worker was lost): the
        request it was handling and every running sequence end with an error naming the
        worker, and from now on every request is answered with one. Nothing here calls
        into llama.cpp: its state belongs to the blocked thread."""
        self.lost = message
        answered = None
        if self._current is not None:
            session, req = self._current
            session.send(error_event(message, req.reply_seq_id, req.type))
            answered = (session, req.reply_seq_id)
        if self.seqs is not None:
            for seq in list(self.seqs.order):
                if (seq.session, seq.seq_id) == answered:
                    self.seqs.release(seq)
                else:
                    self.seqs.fail(seq, message)

    def io_pending(self) -> bool:
        """State-file jobs whose answer has not been sent yet: the loop waits for them."""
        return self.io.pending > 0

    def tick(self) -> None:
        assert self.scheduler is not None
        self.ticks += 1
        self.seqs.ticks = self.ticks
        self.scheduler.tick()

    def stats(self, session: Session) -> dict:
        """The `stats` answer (accounting.py)."""
        assert self.rt is not None
        extra = self.transport_stats() if self.transport_stats is not None else None
        return accounting.stats(self.rt, list(self.sessions), session, self.ticks, extra)

    def finish_all(self, reason: str) -> None:
        """End every active sequence with `done` (`quit` with `now`: reason "shutdown")."""
        if self.seqs is not None:
            self.seqs.finish_all(reason)

    def fail_all(self, message: str) -> None:
        """End every active sequence with an `error` (a tick raised: a bug, not a request)."""
        if self.seqs is not None:
            self.seqs.fail_all(message)

    def close_session(self, session: Session) -> None:
        """A client went away: cancel its sequences, free their KV, forget its grammars
        and its private state files."""
        if self.seqs is not None:  # (after a lost worker: the books only, seqs.frozen)
            self.seqs.close_session(session)
        session.deferred.clear()
        session.grammars.clear()
        session.grammar_bytes = 0
        if self.rt is not None and getattr(self.rt, "steering", None) is not None:
            self.rt.steering.close(session)  # its vectors; one a running request uses stays to its end
        self.sessions.discard(session)
        if self.states is not None:
            self.states.drop_namespace(session.namespace)

    def shutdown(self) -> None:
        if self.lost is not None:
            return  # the model is in use by the blocked thread: the process exit frees it
        if self.seqs is not None:
            self.seqs.finish_all("shutdown", notify=False)
        self.io.close()  # a save in progress completes its rename
        with self.model_lock.exclusive():  # not while a reader thread tokenizes (prepare.py)
            if self.rt is not None:
                self.rt.close()
            self.rt = self.seqs = self.handlers = self.scheduler = None
