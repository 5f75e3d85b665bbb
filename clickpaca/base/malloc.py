"""The C allocator's setting for a long-running server: a fixed mmap threshold.

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
Elsewhere (not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 4 << 20


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `size` bytes for this process; False where the C
    library has no mallopt or refuses it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, size) == 1
