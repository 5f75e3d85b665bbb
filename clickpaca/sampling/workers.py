"""Independent tasks run on n threads: the calling thread plus n - 1 persistent workers.

A tick's rows are sampled while the decode is not running, so its threads are idle;
numpy releases the GIL inside its loops over a row (exp, reductions, argmax,
partitions, take), so n threads overlap those loops while only the Python between them
is serial. Each task does exactly what it does on one thread (same inputs, same
calls), so the results are the same bit for bit; only the order in which tasks finish
changes. Tasks are handed out one at a time (the next free thread takes the next one),
so one slow row does not hold a whole share of the tick. An exception a task raises is
re-raised on the calling thread once every task has ended: the one of the first such
task in list order.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

from ..base.cores import usable_cores

__all__ = ["run_all"]

class _Pool:
    """Daemon threads (they never hold the exit) taking callables from one queue; grown
    to the largest count asked for. Workers never wait on each other, so callers that
    share it only queue behind one another."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.size = 0
        self._lock = threading.Lock()

    def ensure(self, n: int) -> "_Pool":
        with self._lock:
            while self.size < n:
                threading.Thread(target=self._serve, name=f"clickpaca-sample-{self.size}", daemon=True).start()
                self.size += 1
        return self

    def _serve(self) -> None:
        while True:
            self.jobs.get()()


_POOL = _Pool()

#: More threads than cores would only queue behind each other (nThreads may be up to 512).
CORES = usable_cores()


def run_all(tasks: Sequence[Callable[[], object]], threads: int) -> None:
    """Call every task once, on up to ``threads`` threads, at most one per core (1: in
    order, on this thread)."""
    n = min(int(threads), len(tasks), CORES)
    if n <= 1:
        for t in tasks:
            t()
        return
    nxt = iter(range(len(tasks)))
    take = threading.Lock()
    errors: dict[int, BaseException] = {}
    done: queue.SimpleQueue = queue.SimpleQueue()

    def loop() -> None:
        while True:
            with take:
                i = next(nxt, None)
            if i is None:
                return
            try:
                tasks[i]()
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                errors[i] = e

    def worker() -> None:
        try:
            loop()
        finally:
            done.put(None)

    pool = _POOL.ensure(n - 1)
    for _ in range(n - 1):
        pool.jobs.put(worker)
    loop()
    for _ in range(n - 1):
        done.get()
    if errors:
        raise errors[min(errors)]
