"""`clickpaca kv-retrieval`, short, on the real model: one haystack length, a few needles,
f16 on the mainline build. The needle is really used (f16's answer log-probability with the
needle above that of the same haystack with the needles removed), every question of each
setup came from one prefill, and the run is recorded in the results store. About 30 s on
2 idle cores (two prefills of 1,024 tokens)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from clickpaca.results.store import Store

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("retrieval")
    db = d / "results.sqlite3"
    env = dict(os.environ, CLICKPACA_RESULTS=str(db), OMP_WAIT_POLICY="passive")
    p = subprocess.run([sys.executable, "-m", "clickpaca", "kv-retrieval", "--cache", "f16",
                        "--lengths", "1024", "--needles", "3", "--out", str(d / "out")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rid = int(re.search(r"\[results\] run (\d+) complete", p.stderr).group(1))
    return db, rid, json.loads((d / "out" / "kv-retrieval.json").read_text()), p.stdout


def test_f16_uses_the_needle(run):
    _, _, out, _ = run
    recs = out["needle_records"]
    with_needle = {r["needle"]: r["answer_logp"] for r in recs if r["setup"] == "f16"}
    without = {r["needle"]: r["answer_logp"] for r in recs if r["setup"] == "f16, needles removed"}
    assert sorted(with_needle) == sorted(without) == [0, 1, 2]
    for i in with_needle:
        assert with_needle[i] > without[i], (i, with_needle[i], without[i])


def test_every_setup_answered_every_question_of_one_haystack(run):
    _, _, out, _ = run
    recs = out["needle_records"]
    for setup in ("f16", "f16, needles removed"):
        mine = [r for r in recs if r["setup"] == setup]
        assert [r["needle"] for r in mine] == [0, 1, 2]
        assert all(r["length"] == 1024 and 0 < r["depth"] < 1 for r in mine)
        assert all(r["answer_logp"] < 0 and r["answer_tokens"] >= 1 for r in mine)
    # the base's rows are the ones KL is measured against: its KL against itself is exactly 0
    assert all(r["kl_f16"] == 0.0 for r in recs if r["setup"] == "f16")
    assert sum(r["exact"] for r in recs if r["setup"] == "f16, needles removed") == 0  # nothing to copy from
    # one prefill per setup: one timing per (setup, length)
    assert sorted(t["setup"] for t in out["timings"]) == ["f16", "f16, needles removed"]


def test_the_run_is_recorded_with_its_per_needle_samples(run):
    db, rid, out, stdout = run
    with Store(db) as s:
        r, smp = s.run(rid), s.samples(rid)
    assert r["status"] == "complete" and r["command"] == "kv-retrieval"
    assert r["params"]["lengths"] == [1024] and r["params"]["needles"] == 3
    assert len(smp["f16"]["answer_logp"]) == len(smp["f16"]["exact"]) == 3
    assert list(smp["f16"]["answer_logp"]) == [x["answer_logp"] for x in out["needle_records"]
                                                if x["setup"] == "f16"]
    assert "Retrieval from a held haystack" in stdout and "f16, needles removed" in stdout


def test_a_study_stopped_by_sigterm_records_the_setups_it_finished(tmp_path):
    """SIGTERM to the command (its guarded parent passes it on) during the third setup:
    exit 130, the run recorded failed with the base's and the control's rows and samples,
    and the note naming every setup that did not run."""
    import signal
    import time

    db = tmp_path / "results.sqlite3"
    log = tmp_path / "log"
    env = dict(os.environ, CLICKPACA_RESULTS=str(db), OMP_WAIT_POLICY="passive")
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "clickpaca", "kv-retrieval", "--cache", "f16,q8_0",
                              "--lengths", "1024", "--needles", "2", "--noise", "--out", str(tmp_path / "out")],
                             stdout=subprocess.DEVNULL, stderr=f, env=env)
    deadline = time.monotonic() + 600
    while "prompt chunks of 64" not in log.read_text():
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 130, log.read_text()[-3000:]
    rid = int(re.search(r"\[results\] run (\d+) failed", log.read_text()).group(1))
    with Store(db) as s:
        r, smp = s.run(rid), s.samples(rid)
    assert r["status"] == "failed" and "stopped (SIGTERM) during prompt chunks of 64" in r["error"]
    assert "q8_0 at 1024" in r["error"] and "weights not repacked at 1024" in r["error"]
    assert sorted(smp) == ["f16", "f16, needles removed"]
    out = json.loads((tmp_path / "out" / "kv-retrieval.json").read_text())
    assert [x["cache"] for x in out["rows"] if x["length"] == 1024] == ["f16", "f16, needles removed"]
