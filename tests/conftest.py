"""Shared fixtures: the real build, the real default model, a real server process.

Tests that need the model are marked `model`; they fail (not skip) when the build or
model is missing, because `make test` sets both up first.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from clickpaca.llama import cachetypes
from clickpaca.wire.client import Client

# Hypothesis profiles, chosen before any test module is imported, so a test's own
# @settings(...) inherits the profile and overrides only what it names; pytest's
# --hypothesis-profile NAME still wins. "fixed", everyone's (make test, CI, make check):
# derandomized (the examples are a function of the test and the installed versions: the
# pinned Hypothesis, and numpy where a test expands a drawn seed), no example database, and
# a failure prints its reproduction blob. "explore", only with CLICKPACA_EXPLORE set to
# anything but "", "0" or "false" (make explore): random examples, and the failures found
# are kept in .hypothesis/examples and replayed first (turn each into an explicit @example
# with literal inputs). Both: no deadline and no too_slow health check, so a loaded
# machine is not a failure.
_NOT_TIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fixed", derandomize=True, database=None, print_blob=True, **_NOT_TIMED)
settings.register_profile(
    "explore", derandomize=False, print_blob=True, **_NOT_TIMED,
    database=DirectoryBasedExampleDatabase(os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                        ".hypothesis", "examples")))
EXPLORE = os.environ.get("CLICKPACA_EXPLORE", "").strip().lower() not in ("", "0", "false")
HYPOTHESIS_PROFILE = "explore" if EXPLORE else "fixed"
settings.load_profile(HYPOTHESIS_PROFILE)


def fresh_seed(fixed: int) -> int:
    """The seed of a seeded test's "fresh" case, beside its fixed seed: a second fixed
    seed derived from the first, so that every run repeats; a new random seed on every
    run under CLICKPACA_EXPLORE (the test prints it, to rerun a failure)."""
    if not EXPLORE:
        return (fixed * 0x9E3779B1 + 0x7F4A7C15) % (1 << 32)
    return random.SystemRandom().randrange(1 << 32)

TEST_BUILD = os.environ.get("CLICKPACA_TEST_BUILD", "mainline")
TEST_CACHE_K = os.environ.get("CLICKPACA_TEST_CACHE_K", cachetypes.DEFAULT)
TEST_CACHE_V = os.environ.get("CLICKPACA_TEST_CACHE_V", cachetypes.DEFAULT)

# Where two runs of the same greedy request may part when their batches differ in shape
# or cell placement: only at a step where the token the other run chose is within this
# many nats of the token the first run chose. Each cache type's row says its tolerance
# (clickpaca/llama/cachetypes.py: lossy types amplify the CPU kernels' placement-dependent rounding).
_TEST_ROWS = (cachetypes.get(TEST_CACHE_K, "CLICKPACA_TEST_CACHE_K"),
              cachetypes.get(TEST_CACHE_V, "CLICKPACA_TEST_CACHE_V"))
LOSSLESS = all(r.lossless for r in _TEST_ROWS)
NEAR_TIE = max(r.near_tie for r in _TEST_ROWS)


@pytest.fixture(scope="session", autouse=True)
def results_store(tmp_path_factory):
    """Every run the tests record goes to a store of their own, never the user's."""
    path = tmp_path_factory.mktemp("results") / "results.sqlite3"
    old = os.environ.get("CLICKPACA_RESULTS")
    os.environ["CLICKPACA_RESULTS"] = str(path)
    yield path
    if old is None:
        os.environ.pop("CLICKPACA_RESULTS", None)
    else:
        os.environ["CLICKPACA_RESULTS"] = old


@pytest.fixture(scope="session")
def model_path():
    from clickpaca.llama.models import resolve_model

    return resolve_model()


@pytest.fixture(scope="session")
def model(model_path):
    from clickpaca.llama.core import Model

    m = Model(model_path, build=TEST_BUILD)
    yield m


def spawn_server(*args: str, **init) -> Client:
    """A real `clickpaca serve ARGS` process, initialised with the test build and cache
    types, and a state directory of its own (never the user's)."""
    c = Client.spawn(*args, python=sys.executable)
    params = {"nCtx": 4096, "nSeqMax": 16, "build": TEST_BUILD, "stateDir": tempfile.mkdtemp(prefix="clkp-state-"),
              "cacheTypeK": TEST_CACHE_K, "cacheTypeV": TEST_CACHE_V}
    params.update(init)
    c.init(**params)
    return c


@pytest.fixture(scope="module")
def server():
    c = spawn_server()
    yield c
    c.close()


@pytest.fixture(scope="module", autouse=True)
def no_leaked_kernel_settings():
    """A test module must not leave deterministic mode's process setting (the tiled
    K-quant matmul off) in this process's environment: every server spawned after it
    inherits the environment, and the default-mode tests would run other kernels."""
    before = os.environ.get("GGML_CPU_TILED_MM")
    yield
    after = os.environ.get("GGML_CPU_TILED_MM")
    assert after == before, f"this module left GGML_CPU_TILED_MM={after!r} (was {before!r})"


def chunked_logits(ctx, model, toks, chunk: int):
    """Every position's raw logits row, sequence 0's prompt `toks` decoded in chunks of
    `chunk` tokens (each at most ctx's batch) on a core.Context."""
    import numpy as np

    from clickpaca.llama import core

    b = core.Batch(model.nat, chunk)
    out = []
    for s in range(0, len(toks), chunk):
        b.clear()
        b.add(toks[s:s + chunk], s, 0, output_last=False)
        b.logits[:len(toks[s:s + chunk])] = 1
        assert ctx.decode(b) == 0
        out.append(ctx.logits().copy())
    return np.concatenate(out)
