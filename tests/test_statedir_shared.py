"""Issue 43: two servers on one state directory, the issue's repro.

Server A captures `result_output` (a file: over 1 MiB) on seq 0; then server B, on the
same directory, runs a 40-token infer on seq 1 and the same capture line. Before the fix
both named the file capture-0-0-result_output.npy, and B's tick ended with an internal
error that left seq 1 unanswered. Now each server's files carry its run id: both
requests end with `done`, the two files differ, and A's is untouched by B.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from clickpaca.wire.client import Client
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

pytestmark = pytest.mark.model

LINE = {"type": "infer", "seq_id": 0, "prompt": "The capital of France is", "maxTokens": 2,
        "temperature": 0, "capture": ["result_output"]}


def spawn(state: Path) -> Client:
    c = Client.spawn()
    c.init(nCtx=1024, nSeqMax=4, build=TEST_BUILD, cacheTypeK=TEST_CACHE_K, cacheTypeV=TEST_CACHE_V,
           capture=True, stateDir=str(state))
    return c


def test_two_servers_share_a_state_directory(tmp_path):
    state = tmp_path / "shared-state"
    a = spawn(state)
    b = spawn(state)
    try:
        a.send(LINE)
        done_a = a.wait(0)
        file_a = Path(done_a["capture"]["nodes"]["result_output"]["file"])
        digest_a = hashlib.sha256(file_a.read_bytes()).hexdigest()

        b.infer(1, "Once upon a time", maxTokens=40, temperature=0)
        b.send(LINE)
        toks_1, done_1 = b.collect(1)
        done_b = b.wait(0)
        assert done_1["type"] == "done" and len(toks_1) == 40, done_1
        file_b = Path(done_b["capture"]["nodes"]["result_output"]["file"])

        assert file_a != file_b and file_a.parent == file_b.parent == state
        assert hashlib.sha256(file_a.read_bytes()).hexdigest() == digest_a
        for f in (file_a, file_b):
            arr = np.load(f)
            assert arr.shape == (2, 262144) and np.isfinite(arr).all()
        # the same server again: a new name each time, nothing replaced
        a.send(LINE)
        file_a2 = Path(a.wait(0)["capture"]["nodes"]["result_output"]["file"])
        assert file_a2 not in (file_a, file_b)
        assert len(list(state.glob("capture-*.npy"))) == 3
    finally:
        a.close()
        b.close()
