"""base/malloc.py: the server fixes glibc's mmap threshold (the soak's VmRSS bound,
tests/test_soak_socket.py, is what it is for)."""

from __future__ import annotations

import subprocess
import sys

from clickpaca.base import malloc


def test_the_threshold_is_set_where_the_c_library_has_mallopt():
    code = ("import ctypes, sys; from clickpaca.base.malloc import fix_mmap_threshold; "
            "ok = fix_mmap_threshold(); has = hasattr(ctypes.CDLL(None), 'mallopt'); "
            "sys.exit(0 if ok == has else 1)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_threshold_keeps_a_logits_row_in_the_arenas():
    assert 1 << 20 < malloc.MMAP_THRESHOLD <= 32 << 20  # below glibc's ceiling for the threshold
