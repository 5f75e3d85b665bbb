"""The NDJSON server over stdin/stdout, and the transport loop both servers share.

A reader thread per input (`read_requests`) turns lines into typed requests (or error
events) with their work prepared beside them (engine/prepare.py), and puts them in the
inbox as typed items (Arrived, Ended, Call); the engine thread (`run_loop`) applies
them between ticks and runs the engine, and is the only writer, so events come out in
the order they happen.
A transport gives only its rules (`Rules`): what `init` and `quit` do and what the end
of one input means. Here (`StdioRules`): init opens the engine; end of input and `quit`
are graceful, running sequences finish, then the process exits; `{"type": "quit",
"now": true}` cancels them instead. The socket server's rules are in socket_server.py.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator

from ..wire.protocol import (MAX_LINE_BYTES, InitRequest, ProtocolError, QuitRequest, Request, encode,
                             error_event, parse_line)
from ..engine.engine import Engine, Session, report_bug
from ..engine.prepare import Prepared


@dataclass(frozen=True)
class Arrived:
    """A line of one input: its typed request and the work its reader did for it (None:
    none, the engine does it), or the error to answer it with."""

    session: Session
    req: Request | ProtocolError
    prepared: Prepared | None = None


@dataclass(frozen=True)
class Ended:
    """One input ended (end of stream, a socket client gone, a stop signal)."""

    session: Session


@dataclass(frozen=True)
class Call:
    """Work handed to the engine thread: a state-file completion (Engine `post`), an
    init applied (the reader waits for it), a transport's own action."""

    fn: Callable[[], None]


InboxItem = Arrived | Ended | Call


