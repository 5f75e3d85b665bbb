"""sampling.workers.run_all: every task once, on several threads, errors in list order."""

import threading
import time

import numpy as np
import pytest

from clickpaca.sampling import workers
from clickpaca.sampling.workers import run_all


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_every_task_runs_once(threads):
    hits = [0] * 50

    def task(i):
        hits[i] += 1

    run_all([lambda i=i: task(i) for i in range(50)], threads)
    assert hits == [1] * 50


def test_tasks_share_the_threads(monkeypatch):
    """Two tasks that each wait for the other can only finish on two threads at once."""
    monkeypatch.setattr(workers, "CORES", 2)  # whatever this machine has
    barrier = threading.Barrier(2, timeout=10)
    names = set()

    def task():
        names.add(threading.current_thread().name)
        barrier.wait()

    run_all([task, task], 2)
    assert len(names) == 2 and threading.current_thread().name in names


def test_at_most_one_thread_per_core(monkeypatch):
    monkeypatch.setattr(workers, "CORES", 1)
    names = []
    run_all([lambda: names.append(threading.current_thread()) for _ in range(4)], 8)
    assert names == [threading.current_thread()] * 4


def test_one_thread_runs_in_order_on_the_caller():
    order = []
    run_all([lambda i=i: order.append((i, threading.current_thread())) for i in range(5)], 1)
    assert order == [(i, threading.current_thread()) for i in range(5)]


def test_the_first_failing_task_in_list_order_is_raised_after_all_ran(monkeypatch):
    monkeypatch.setattr(workers, "CORES", 2)
    ran = []

    def fail(i, delay):
        time.sleep(delay)
        ran.append(i)
        raise ValueError(i)

    tasks = [lambda: ran.append(0), lambda: fail(1, 0.05), lambda: fail(2, 0.0), lambda: ran.append(3)]
    with pytest.raises(ValueError) as e:
        run_all(tasks, 2)
    assert e.value.args == (1,)
    assert sorted(ran) == [0, 1, 2, 3]


def test_numpy_row_passes_give_the_same_bits_on_any_thread():
    """The property the threaded tick relies on: a row's float32 exp and float64 sum do
    not depend on the thread that computes them."""
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(262_144) * 5 - 3).astype(np.float32) for _ in range(6)]
    want = [np.add.reduce(np.exp(r - r.max()), dtype=np.float64) for r in rows]
    got = [None] * len(rows)

    def task(i):
        got[i] = np.add.reduce(np.exp(rows[i] - rows[i].max()), dtype=np.float64)

    run_all([lambda i=i: task(i) for i in range(len(rows))], 2)
    assert [x.tobytes() for x in got] == [x.tobytes() for x in want]
