"""Any number of sequence requests over a server's slots, every slot kept busy.

The server runs at most nSeqMax sequences at once, each on a seq_id the client picks.
`run_jobs` hands each request a free seq_id, sends as many as there are free slots in
one write (so the server reads them before its next tick and decodes them together),
and refills a slot the moment its request ends. Slots come from one `Slots` pool per
server, so concurrent calls (threads, or `agenerate` on asyncio) share them safely.

`EventClient` is the Client with two additions made where events are parsed: each event
carries its arrival time `_t` (perf_counter), and the end of a request on a seq_id that a
running call owns is announced to that call's queue, so it waits on one queue for
whichever of its requests ends first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Callable

import orjson

from ..wire.client import END_TYPES, Client, ServerError

#: How often a waiting call checks whether the server went away.
POLL_S = 0.5


class EventClient(Client):
    """A Client whose events carry `_t` and whose request ends reach their owner."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.owners: dict[int, queue.Queue] = {}  # before the reader thread starts
        super().__init__(*args, **kwargs)

    def _decode(self, line: bytes) -> dict:
        ev = super()._decode(line)
        ev["_t"] = time.perf_counter()
        if ev.get("type") in END_TYPES:
            owner = self.owners.get(ev.get("seq_id"))
            if owner is not None:
                owner.put(ev["seq_id"])
        return ev


class Slots:
    """The free seq_ids of one server."""

    def __init__(self, ids: list[int]) -> None:
        self._free = deque(ids)
        self._cond = threading.Condition()

    def take(self) -> int | None:
        with self._cond:
            return self._free.popleft() if self._free else None

    def take_wait(self, closed: threading.Event) -> int:
        """A free seq_id, waiting for one (raises if the server goes away meanwhile)."""
        with self._cond:
            while not self._free:
                if closed.is_set():
                    raise gone({"type": "closed"})
                self._cond.wait(POLL_S)
            return self._free.popleft()

    def give(self, sid: int) -> None:
        with self._cond:
            self._free.append(sid)
            self._cond.notify()

    def __len__(self) -> int:
        return len(self._free)


def run_jobs(client: EventClient, slots: Slots, jobs: list[dict[str, Any]],
             on_end: Callable[[int, list[dict], float], None], limit: int | None = None) -> None:
    """Send every job (a sequence request without seq_id) on a free slot and call
    on_end(index, events, t_sent) as each one ends; events are the request's own,
    ending with the event that ends it. A job that cannot even be encoded ends with a
    synthetic error event naming why. `limit`: at most this many running at once.
    Raises ServerError if the server goes away."""
    owner: queue.Queue = queue.Queue()
    pending = deque(enumerate(jobs))
    running: dict[int, tuple[int, float]] = {}
    while pending or running:
        lines, started = [], []
        while pending and (limit is None or len(running) + len(lines) < limit):
            sid = slots.take() if (running or lines) else slots.take_wait(client.closed)
            if sid is None:
                break
            i, job = pending.popleft()
            try:
                line = orjson.dumps({**job, "seq_id": sid}) + b"\n"
            except TypeError as e:
                slots.give(sid)
                on_end(i, [{"type": "error", "seq_id": -1, "message": f"request not encodable: {e}"}],
                       time.perf_counter())
                continue
            client.owners[sid] = owner
            lines.append(line)
            started.append((sid, i))
        if lines:
            t_sent = time.perf_counter()
            client.send_raw(b"".join(lines))
            for sid, i in started:
                running[sid] = (i, t_sent)
        if not running:
            continue
        sid = _next_end(owner, client, running)
        i, t_sent = running.pop(sid)
        events = list(client.stream(sid))
        del client.owners[sid]
        slots.give(sid)
        on_end(i, events, t_sent)


def _next_end(owner: queue.Queue, client: Client, running: dict[int, Any]) -> int:
    while True:
        try:
            return owner.get(timeout=POLL_S)
        except queue.Empty:
            if client.closed.is_set() and owner.empty():
                # no request of ours ended before the connection did: the client's own
                # account of the end (exit status, signal, stderr) answers a running one
                for ev in client.stream(next(iter(running))):
                    if ev.get("type") == "closed":
                        raise gone(ev) from None


def gone(closed: dict) -> ServerError:
    """The error for a connection that ended (the client's `closed` event, which names the
    server's exit status where the client knows it)."""
    return ServerError(closed if closed.get("message") else {**closed, "message": "the server closed the connection"})
