"""How many cores this process may run on: its CPU affinity where the OS has one (a
cluster job or `taskset` gives fewer than the machine has), else the machine's count.
Read by the sampling workers (no more threads than cores) and the allocator's arena cap."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (at least 1)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
