"""The same NDJSON protocol over a Unix socket: many clients, one model, one batch.

The server is initialised at start from the command line (`--model`, `--init JSON`),
so every client shares one model and one scheduler; all their sequences go into the
same llama_decode. A client's own `init` is answered with the running server's `ready`
event when the fields it gives match the running configuration, and with an error
naming the fields that differ otherwise.

Each client has its own namespace of seq_ids and grammar ids (a Session): it cannot
see, cancel or read another client's sequences. A client that disconnects has its
sequences cancelled and their KV cells freed at once. Events to a client go through a
bounded queue (`--queue`, default 4096 events) drained by that client's writer thread,
so a slow reader never stalls the batch: when its queue is full the server drops that
client (closes its connection and cancels its sequences) and everyone else goes on.

The socket file is created with mode 0600 and removed on exit; a stale file left by a
crashed server (nobody accepts on it) is replaced, a live one is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import signal
import socket
import stat
import sys
import threading
import traceback
from pathlib import Path

import orjson

from ..engine.engine import Engine, Session
from ..wire.protocol import InitRequest, ProtocolError, QuitRequest, encode, error_event, validate
from .server import Call, Ended, LoopState, Rules, SignalPipe, read_requests, run_loop, take_over


class ClientConn:
    """One connected client: its session, reader thread, bounded event queue, writer."""

    def __init__(self, server: "SocketServer", sock: socket.socket, n: int) -> None:
        self.server = server
        self.sock = sock
        self.name = f"client-{n}"
        self.events: queue.Queue = queue.Queue(maxsize=server.queue_size)
        self.session = Session(send=self.send, name=self.name, max_seqs=server.max_seqs_per_client,
                               namespace=server.engine.states.new_client_namespace(n)
                               if server.engine.states is not None else None)
        self.gone = threading.Event()
        self.pending: list[bytes] = []

    def send(self, event: dict) -> None:
        """Called by the engine thread: buffer now, hand over at flush."""
        if not self.gone.is_set():
            self.pending.append(encode(event))

    def flush(self) -> None:
        """Hand the turn's events to the writer, one queue entry per event (--queue counts events)."""
        pending, self.pending = self.pending, []
        for data in pending:
            try:
                self.events.put_nowait(data)
            except queue.Full:
                self.drop(f"event queue full ({self.events.maxsize} events; the client reads too slowly)")
                return

    def drop(self, why: str) -> None:
        if not self.gone.is_set():
            log(f"dropping {self.name}: {why}")
            self.gone.set()
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def writer(self) -> None:
        while not self.gone.is_set():
            try:
                chunks = [self.events.get(timeout=0.5)]
            except queue.Empty:
                continue
            while len(chunks) < 256:  # write what is queued in one call
                try:
                    chunks.append(self.events.get_nowait())
                except queue.Empty:
                    break
            data = b"".join(chunks)
            try:
                self.sock.sendall(data)
            except OSError:
                self.drop("connection lost")

    def reader(self) -> None:
        """This client's lines into the shared inbox (server.read_requests), up to its quit."""
        try:
            with self.sock.makefile("rb") as f:
                read_requests(f, self.server.inbox, self.session, self.server.engine, quit_ends_input=True)
        except OSError:
            pass
        except Exception:  # noqa: BLE001 - a bug ends this connection only, and is logged
            traceback.print_exc(file=sys.stderr)


class SocketRules(Rules):
    """The shared server's rules: its init was applied at start, so a client's `init` is
    compared with it; a client's `quit` ends that client's input (its connection), and
    the end of a client's input frees what it held. The admin session's end (a signal)
    stops the server."""

    quit_ends_input = True

    def __init__(self, server: "SocketServer") -> None:
        super().__init__(server.engine)
        self.server = server

    def init(self, st: LoopState, session: Session, req: InitRequest) -> None:
        conn = self.server.conns.get(session)
        if conn is not None:
            self.server.answer_init(conn, req)

    def quit(self, st: LoopState, session: Session, req: QuitRequest) -> None:
        pass  # its reader stopped at the quit: the Ended that follows closes the connection

    def ended(self, st: LoopState, session: Session) -> None:
        conn = self.server.conns.get(session)
        if conn is None:  # the admin session: SIGINT / SIGTERM
            st.open_inputs -= 1
            return
        conn.gone.set()
        self.server.client_gone(conn)


