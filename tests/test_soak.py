"""Fault tests that take a while: a bounded soak, kill -9 during save, concurrent setup.

Real server processes and the real default model; no timing thresholds (the soak's bound
is on memory).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clickpaca.wire.client import Client
from clickpaca.engine.statedir import TEMP_PREFIX
from conftest import spawn_server

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parent.parent
SOAK_CYCLES = int(os.environ.get("CLICKPACA_SOAK_CYCLES", "1000"))
WARM_UP = SOAK_CYCLES // 5
# RSS growth allowed after warm-up, over the remaining cycles. Chosen from the issue's
# probe (about 9 MiB per 1,000 cycles after warm-up, one +12 MiB step) and this test's
# own runs (see the report): caches that fill to a bound (token pieces, the grammar LRU of
# 64 entries, glibc arenas) grow in steps; a leak of one state file, one matcher or one
# logits row per cycle (>= 90 KiB) would exceed it within a few hundred cycles.
# What the remaining growth is (measured 2026-11-30: the cycle run in-process with
# tracemalloc and gc counts, /tmp scripts described in the #19 note): Python objects kept
# after warm-up are the sampler chain's plan cache (sampling/chain.py `steps_to_run`, an
# LRU of 1,024 entries keyed by the request's SamplerParams and the allowed-token count:
# every soak infer has a fresh seed, so every request adds entries until the bound; 201
# SamplerParams alive after 300 cycles, ~0.35 MiB at 1,000) and the ints of its keys;
# together about the +0.6 MiB this test sees after warm-up. Nothing grows per cycle
# without a bound.
RSS_BOUND_MIB = 32
DOC = ("From fairest creatures we desire increase, that thereby beauty's rose might never die, "
       "but as the riper should by time decease, his tender heir might bear his memory. ") * 2
GRAMMARS = ['root ::= [0-9]+', 'root ::= "yes" | "no"', '%json_schema {"type": "integer"}',
            '%llguidance {}\nstart: /[a-z]+/', 'root ::= ("a" | "b") [0-9]']


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def one_cycle(c: Client, i: int) -> None:
    """Every kind of request once, plus refused ones, pipelined; every answer checked."""
    gid = f"g{i % 8}"
    c.send({"type": "grammar", "id": gid, "grammar": GRAMMARS[i % len(GRAMMARS)] + " " * (i % 13)})
    c.infer(0, f"Count: {i % 50},", maxTokens=2, temperature=0.7, seed=i,
            **({"grammar_id": gid} if i % 3 == 0 else {}))
    c.send({"type": "prefill", "seq_id": 1, "prompt": DOC[: 40 + i % 97]})
    scoring = i % 10 == 0  # a score asks for a 1 MB logits row per token: keep the cycle short
    if scoring:
        c.send({"type": "score", "seq_id": 3, "text": DOC[: 30 + i % 31]})
    c.send_raw(b'{"type":"infer","seq_id":4,"prompt":' + b"[" * 40 + b"]" * 40 + b"}\n")  # refused
    c.send({"type": "load", "seq_id": 5, "path": "missing.kv"})  # refused
    assert c.collect(1, timeout=300)[1]["type"] == "prefilled"
    name = f"soak{i % 4}.kv"
    for req in ({"type": "save", "seq_id": 1, "path": name}, {"type": "free", "seq_id": 1},
                {"type": "load", "seq_id": 1, "path": name}, {"type": "fork", "seq_id": 1, "dst_seq_id": 2},
                {"type": "infer", "seq_id": 2, "prompt": " And then", "maxTokens": 1, "temperature": 0},
                {"type": "free", "seq_id": 1}):
        c.send(req)
    assert [c.wait(1)["type"] for _ in range(5)] == ["saved", "freed", "loaded", "forked", "freed"]
    ends = [c.collect(sid)[1] for sid in (0, 2)]
    assert all(e["type"] == "done" for e in ends), ends
    if scoring:
        assert c.collect(3, timeout=300)[1]["type"] == "scored"
    assert c.collect(4)[1]["type"] == "error" and c.collect(5)[1]["type"] == "error"


def test_soak_rss_after_warm_up_is_bounded():
    c = spawn_server(nCtx=2048, nSeqMax=8, nBatch=256)
    t0 = time.monotonic()
    try:
        samples = []
        for i in range(SOAK_CYCLES):
            one_cycle(c, i)
            if i % 8 == 7:  # drain grammar answers (ready or error) in batches
                while not c.misc.empty():
                    c.misc.get_nowait()
            if i == WARM_UP or (i + 1) % 100 == 0:
                samples.append((i + 1, round(rss_mib(c.proc.pid), 1)))
        base = dict(samples)[WARM_UP + 1]
        end = samples[-1][1]
        print(f"soak: {SOAK_CYCLES} cycles in {time.monotonic() - t0:.0f} s; RSS MiB {samples}; "
              f"after warm-up +{end - base:.1f} MiB")
        assert end - base < RSS_BOUND_MIB, samples
        assert c.proc.poll() is None
    finally:
        c.close()
    assert c.proc.returncode == 0


def temp_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob(TEMP_PREFIX + "*"))


def test_kill_9_during_save_then_restart_leaves_no_temp_files(tmp_path):
    """Kill the server while a large save is being written; a restart sweeps the orphan."""
    state = tmp_path / "state"
    big = DOC * 12  # ~1,000 tokens: a state file of about 19 MB takes a while to write
    orphans = 0
    kills = 0
    # Whether a kill lands inside the write is a race (the poll below against the
    # writer's rename), so kill until one has (at most 8 servers; usually the first)
    # rather than a fixed 3 that a fast disk or a loaded machine can all lose.
    while orphans == 0 and kills < 8:
        c = spawn_server(nCtx=2048, nSeqMax=2, stateDir=str(state))
        try:
            c.request({"type": "prefill", "seq_id": 0, "prompt": big})
            c.send({"type": "save", "seq_id": 0, "path": "doc.kv"})
            deadline = time.monotonic() + 120
            while not temp_files(state) and time.monotonic() < deadline and c.proc.poll() is None:
                pass  # poll as fast as possible: kill while the temp file is being written
            os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait(60)
            kills += 1
            orphans += bool(temp_files(state))
        finally:
            c.close()
    print(f"kill -9 during save: {kills} kills, {orphans} left a temp file")
    assert orphans >= 1, "no kill landed during a write: the sweep was not exercised"
    c = spawn_server(nCtx=2048, nSeqMax=2, stateDir=str(state))
    try:
        assert temp_files(state) == []
        if (state / "doc.kv").exists():  # a save that finished before a kill is whole
            assert c.request({"type": "load", "seq_id": 0, "path": "doc.kv"})["type"] == "loaded"
    finally:
        c.close()


def test_concurrent_make_setup_on_one_cache_is_safe():
    """Two `make setup` at once on the shared build cache: both succeed (the cache lock
    and the bindings lock serialise them), and the bindings still load."""
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    procs = [subprocess.Popen(["make", "-s", "setup"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [p.communicate(timeout=1800)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    check = subprocess.run([sys.executable, "-c", "from clickpaca.llama.native import load; "
                            "print(load('mainline').info['build_number'])"],
                           capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0 and check.stdout.strip(), check.stderr
