"""A Python client for the NDJSON server: spawn it (or attach to pipes / a socket),
send requests, and read events per sequence, from plain code or from asyncio.

    with Client.spawn() as c:
        c.init()
        c.infer(0, "The capital of France is", maxTokens=8, temperature=0)
        print(c.text(0))

A reader thread routes each event: token/done/error events with a seq_id go to that
sequence's queue, everything else (ready, grammar_ready, errors without a sequence,
...) to the `misc` queue.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket as socketlib
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import orjson

from .protocol import END_EVENTS

#: The events that answer a request on its seq_id (the protocol's END_EVENTS).
END_TYPES = frozenset(END_EVENTS)


class ServerError(RuntimeError):
    """An `error` event answered a request the client waited for."""

    def __init__(self, event: dict) -> None:
        super().__init__(event.get("message"))
        self.event = event


class Client:
    def __init__(self, rfile: BinaryIO, wfile: BinaryIO, proc: subprocess.Popen | None = None,
                 sock: socketlib.socket | None = None) -> None:
        self.rfile, self.wfile, self.proc, self.sock = rfile, wfile, proc, sock
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
        """Start `python -m clickpaca serve ARGS` and talk to it over its stdio."""
        cmd = [python or sys.executable, "-m", "clickpaca", "serve", *args]
        full_env = dict(os.environ, **(env or {}))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, env=full_env)
        assert proc.stdin and proc.stdout
        return cls(proc.stdout, proc.stdin, proc=proc)

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
            self.closed.set()
            self.misc.put({"type": "closed"})
            for q in list(self._queues.values()):
                q.put({"type": "closed"})

    def _decode(self, line: bytes) -> dict:
        """One event line as a dict (subclasses may annotate it, e.g. with a timestamp)."""
        return orjson.loads(line)

    def send(self, request: dict) -> None:
        self.wfile.write(orjson.dumps(request) + b"\n")
        self.wfile.flush()

    def send_raw(self, line: bytes) -> None:
        """Send bytes as they are (several request lines in one write, robustness tests)."""
        self.wfile.write(line)
        self.wfile.flush()

    def next_misc(self, timeout: float | None = 120) -> dict:
        return self.misc.get(timeout=timeout)

    def _wait_misc(self, types: set[str], timeout: float) -> dict:
        while True:
            ev = self.misc.get(timeout=timeout)
            if ev["type"] in types:
                return ev
            if ev["type"] == "error":
                raise ServerError(ev)
            if ev["type"] == "closed":
                raise ServerError({"message": "the server closed the connection"})

    # ------------------------------------------------------------ requests

    def init(self, timeout: float = 300, **params: Any) -> dict:
        self.send({"type": "init", **params})
        self.ready = self._wait_misc({"ready"}, timeout)
        return self.ready

    def grammar(self, gid: str, text: str, timeout: float = 120) -> dict:
        self.send({"type": "grammar", "id": gid, "grammar": text})
        return self._wait_misc({"grammar_ready"}, timeout)

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

    def stream(self, seq_id: int, timeout: float = 600) -> Iterator[dict]:
        """Events of one sequence up to and including the one that ends its request."""
        q = self._queues[seq_id]
        while True:
            ev = q.get(timeout=timeout)
            yield ev
            if ev["type"] in END_TYPES or ev["type"] == "closed":
                return

    def wait(self, seq_id: int, timeout: float = 600) -> dict:
        """The event that ends the sequence's current request (raises on error)."""
        last = None
        for ev in self.stream(seq_id, timeout):
            last = ev
        assert last is not None
        if last["type"] == "error":
            raise ServerError(last)
        if last["type"] == "closed":
            raise ServerError({"message": "the server closed the connection"})
        return last

    def collect(self, seq_id: int, timeout: float = 600) -> tuple[list[dict], dict]:
        """(token events, final event) of one sequence's request."""
        events = list(self.stream(seq_id, timeout))
        return _split_final(events)

    def text(self, seq_id: int, timeout: float = 600) -> str:
        tokens, final = self.collect(seq_id, timeout)
        if final["type"] == "error":
            raise ServerError(final)
        return "".join(t["piece"] for t in tokens)

    async def astream(self, seq_id: int, timeout: float = 600):
        """asyncio version of `stream`: `async for ev in client.astream(0): ...`."""
        q = self._queues[seq_id]
        while True:
            ev = await asyncio.to_thread(q.get, True, timeout)
            yield ev
            if ev["type"] in END_TYPES or ev["type"] == "closed":
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
    venv = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _split_final(events: list[dict]) -> tuple[list[dict], dict]:
    """(token events, the final event) of one request's stream (which ends with it)."""
    tokens = [ev for ev in events if ev["type"] == "token"]
    finals = [ev for ev in events if ev["type"] != "token"]
    assert finals, "the stream ended without a final event"
    return tokens, finals[-1]
