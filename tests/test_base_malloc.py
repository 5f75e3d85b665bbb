"""base/malloc.py: the server caps glibc's arenas (the soak's VmRSS bound,
tests/test_soak_socket.py, is what it is for)."""

from __future__ import annotations

import subprocess
import sys

from clickpaca.base import malloc


def test_the_cap_is_set_where_the_c_library_has_mallopt():
    code = ("import ctypes, sys; from clickpaca.base.malloc import cap_arenas; "
            "ok = cap_arenas(); has = hasattr(ctypes.CDLL(None), 'mallopt'); "
            "sys.exit(0 if ok == has else 1)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_one_arena_per_core_and_never_fewer_than_two(monkeypatch):
    for cores, arenas in ((1, 2), (2, 2), (16, 16)):
        monkeypatch.setattr(malloc, "usable_cores", lambda: cores)
        assert malloc.default_arenas() == arenas
