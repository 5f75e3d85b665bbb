"""tests/conftest.py's Hypothesis profile: every run gets the derandomized one, whatever CI
says, so a newcomer's `make test` runs the examples CI runs; only CLICKPACA_EXPLORE
(make explore) gives random examples. Each case imports conftest in a fresh interpreter
with the environment under test, as pytest does."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import conftest
from hypothesis import settings
s = settings()
print(json.dumps({"profile": conftest.HYPOTHESIS_PROFILE, "derandomize": s.derandomize,
                  "database": s.database is not None, "fresh": [conftest.fresh_seed(7) for _ in range(2)]}))
"""


@functools.cache
def _loaded(env: tuple) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "CLICKPACA_EXPLORE")}
    out = subprocess.run([sys.executable, "-c", PROBE, str(TESTS)], env={**clean, **dict(env)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loaded(**env) -> dict:
    """What conftest loads in a fresh interpreter with ``env`` (and neither variable else)."""
    return _loaded(tuple(sorted(env.items())))


@pytest.mark.parametrize("env", [{}, {"CI": "true"}, {"CI": "1"}, {"CLICKPACA_EXPLORE": "0"},
                                 {"CI": "true", "CLICKPACA_EXPLORE": "false"}], ids=repr)
def test_every_run_is_derandomized_whatever_ci_says(env):
    got = loaded(**env)
    assert got == {"profile": "fixed", "derandomize": True, "database": False,
                   "fresh": [loaded()["fresh"][0]] * 2}, got


def test_explore_is_random_with_the_example_database():
    got = loaded(CLICKPACA_EXPLORE="1")
    assert got["profile"] == "explore" and got["derandomize"] is False and got["database"] is True, got
    assert got["fresh"][0] != got["fresh"][1], got  # a new seed each call (2^-32 to collide)
