"""The C allocator's settings for a long-running server: a fixed mmap threshold, and
few arenas.

glibc serves an allocation at or above its mmap threshold with a mapping of its own,
given back to the kernel when freed; below it, from an arena (one per thread that
allocates, up to 8 per core), whose freed pages mostly stay with the process. The
threshold starts at 128 KiB and rises to the size of any mapped block that is freed
(up to 32 MiB), so after the first large temporary is freed the next ones come from
the arenas. A server whose client reader threads each make large temporaries (DRY's
breaker tables: numpy arrays of 10 MB while a table is made, engine/prepare.py) then
grows by each arena's high-water mark: the socket soak (clickpaca/measure/soak.py, 16
clients) grew 100+ MiB in 90 s after its warm-up, 5 MiB with the threshold fixed.
Setting it (mallopt M_MMAP_THRESHOLD) keeps it fixed: blocks of 4 MiB and more are
always mapped and always given back; a logits row (1 MiB) still comes from an arena.
The arenas themselves (one per thread that allocates, 8 per core, each keeping its own
freed pages) still let VmRSS creep, about 5 MiB a minute over a 10-minute soak with 16
clients, each with a reader and a writer thread; with at most one arena per core
(M_ARENA_MAX) the same soak stayed flat after its warm-up. Elsewhere (not glibc) this
does nothing. What it costs in speed: docs/BENCHMARKS.md, "The server's allocator
settings".
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's malloc.h
MMAP_THRESHOLD = 4 << 20


def fix_mmap_threshold(size: int = MMAP_THRESHOLD, arenas: int | None = None) -> bool:
    """Fix glibc's mmap threshold at `size` bytes and its arenas at `arenas` (default:
    one per core, at least 2) for this process; False where the C library has no
    mallopt or refuses either."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if arenas is None:
        arenas = max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2)
    return mallopt(M_MMAP_THRESHOLD, size) == 1 and mallopt(M_ARENA_MAX, arenas) == 1
