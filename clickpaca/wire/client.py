"""A Python client for the NDJSON server: spawn it (or attach to pipes / a socket),
send requests, and read events per sequence, from plain code or from asyncio.

    with Client.spawn() as c:
        c.init()
        c.infer(0, "The capital of France is", maxTokens=8, temperature=0)
        print(c.text(0))

A reader thread routes each event: token/done/error events with a seq_id go to that
sequence's queue, everything else (ready, grammar_ready, errors without a sequence,
...) to the `misc` queue.

When the connection ends (the server exited, was killed, or closed the socket), every
waiting reader gets one ServerError: for a spawned server it names the exit status or
the signal, with the likely cause, and the last lines of the server's stderr.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket as socketlib
import subprocess
import sys
import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import orjson

from ..llama.cpu import describe_exit
from .endings import END_EVENTS

#: The events that answer a request on its seq_id (endings.py, checked by the protocol).
END_TYPES = END_EVENTS
#: How many of a spawned server's last stderr lines a death report carries.
STDERR_TAIL_LINES = 8


class ServerError(RuntimeError):
    """An `error` event answered a request the client waited for, or the server went away
    (event type `closed`: `status` is its exit status, negative for a signal)."""

    def __init__(self, event: dict) -> None:
        super().__init__(event.get("message"))
        self.event = event


class ServerGone(ServerError, ConnectionError):
    """The connection ended: the server exited, was killed, or closed the socket. Also a
    ConnectionError, so code that treats a broken pipe as the end still does."""


class Client:
    def __init__(self, rfile: BinaryIO, wfile: BinaryIO, proc: subprocess.Popen | None = None,
                 sock: socketlib.socket | None = None) -> None:
        self.rfile, self.wfile, self.proc, self.sock = rfile, wfile, proc, sock
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._stderr_path: str | None = None
        self._stderr_thread: threading.Thread | None = None
        self._end: dict | None = None  # the `closed` event, once the connection has ended
        self._queues: dict[int, queue.Queue] = defaultdict(queue.Queue)
        self.misc: queue.Queue = queue.Queue()
        self.all_events: list[dict] = []
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="client-reader")
        self._thread.start()
        self.ready: dict | None = None

    # ------------------------------------------------------------ construction

    @classmethod
    def spawn(cls, *args: str, env: dict | None = None, stderr: Any = None,
              python: str | None = None) -> "Client":
        """Start `python -m clickpaca serve ARGS` and talk to it over its stdio.

        With `stderr` None the server's stderr still reaches ours, through a thread that
        keeps its last lines for the report of a death; a file given as `stderr` is read
        back for them instead."""
        cmd = [python or sys.executable, "-m", "clickpaca", "serve", *args]
        full_env = dict(os.environ, **(env or {}))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if stderr is None else stderr, env=full_env)
        assert proc.stdin and proc.stdout
        client = cls(proc.stdout, proc.stdin, proc=proc)
        if stderr is None:
            client._stderr_thread = threading.Thread(target=client._tee_stderr, daemon=True,
                                                     name="client-stderr")
            client._stderr_thread.start()
        elif isinstance(getattr(stderr, "name", None), str):
            client._stderr_path = stderr.name
        return client

    @classmethod
    def connect(cls, path: str | os.PathLike) -> "Client":
        """Attach to a running `clickpaca serve --socket PATH`."""
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        sock.connect(str(path))
        return cls(sock.makefile("rb"), sock.makefile("wb"), sock=sock)

    # ------------------------------------------------------------ io

    def _read(self) -> None:
        try:
            for line in self.rfile:
                if not line.strip():
                    continue
                ev = self._decode(line)
                with self._lock:
                    self.all_events.append(ev)
                sid = ev.get("seq_id", -1)
                if isinstance(sid, int) and sid >= 0:
                    self._queues[sid].put(ev)
                else:
                    self.misc.put(ev)
        except (OSError, ValueError):
            pass
        finally:
            end = self._end = self._end_event()
            self.closed.set()
            self.misc.put(end)
            for q in list(self._queues.values()):
                q.put(end)

    def _tee_stderr(self) -> None:
        """Pass the server's stderr through to ours, keeping its last lines."""
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                os.write(2, line)
            except OSError:
                pass
            self._stderr_tail.append(line.decode("utf-8", "replace").rstrip())

    def stderr_tail(self) -> list[str]:
        """The last lines the spawned server wrote to stderr (as far as they are known)."""
        if self._stderr_path is not None:
            try:
                with open(self._stderr_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - 4096))
                    lines = f.read().decode("utf-8", "replace").splitlines()
                return [ln.rstrip() for ln in lines if ln.strip()][-STDERR_TAIL_LINES:]
            except OSError:
                return []
        return [ln for ln in self._stderr_tail if ln.strip()]

    def _end_event(self) -> dict:
        """The `closed` pseudo-event every waiting reader gets when the connection ends."""
        if self.proc is None:
            return {"type": "closed", "message": "the server closed the connection"}
        try:
            status = self.proc.wait(timeout=10)  # its stdout is closed: it is exiting
        except subprocess.TimeoutExpired:
            return {"type": "closed", "message": "the server closed its output but is still running"}
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=5)
        tail = self.stderr_tail()
        if status == 0:
            message = "the server exited (status 0)"
        else:
            message = f"the server died: {describe_exit(status)}"
            if tail:
                message += "; its last stderr lines: " + " | ".join(tail)
        return {"type": "closed", "message": message, "status": status, "stderr": tail}

    def _decode(self, line: bytes) -> dict:
        """One event line as a dict (subclasses may annotate it, e.g. with a timestamp)."""
        return orjson.loads(line)

    def send(self, request: dict) -> None:
        self.send_raw(orjson.dumps(request) + b"\n")

    def send_raw(self, line: bytes) -> None:
        """Send bytes as they are (several request lines in one write, robustness tests)."""
        try:
            self.wfile.write(line)
            self.wfile.flush()
        except OSError as e:
            self.closed.wait(timeout=15)  # the reader learns how the server ended
            raise ServerGone(self._end or {"type": "closed", "message": f"the server is gone ({e})"}) from None

    def next_misc(self, timeout: float | None = 120) -> dict:
        return self.misc.get(timeout=timeout)

    def wait_misc(self, types: set[str], timeout: float) -> dict:
        """The next non-sequence event of one of ``types`` (an `error` raises ServerError,
        the server's end ServerGone)."""
        if self._end is not None and self.misc.empty():
            raise ServerGone(self._end)
        while True:
            ev = self.misc.get(timeout=timeout)
            if ev["type"] in types:
                return ev
            if ev["type"] == "error":
                raise ServerError(ev)
            if ev["type"] == "closed":
                self.misc.put(ev)  # every later reader learns it too
                raise ServerGone(ev)

    # ------------------------------------------------------------ requests

    def init(self, timeout: float = 300, **params: Any) -> dict:
        self.send({"type": "init", **params})
        self.ready = self.wait_misc({"ready"}, timeout)
        return self.ready

    def grammar(self, gid: str, text: str, timeout: float = 120, **options: Any) -> dict:
        """Register a grammar; options are the request's (lenient, numberDigits, strict, validate)."""
        self.send({"type": "grammar", "id": gid, "grammar": text, **options})
        return self.wait_misc({"grammar_ready"}, timeout)

    def vector(self, vid: str, vector: Any, timeout: float = 120) -> dict:
        """Register a steering vector (a control-vector GGUF path or {layer: vector}); its vector_ready."""
        self.send({"type": "vector", "id": vid, "vector": vector})
        return self.wait_misc({"vector_ready"}, timeout)

    def free_vector(self, vid: str, timeout: float = 120) -> dict:
        self.send({"type": "free", "vector": vid})
        return self.wait_misc({"vector_freed"}, timeout)

    def infer(self, seq_id: int, prompt: str, **params: Any) -> None:
        self.send({"type": "infer", "seq_id": seq_id, "prompt": prompt, **params})

    def score(self, seq_id: int, text: str, **params: Any) -> dict:
        self.send({"type": "score", "seq_id": seq_id, "text": text, **params})
        return self.wait(seq_id)

    def cancel(self, seq_id: int) -> None:
        self.send({"type": "cancel", "seq_id": seq_id})

    def request(self, req: dict, timeout: float = 600) -> dict:
        """Send a sequence request (prefill, fork, save, load, free) and wait for its answer."""
        self.send(req)
        return self.wait(req["seq_id"], timeout)

    def quit(self, now: bool = False) -> None:
        self.send({"type": "quit", "now": now})

    # ------------------------------------------------------------ events

    def unread(self) -> dict[int, dict]:
        """The first event not yet read of each sequence that has one (nothing is consumed):
        after every awaited request has ended, anything here arrived after its end."""
        return {sid: q.queue[0] for sid, q in list(self._queues.items()) if not q.empty()}

    def stream(self, seq_id: int, timeout: float = 600) -> Iterator[dict]:
        """Events of one sequence up to and including the one that ends its request;
        ServerError if the connection ends first (the server died or went away)."""
        q = self._queues[seq_id]
        if self._end is not None and q.empty():
            raise ServerGone(self._end)
        while True:
            ev = q.get(timeout=timeout)
            if ev["type"] == "closed":
                q.put(ev)  # a later read of this sequence learns it too
                raise ServerGone(ev)
            yield ev
            if ev["type"] in END_TYPES:
                return

    def wait(self, seq_id: int, timeout: float = 600) -> dict:
        """The event that ends the sequence's current request (raises on error)."""
        last = None
        for ev in self.stream(seq_id, timeout):
            last = ev
        assert last is not None
        if last["type"] == "error":
            raise ServerError(last)
        return last

    def collect(self, seq_id: int, timeout: float = 600) -> tuple[list[dict], dict]:
        """(token events, final event) of one sequence's request."""
        events = list(self.stream(seq_id, timeout))
        return _split_final(events)

    def text(self, seq_id: int, timeout: float = 600) -> str:
        tokens, final = self.collect(seq_id, timeout)
        if final["type"] == "error":
            raise ServerError(final)
        return "".join(t["piece"] for t in tokens) + final.get("tail", "")

    async def astream(self, seq_id: int, timeout: float = 600):
        """asyncio version of `stream`: `async for ev in client.astream(0): ...`."""
        q = self._queues[seq_id]
        if self._end is not None and q.empty():
            raise ServerGone(self._end)
        while True:
            ev = await asyncio.to_thread(q.get, True, timeout)
            if ev["type"] == "closed":
                q.put(ev)
                raise ServerGone(ev)
            yield ev
            if ev["type"] in END_TYPES:
                return

    async def acollect(self, seq_id: int, timeout: float = 600) -> tuple[list[dict], dict]:
        """asyncio version of `collect`."""
        return _split_final([ev async for ev in self.astream(seq_id, timeout)])

    # ------------------------------------------------------------ lifetime

    def close(self, timeout: float = 60) -> int | None:
        try:
            self.wfile.close()
        except OSError:
            pass
        if self.sock is not None:
            try:
                self.sock.shutdown(socketlib.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        if self.proc is not None:
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def default_python() -> str:
    """The interpreter of the project's venv when it exists, else this one."""
    venv = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _split_final(events: list[dict]) -> tuple[list[dict], dict]:
    """(token events, the final event) of one request's stream (which ends with it)."""
    tokens = [ev for ev in events if ev["type"] == "token"]
    finals = [ev for ev in events if ev["type"] != "token"]
    assert finals, "the stream ended without a final event"
    return tokens, finals[-1]