class SocketServer:
    def __init__(self, path: Path, init: InitRequest, queue_size: int, max_seqs_per_client: int | None = None,
                 state_dir: str | None = None) -> None:
        self.path = path
        self.init_request = init
        self.queue_size = queue_size
        self.max_seqs_per_client = max_seqs_per_client
        self.inbox: queue.Queue = queue.Queue()
        self.state = LoopState(open_inputs=1)
        self.signals = SignalPipe()
        self.signals_watched = False
        self.engine = Engine(state_dir=state_dir, post=lambda fn: self.inbox.put(Call(fn)),
                             on_worker_lost=self._lost, transport_stats=self.stats)
        self.rules = SocketRules(self)
        self.clients: list[ClientConn] = []
        self.conns: dict[Session, ClientConn] = {}  # (engine thread and accept thread: under lock)
        self.lock = threading.Lock()
        self.admin = Session(send=self._admin_event, name="admin")
        self.listener: socket.socket | None = None
        self.init_error: str | None = None

    def _admin_event(self, ev: dict) -> None:
        sys.stderr.write(orjson.dumps(ev).decode() + "\n")
        if ev.get("type") == "error":
            self.init_error = ev.get("message")

    def answer_init(self, conn: ClientConn, req: InitRequest) -> None:
        if self.engine.lost is not None:
            conn.session.send(error_event(self.engine.lost_answer(), -1, "init"))
            return
        running = self.engine.ready_event or {}
        differ = init_differences(req, self.init_request, running)
        if differ:
            conn.session.send(error_event("init: this shared server was initialised at start; "
                                          "these fields differ: " + ", ".join(differ), -1, "init"))
        else:
            conn.session.send(running)

    def stats(self) -> dict:
        """The socket's own part of `stats`: clients, and the events queued for them."""
        with self.lock:
            clients = list(self.clients)
        return {"clients": len(clients),
                "eventQueues": {"events": sum(c.events.qsize() for c in clients),
                                "maxEventsEach": self.queue_size}}

    def client_gone(self, conn: ClientConn) -> None:
        self.engine.close_session(conn.session)
        with self.lock:
            if conn in self.clients:
                self.clients.remove(conn)
            self.conns.pop(conn.session, None)
        try:
            conn.sock.close()
        except OSError:
            pass

    def flush(self) -> None:
        with self.lock:
            clients = list(self.clients)
        for c in clients:
            c.flush()

    def bind(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise SystemExit(f"clickpaca: {self.path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
                raise SystemExit(f"clickpaca: another server is listening on {self.path}")
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink()  # stale: left by a server that died
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(64)
        self.listener = s

    def accept_loop(self) -> None:
        n = 0
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            n += 1
            conn = ClientConn(self, sock, n)
            with self.lock:
                self.clients.append(conn)
                self.conns[conn.session] = conn
            threading.Thread(target=conn.writer, daemon=True, name=f"{conn.name}-w").start()
            threading.Thread(target=conn.reader, daemon=True, name=f"{conn.name}-r").start()

    def cleanup(self) -> None:
        if self.listener is not None:
            self.listener.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _lost(self, message: str) -> None:
        """A lost RPC worker (Engine on_worker_lost), on the thread that lost it."""
        if self.listener is None:  # during the start's init: nobody to answer, just end
            print(f"clickpaca: init failed: {message}", file=sys.stderr, flush=True)
            os._exit(1)
        take_over(self.engine, self.inbox, self.flush, self.rules, self.state, message, finish=self.cleanup,
                  signals=None if self.signals_watched else self.signals,
                  stop=lambda: self.inbox.put(Ended(self.admin)))

    def run(self) -> int:
        self.engine.init(self.admin, self.init_request)
        if self.engine.ready_event is None:
            print(f"clickpaca: init failed: {self.init_error}", file=sys.stderr)
            return 1
        self.bind()
        print(f"clickpaca: serving on {self.path}", file=sys.stderr, flush=True)

        def stop(*_):
            self.inbox.put(Ended(self.admin))

        if self.signals.r is not None:
            # The stop is queued from the signal pipe's own thread, never from a Python
            # signal handler: a handler runs on the main thread between two bytecodes, where
            # the engine loop may hold the inbox's lock (inside inbox.get), and its put would
            # wait for that lock forever (seen: a server that never ended after SIGTERM).
            # The handlers do nothing; the C-level handler writes the pipe.
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.signal(signal.SIGINT, lambda *_: None)
            self.signals.watch(stop)
            self.signals_watched = True
        else:  # no pipe (not the main thread): the handlers must queue it
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
        threading.Thread(target=self.accept_loop, daemon=True, name="accept").start()
        try:
            run_loop(self.engine, self.inbox, self.flush, self.rules, self.state)
        finally:
            self.cleanup()
            self.engine.shutdown()
        return 0


#: Fields whose value the runtime resolves (a default model, build, state directory,
#: thread count, or the backend's pre-selection row): a client may name the resolved value
#: as well as the one given at start.
RESOLVED = {"modelPath": lambda ready: ready["model"]["path"], "build": lambda ready: ready["build"],
            "stateDir": lambda ready: ready["stateDir"], "nThreads": lambda ready: ready["nThreads"],
            "preselect": lambda ready: ready["preselect"], "nUbatch": lambda ready: ready["nUbatch"]}


def init_differences(asked: InitRequest, running: InitRequest, ready: dict) -> list[str]:
    """Every field the client's `init` gave (InitRequest.given) that differs from what the
    shared server runs, as `name=asked (running: value)`, in declaration order."""
    differ = []
    for f in dataclasses.fields(InitRequest):
        if f.name not in asked.given:
            continue
        want, have = getattr(asked, f.name), getattr(running, f.name)
        if want == have:
            continue
        resolved = RESOLVED[f.name](ready) if f.name in RESOLVED and ready else have
        if want is not None and want == resolved:
            continue
        differ.append(f"{f.name}={_wire(want)} (running: {_wire(resolved)})")
    return differ


def _wire(v) -> str:
    try:
        return orjson.dumps(list(v) if isinstance(v, tuple) else v).decode()
    except TypeError:  # controlVector's directions as data (layer, bytes): not their numbers
        return f"({len(v)} directions as data)"


def log(message: str) -> None:
    """One stderr line in one write: print's separate write of the newline let two
    threads' messages share a line."""
    sys.stderr.write(f"clickpaca: {message}\n")
    sys.stderr.flush()


def serve_socket(args: argparse.Namespace) -> int:
    try:
        init = orjson.loads(args.init) if args.init else {}
    except orjson.JSONDecodeError as e:
        print(f"clickpaca: --init is not valid JSON: {e}", file=sys.stderr)
        return 2
    init = {"type": "init", **init}
    if args.model:
        init["modelPath"] = args.model
    try:
        req = validate(init)
    except ProtocolError as e:
        print(f"clickpaca: --init: {e}", file=sys.stderr)
        return 2
    if args.queue < 1 or (args.max_seqs_per_client is not None and args.max_seqs_per_client < 1):
        print("clickpaca: --queue and --max-seqs-per-client must be >= 1", file=sys.stderr)
        return 2
    sys.stdout = sys.stderr
    return SocketServer(Path(args.socket), req, args.queue, args.max_seqs_per_client,
                        args.state_dir).run()
