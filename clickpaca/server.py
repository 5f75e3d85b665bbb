"""The NDJSON server over stdin/stdout.

A reader thread turns lines into typed requests (or error events) and queues
them; the main thread applies queued requests between ticks and runs the engine.
The main thread is the only writer, so events come out in the order they happen.
End of input and `quit` are graceful: running sequences finish, then the process
exits; `{"type": "quit", "now": true}` cancels them instead.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import BinaryIO, Iterator

from .protocol import MAX_LINE_BYTES, ProtocolError, Request, encode, error_event, parse_line
from .engine import Engine, Session
from .prepare import prepare

EOF = object()


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


def reader(stream: BinaryIO, inbox: queue.Queue, session: Session, engine: Engine | None = None) -> None:
    try:
        for line in read_lines(stream):
            req = parse_or_error(line)
            if engine is not None and isinstance(req, Request):
                req = prepare(engine, req)  # slow pure work here, not on the engine thread
            inbox.put((session, req))
    finally:
        inbox.put((session, EOF))


def run_loop(engine: Engine, inbox: queue.Queue, flush, sessions_open: int = 1) -> None:
    """Apply requests between ticks until every input has ended and no work is left."""
    open_inputs = sessions_open
    quitting = False
    engine.post = lambda fn: inbox.put((None, fn))  # state-file completions (engine/stateio.py)

    def apply(item) -> None:
        nonlocal open_inputs, quitting
        session, req = item
        if req is EOF:
            open_inputs -= 1
            return
        if isinstance(req, ProtocolError):
            session.send(req.event())
            return
        if callable(req):  # a transport's own action (e.g. a socket client went away)
            req()
            return
        if quitting and req.type != "quit":
            session.send(error_event("the server is shutting down", req.reply_seq_id, req.type))
            return
        if req.type == "quit":
            quitting = True
        try:
            engine.handle(session, req)
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            traceback.print_exc(file=sys.stderr)
            session.send(error_event(f"internal error: {type(e).__name__}: {e}",
                                     req.reply_seq_id, req.type))

    while True:
        if not engine.has_work() and ((open_inputs > 0 and not quitting) or engine.io_pending()):
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
        if ((open_inputs <= 0 or quitting) and not engine.has_work() and not engine.io_pending()
                and inbox.empty()):
            return


def serve_stdio(stdin: BinaryIO | None = None, stdout: BinaryIO | None = None,
                state_dir: str | None = None, allow_any_path: bool = False) -> int:
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    # Nothing but protocol lines may reach stdout: move stray prints to stderr.
    sys.stdout = sys.stderr
    writer = Writer(stdout)
    session = Session(send=writer.send)
    inbox: queue.Queue = queue.Queue()
    engine = Engine(state_dir=state_dir, allow_any_path=allow_any_path)
    t = threading.Thread(target=reader, args=(stdin, inbox, session, engine), daemon=True, name="reader")
    t.start()
    try:
        run_loop(engine, inbox, writer.flush)
    finally:
        writer.flush()
        engine.shutdown()
    return 0
