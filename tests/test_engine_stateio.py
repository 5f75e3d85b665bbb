"""engine/stateio.py without a model: jobs run in arrival order on the worker, each
completion is applied through `post` exactly once with its own job's result, a
completion that raises answers through `on_bug`, and a session is resumed once its
last job is applied."""

from __future__ import annotations

import queue
import threading

from clickpaca.engine.sequences import Session
from clickpaca.engine.stateio import StateIO


def drain(inbox: queue.Queue, io: StateIO) -> None:
    """What the server loop does: apply posted completions until none is pending."""
    while io.pending:
        inbox.get(timeout=30)()


def test_jobs_run_in_order_and_each_completion_gets_its_own_result():
    inbox: queue.Queue = queue.Queue()
    resumed = []
    io = StateIO(lambda: inbox.put, lambda s: resumed.append((s.name, s.io_pending, len(answered))))
    sessions = [Session(send=print, name="a"), Session(send=print, name="b")]
    gate = threading.Event()
    ran, answered = [], []
    for i in range(50):
        def work(i=i):
            if i == 0:
                gate.wait(30)  # the later jobs queue up behind the first
            ran.append((i, threading.current_thread().name))
            if i % 7 == 3:
                raise OSError(i, "refused")
            return i * 10

        io.submit(sessions[i >= 40], work, lambda r, e, i=i: answered.append((i, r, e.errno if e else None)),
                  on_bug=lambda msg: answered.append(("bug", msg)))
    assert io.pending == 50 and not ran
    gate.set()
    drain(inbox, io)
    io.close()
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"state-io"}
    assert answered == [(i, None, i) if i % 7 == 3 else (i, i * 10, None) for i in range(50)]
    assert resumed == [("a", 0, 40), ("b", 0, 50)]  # each session once, after its last job


def test_a_completion_that_raises_answers_through_on_bug():
    inbox: queue.Queue = queue.Queue()
    io = StateIO(lambda: inbox.put, lambda s: None)
    session = Session(send=print)
    bugs = []

    def then(result, error):
        raise KeyError("oops")

    io.submit(session, lambda: 1, then, bugs.append)
    io.submit(session, lambda: 2, lambda r, e: bugs.append(("second", r)), bugs.append)
    drain(inbox, io)
    io.close()
    assert bugs == ["internal error: KeyError: 'oops'", ("second", 2)] and session.io_pending == 0


def test_without_a_server_loop_jobs_run_in_place():
    io = StateIO(lambda: None, lambda s: None)
    session = Session(send=print)
    got = []
    io.submit(session, lambda: threading.current_thread().name, lambda r, e: got.append(r), got.append)
    assert got == [threading.current_thread().name] and io.pending == 0 and session.io_pending == 0