def read_lines(stream: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[bytes | ProtocolError]:
    """Lines without their newline; a line over the limit is skipped and reported."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # discard the rest of the over-long line
                rest = stream.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield ProtocolError(f"line too long (limit {limit} bytes); the line was skipped")
            continue
        line = line.rstrip(b"\r\n")
        if line.strip():
            yield line


class Writer:
    """Buffers events and writes them at the end of each loop turn."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.buf: list[bytes] = []
        self.broken = False

    def send(self, event: dict) -> None:
        try:
            self.buf.append(encode(event))
        except (TypeError, ValueError) as e:  # never let one unencodable event end the server
            self.buf.append(encode(error_event(f"internal error: event not encodable: {e}",
                                               -1, event.get("type"))))

    def flush(self) -> None:
        if not self.buf or self.broken:
            self.buf.clear()
            return
        data, self.buf = b"".join(self.buf), []
        try:
            self.out.write(data)
            self.out.flush()
        except (BrokenPipeError, OSError):
            self.broken = True


def parse_or_error(line: bytes | ProtocolError) -> Request | ProtocolError:
    """A request or the error to answer; never raises, so no line can end a reader thread."""
    if isinstance(line, ProtocolError):
        return line
    try:
        return parse_line(line)
    except ProtocolError as e:
        return e
    except Exception as e:  # noqa: BLE001 - a bug in parsing must cost one line, not the reader
        traceback.print_exc(file=sys.stderr)
        return ProtocolError(f"internal error: request not parsed ({type(e).__name__})")


def read_requests(stream: BinaryIO, inbox: queue.Queue, session: Session, engine: Engine,
                  quit_ends_input: bool) -> None:
    """Lines -> typed requests and their work (prepared: slow pure work here, not on the
    engine thread) -> the inbox, then Ended. After an `init` it waits until the engine
    thread has applied it before preparing the next request: a prompt read meanwhile
    would otherwise reach the engine thread untokenized. `quit_ends_input`: stop reading at a quit."""
    try:
        for line in read_lines(stream):
            req = parse_or_error(line)
            prepared = engine.prepare(req) if isinstance(req, Request) else None
            inbox.put(Arrived(session, req, prepared))
            if isinstance(req, InitRequest):
                applied = threading.Event()
                inbox.put(Call(applied.set))
                applied.wait()
            elif isinstance(req, QuitRequest) and quit_ends_input:
                return
    finally:
        inbox.put(Ended(session))


@dataclass
class LoopState:
    """What the request loop knows across turns; kept outside it so that a take-over
    after a lost RPC worker (`take_over`) goes on where the blocked loop stopped."""

    open_inputs: int = 1
    quitting: bool = False
    thread: int = field(default_factory=threading.get_ident)  # the engine thread


class Rules:
    """A transport's rules, applied on the engine thread: what `init` and `quit` do and
    what the end of one input means. These are stdio's: one input, one session."""

    quit_ends_input = False  # stdio answers requests after a quit ("shutting down")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def init(self, st: LoopState, session: Session, req: InitRequest) -> None:
        self.engine.init(session, req)

    def quit(self, st: LoopState, session: Session, req: QuitRequest) -> None:
        st.quitting = True
        if req.now:
            self.engine.finish_all("shutdown")

    def ended(self, st: LoopState, session: Session) -> None:
        st.open_inputs -= 1


def run_loop(engine: Engine, inbox: queue.Queue, flush, rules: Rules, state: LoopState) -> None:
    """Apply inbox items between ticks until every input has ended and no work is left."""
    st = state
    st.thread = threading.get_ident()

    def apply(item: InboxItem) -> None:
        if isinstance(item, Call):
            item.fn()
            return
        if isinstance(item, Ended):
            rules.ended(st, item.session)
            return
        session, req = item.session, item.req
        if isinstance(req, ProtocolError):
            session.send(req.event())
            return
        if isinstance(req, QuitRequest):
            rules.quit(st, session, req)
            return
        if st.quitting:
            session.send(error_event("the server is shutting down", req.reply_seq_id, req.type))
            return
        try:
            if isinstance(req, InitRequest):
                rules.init(st, session, req)
            else:
                engine.handle(session, req, item.prepared)
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            report_bug(session, req, e)

    while True:
        if not engine.has_work() and ((st.open_inputs > 0 and not st.quitting) or engine.io_pending()):
            apply(inbox.get())
        while True:
            try:
                apply(inbox.get_nowait())
            except queue.Empty:
                break
        if engine.has_work():
            try:
                engine.tick()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                engine.fail_all(f"internal error during a tick: {type(e).__name__}: {e}")
        flush()
        if ((st.open_inputs <= 0 or st.quitting) and not engine.has_work() and not engine.io_pending()
                and inbox.empty()):
            return


# Exit status of a server that lost an RPC worker and then reached the end of its input.
EXIT_WORKER_LOST = 3


def wait_until_blocked(thread_id: int, settle: float = 0.3) -> None:
    """Until the thread sits still in one place (blocked in a native call: the engine
    thread waiting on a lost worker) for `settle` seconds. The abort can come a moment
    before that thread reaches its wait; taking over its state earlier would race it."""
    if thread_id == threading.get_ident():
        return
    last, since = None, time.monotonic()
    while time.monotonic() - since < settle:
        frame = sys._current_frames().get(thread_id)
        where = (frame.f_code, frame.f_lasti) if frame is not None else None
        if where != last:
            last, since = where, time.monotonic()
        time.sleep(0.02)


class SignalPipe:
    """SIGINT and SIGTERM for a process whose main thread may be blocked for good.

    Python runs signal handlers on the main thread only; after a lost RPC worker that
    thread sits inside llama_decode and never will. Python's C-level handler still
    writes each signal's number to the wakeup fd set here (on the main thread, at
    start), and `watch` reads them on a thread of its own."""

    def __init__(self) -> None:
        self.r: socket.socket | None = None
        try:
            r, w = socket.socketpair()
            w.setblocking(False)
            signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
            self.r, self._w = r, w
        except (ValueError, OSError):  # not the main thread (an in-process server): no pipe
            pass

    def watch(self, on_stop: Callable[[], None]) -> None:
        """Call on_stop at every SIGINT or SIGTERM from now on (also one already waiting)."""
        if self.r is None:
            return
        stops = {int(signal.SIGINT), int(signal.SIGTERM)}

        def loop() -> None:
            while True:
                data = self.r.recv(64)
                if not data:
                    return
                if stops & set(data):
                    on_stop()

        threading.Thread(target=loop, daemon=True, name="signals").start()


def take_over(engine: Engine, inbox: queue.Queue, flush: Callable[[], None], rules: Rules, state: LoopState,
              message: str, finish: Callable[[], None] | None = None,
              signals: SignalPipe | None = None, stop: Callable[[], None] | None = None) -> None:
    """After a lost RPC worker, on the thread that lost it (rpc/loss.py): the engine
    thread is blocked for good, so this thread ends what was running with errors naming
    the worker, then answers every request until the input ends (quit, end of input,
    SIGINT/SIGTERM through `signals`, which call `stop`), and ends the process. Never
    returns."""
    try:
        wait_until_blocked(state.thread)
        engine.lose(message)
        flush()
        if signals is not None and stop is not None:
            signals.watch(stop)
        run_loop(engine, inbox, flush, rules, state)
        flush()
        if finish is not None:
            finish()
    except BaseException:  # noqa: BLE001 - the process must still end
        traceback.print_exc(file=sys.stderr)
    finally:
        sys.stderr.flush()
        os._exit(EXIT_WORKER_LOST)


def own_stdin() -> BinaryIO:
    """A reader of fd 0 that is not sys.stdin. At `quit` the reader thread (a daemon) is
    still blocked in readline holding its stream's lock; the interpreter's exit closes
    sys.stdin and aborts ("could not acquire lock ... at interpreter shutdown") if that
    stream is the one locked. A private stream on a copy of the fd is never closed at
    exit: the blocked thread still refers to it."""
    try:
        return open(os.dup(sys.stdin.fileno()), "rb")
    except (AttributeError, OSError, ValueError):  # no real fd 0 (an embedding): the old way
        return sys.stdin.buffer


def serve_stdio(stdin: BinaryIO | None = None, stdout: BinaryIO | None = None,
                state_dir: str | None = None, allow_any_path: bool = False) -> int:
    stdin = stdin or own_stdin()
    stdout = stdout or sys.stdout.buffer
    # Nothing but protocol lines may reach stdout: move stray prints to stderr.
    sys.stdout = sys.stderr
    writer = Writer(stdout)
    session = Session(send=writer.send)
    inbox: queue.Queue = queue.Queue()
    state = LoopState(open_inputs=1)
    signals = SignalPipe()
    engine = Engine(state_dir=state_dir, allow_any_path=allow_any_path, post=lambda fn: inbox.put(Call(fn)),
                    on_worker_lost=lambda message: take_over(
                        engine, inbox, writer.flush, rules, state, message, signals=signals,
                        stop=lambda: inbox.put(Ended(session))))
    rules = Rules(engine)
    t = threading.Thread(target=read_requests, args=(stdin, inbox, session, engine, rules.quit_ends_input),
                         daemon=True, name="reader")
    t.start()
    try:
        run_loop(engine, inbox, writer.flush, rules, state)
    finally:
        writer.flush()
        engine.shutdown()
    return 0
