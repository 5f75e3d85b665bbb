"""The C allocator's setting for a long-running server: few arenas.

glibc gives each thread that allocates an arena of its own (up to 8 per core), and each
arena keeps its freed pages. A server whose client reader threads make large temporaries
(DRY's breaker tables: numpy arrays of 10 MB while a table is made, engine/prepare.py)
then grows by every arena's high-water mark. With at most one arena per core
(mallopt M_ARENA_MAX) the socket soak (clickpaca/measure/soak.py, 16 clients, 10
minutes) stays flat after its warm-up. The mmap threshold is left to glibc: fixing it
too kept the level about 80 MiB lower but cost 5-7% of generation speed at 64
sequences in some measurements (not in others). Both: docs/BENCHMARKS.md, "The
server's allocator settings". Elsewhere (not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes

from .cores import usable_cores

M_ARENA_MAX = -8  # glibc's malloc.h


def default_arenas() -> int:
    """One arena per core this process may run on, at least 2."""
    return max(2, usable_cores())


def cap_arenas(arenas: int | None = None) -> bool:
    """Cap glibc's arenas at `arenas` (default: `default_arenas()`) for this process;
    False where the C library has no mallopt or refuses it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas or default_arenas()) == 1
