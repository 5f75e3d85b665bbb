"""State files read and written off the engine thread.

The engine thread decodes for every client, so a `save` or `load` must not make the
others wait while tens of MB go through sha256 and the file system. Only the two
llama.cpp calls need the context (copying a sequence's cells out on save, in on load);
they stay on the engine thread. The rest (hashing, writing with fsync and renaming,
reading and verifying) runs on one worker thread, one job at a time in the order the
requests arrived, so a `load` always sees the file of every `save` sent before it.
hashlib and file IO release the GIL, so decoding goes on meanwhile.

A finished job's completion is posted to the server's inbox and applied on the engine
thread between ticks, like a request; it sends the `saved` / `loaded` or `error` event.
While a session has a job in flight, the engine holds that session's next requests and
applies them, in order, after the completion (Engine.handle), so a client sees exactly
the answers and order it saw when files were written in place: `saved` before the
`freed` sent behind it, a `fork` right behind a `load` finds the loaded state. Other
sessions' requests, and every sequence's decoding, go on meanwhile.
Without a server loop (`post` is None: in-process use) a job runs at once, in place.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import traceback
from typing import Any, Callable

Post = Callable[[Callable[[], None]], None]


class StateIO:
    """One worker thread and its FIFO of file jobs; `pending` counts unapplied jobs."""

    def __init__(self, post: Callable[[], Post | None], resume: Callable[[Any], None],
                 refuse: Callable[[], str | None] = lambda: None) -> None:
        self._post = post  # looked up per job: the server loop sets it after init
        self._resume = resume  # called with a session whose last job was applied
        # a message when completions must not touch the context any more (a lost RPC
        # worker): each is then answered with it through its on_bug
        self._refuse = refuse
        self._jobs: queue.Queue = queue.Queue()
        self.pending = 0  # submitted, completion not applied yet (engine thread only)
        self._thread: threading.Thread | None = None

    def submit(self, session: Any, work: Callable[[], Any], then: Callable[[Any, Exception | None], None],
               on_bug: Callable[[str], None]) -> None:
        """Run `work()` on the worker, then `then(result, error)` on the engine thread.

        `then` gets the exception `work` raised (or None); if `then` itself raises, the
        request is answered through `on_bug(message)` and the server goes on."""
        post = self._post()
        if post is None:
            self._apply(then, *_run(work), on_bug)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, daemon=True, name="state-io")
            self._thread.start()
        self.pending += 1
        session.io_pending += 1
        self._jobs.put((session, work, then, on_bug, post))

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            session, work, then, on_bug, post = job
            result, error = _run(work)
            # bound now: the next job rebinds these names before the engine applies this one
            post(functools.partial(self._done, session, then, result, error, on_bug))

    def _done(self, session, then, result, error, on_bug) -> None:
        self.pending -= 1
        try:
            refused = self._refuse()
            if refused is not None:
                on_bug(refused)
            else:
                self._apply(then, result, error, on_bug)
        finally:
            session.io_pending -= 1
            if not session.io_pending:
                self._resume(session)

    @staticmethod
    def _apply(then, result, error, on_bug) -> None:
        try:
            then(result, error)
        except Exception as e:  # noqa: BLE001 - a bug costs this request, not the server
            traceback.print_exc(file=sys.stderr)
            on_bug(f"internal error: {type(e).__name__}: {e}")

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued jobs (a save in progress completes its rename), then stop."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None


def _run(work: Callable[[], Any]) -> tuple[Any, Exception | None]:
    try:
        return work(), None
    except Exception as e:  # noqa: BLE001 - handed to the completion, which answers
        return None, e
