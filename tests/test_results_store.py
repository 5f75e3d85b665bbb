"""clickpaca.results.store and record: schema and migrations, damaged and newer files,
runs that crash or fail, two writers at once (real processes). No model needed."""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.cli import main
from clickpaca.results import record
from clickpaca.results.store import (
    SCHEMA_VERSION,
    ResultsStoreError,
    Store,
    default_path,
    migrate,
    proc_start,
    schema_version,
)


def _schema(path) -> set[tuple[str, str]]:
    conn = sqlite3.connect(path)
    try:
        return {(n, s) for n, s in conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")}
    finally:
        conn.close()


def _record(db, monkeypatch, data, command="bench decode", **params):
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    with record.recording(command, argparse.Namespace(**params)) as state:
        record.attach(command.split()[-1], data)
    return state["id"]


def test_default_path_is_outside_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("CLICKPACA_RESULTS", raising=False)
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "results.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(tmp_path / "x.db"))
    assert default_path() == tmp_path / "x.db"


def test_new_store_is_current_and_wal(tmp_path):
    db = tmp_path / "r.sqlite3"
    with Store(db) as s:
        assert schema_version(s.conn) == SCHEMA_VERSION
        assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@settings(max_examples=len(range(SCHEMA_VERSION + 1)) * 2, deadline=None)
@given(st.integers(0, SCHEMA_VERSION))
def test_migrating_forward_from_any_version_keeps_runs_and_reaches_the_same_schema(tmp_path_factory, start):
    d = tmp_path_factory.mktemp("mig")
    fresh = d / "fresh.sqlite3"
    Store(fresh).close()
    old = d / "old.sqlite3"
    conn = sqlite3.connect(old, isolation_level=None)
    migrate(conn, upto=start)
    if start >= 1:
        conn.execute("INSERT INTO runs (command, status, started_utc, params, provenance) "
                     "VALUES ('ppl', 'complete', '2026-11-23T10:00:00Z', '{}', '{}')")
    conn.close()
    with Store(old) as s:
        assert schema_version(s.conn) == SCHEMA_VERSION
        runs = s.runs()
    assert _schema(old) == _schema(fresh)
    assert [r["command"] for r in runs] == (["ppl"] if start >= 1 else [])


def test_a_newer_schema_is_refused_and_left_alone(tmp_path):
    db = tmp_path / "r.sqlite3"
    Store(db).close()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("INSERT INTO schema_version VALUES (?, 'later')", (SCHEMA_VERSION + 1,))
    conn.close()
    before = db.read_bytes()
    with pytest.raises(ResultsStoreError, match="Update clickpaca"):
        Store(db)
    assert db.read_bytes() == before


def _page_size(data: bytes) -> int:
    """The page size from the database header (bytes 16-17, big-endian; 1 means 65536)."""
    size = int.from_bytes(data[16:18], "big")
    return 65536 if size == 1 else size


def _btree_header(data: bytes, page: int) -> tuple[int, int]:
    """(offset, length) of page ``page``'s b-tree page header: page 1's starts after the
    100-byte database header, other pages' at (page - 1) * page size; 12 bytes for an
    interior page (types 2 and 5), 8 for a leaf (10 and 13)."""
    start = 100 if page == 1 else (page - 1) * _page_size(data)
    kind = data[start]
    assert kind in (2, 5, 10, 13), f"page {page} is not a b-tree page (type {kind})"
    return start, 12 if kind in (2, 5) else 8


def _recorded_store(db, monkeypatch, n_samples=500) -> None:
    """A store with one recorded run, checkpointed and closed: the whole database in the file."""
    rid = _record(db, monkeypatch, {"params": {}, "rows": [{"tps": {"median": 1.0, "samples": [1.0] * n_samples}}]})
    assert rid == 1
    with Store(db) as s:
        s.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert not os.path.exists(f"{db}-wal") or os.path.getsize(f"{db}-wal") == 0


def _root_page(db, name: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (name,)).fetchone()[0])
    finally:
        conn.close()


# Every damage lands on a structure SQLite reads on every open of the store (the header,
# or the b-tree page header of a page in use: the store's quick_check walks every b-tree),
# so what the record holds (timings, the machine's name) cannot move it onto unused bytes.
@pytest.mark.parametrize("damage", ["garbage", "database header", "page 1 b-tree header",
                                    "runs root b-tree header", "samples root b-tree header"])
def test_a_damaged_file_gets_a_clear_error_and_is_never_overwritten(tmp_path, monkeypatch, capsys, damage):
    db = tmp_path / "r.sqlite3"
    if damage == "garbage":
        db.write_bytes(b"these are not the bytes of a database\n" * 200)
    else:
        _recorded_store(db, monkeypatch)
        data = bytearray(db.read_bytes())
        if damage == "database header":
            start, n = 0, 100
        else:
            page = 1 if damage.startswith("page 1") else _root_page(db, damage.split()[0])
            start, n = _btree_header(data, page)
        data[start:start + n] = bytes(n)
        db.write_bytes(bytes(data))
    before = db.read_bytes()
    with pytest.raises(ResultsStoreError, match="left untouched"):
        Store(db)
    # the command line: a clear message, exit code 2, and a run refuses to start
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    assert main(["results", "list"]) == 2
    assert "not a readable clickpaca results database" in capsys.readouterr().err
    ran = []
    with pytest.raises(ResultsStoreError):
        with record.recording("bench decode", argparse.Namespace()):
            ran.append(1)
    assert not ran
    assert db.read_bytes() == before


def _unused_region(db, monkeypatch, where: str) -> tuple[int, int]:
    """(offset, length) of bytes the database does not use, found from the file's
    structure: a freelist leaf page (a run's big samples recorded, then deleted: their
    overflow pages go to the freelist; header bytes 32-35 name the first trunk page, whose
    bytes 4-7 count its leaves and 8.. list them), or page 1's unallocated space (between
    the end of its cell pointer array and the start of its cell content area)."""
    if where == "freelist page":
        _recorded_store(db, monkeypatch, n_samples=20000)  # 160 kB of samples: overflow pages
        _record(db, monkeypatch, {"params": {}, "rows": [{"tps": {"median": 2.0, "samples": [2.0] * 5}}]})
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("DELETE FROM samples WHERE run_id=1")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        data = db.read_bytes()
        size = _page_size(data)
        trunk = int.from_bytes(data[32:36], "big")
        assert trunk and int.from_bytes(data[36:40], "big") >= 2, "no free pages"
        t0 = (trunk - 1) * size
        assert int.from_bytes(data[t0 + 4:t0 + 8], "big") >= 1, "the trunk lists no leaf"
        leaf = int.from_bytes(data[t0 + 8:t0 + 12], "big")
        return (leaf - 1) * size, size
    _recorded_store(db, monkeypatch)
    data = db.read_bytes()
    start, n = _btree_header(data, 1)
    cells = int.from_bytes(data[start + 3:start + 5], "big")
    content = int.from_bytes(data[start + 5:start + 7], "big") or 65536
    lo = start + n + 2 * cells
    assert content > lo, "page 1 has no unallocated space"
    return lo, content - lo


@pytest.mark.parametrize("where", ["freelist page", "page 1 unallocated space"])
def test_damage_to_unused_space_leaves_the_store_working(tmp_path, monkeypatch, where):
    """The converse: garbage where SQLite keeps nothing (located from the file's
    structure, not by luck) is no damage: the store opens, its runs and samples read
    back, and new runs are recorded."""
    db = tmp_path / "r.sqlite3"
    start, n = _unused_region(db, monkeypatch, where)
    data = bytearray(db.read_bytes())
    data[start:start + n] = (b"\xa5\x5a" * n)[:n]
    db.write_bytes(bytes(data))
    with Store(db) as s:
        assert s.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        runs = s.runs()
        kept, value, n = (2, 2.0, 5) if where == "freelist page" else (1, 1.0, 500)
        assert [r["id"] for r in runs] == ([2, 1] if where == "freelist page" else [1])
        assert s.samples(kept)["rows/0/tps"]["rounds"].tolist() == [value] * n
    rid = _record(db, monkeypatch, {"params": {}, "rows": [{"tps": {"median": 3.0, "samples": [3.0] * 3000}}]})
    with Store(db) as s:
        assert s.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert s.run(rid)["status"] == "complete"
        assert len(s.runs()) == len(runs) + 1


def test_a_failing_command_is_recorded_as_failed(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    with pytest.raises(RuntimeError, match="boom"):
        with record.recording("bench decode", argparse.Namespace(tokens=8)):
            raise RuntimeError("boom")
    with Store(db) as s:
        [run] = s.runs()
        assert run["status"] == "failed" and "boom" in run["error"]
        assert s.run(run["id"])["provenance"]["ended_utc"]


CRASH = textwrap.dedent("""
    import argparse, os, sys
    from clickpaca.results import record
    with record.recording("bench decode", argparse.Namespace(tokens=8)) as state:
        print(state["id"], flush=True)
        os._exit(9)  # a crash: no finally, no close
""")


def test_a_crashed_run_stays_incomplete(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    p = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr
    rid = int(p.stdout.strip())
    with Store(db) as s:
        [run] = s.runs()
        assert run["id"] == rid and run["status"] == "incomplete" and run["ended_utc"] is None
        assert s.run(rid)["result"] is None
        # a live process that only reuses the pid is not the recording one
        s.conn.execute("UPDATE runs SET pid=?", (os.getpid(),))
        assert s.runs()[0]["status"] == "incomplete"
        s.conn.execute("UPDATE runs SET proc_start=?", (proc_start(os.getpid()),))
        assert s.runs()[0]["status"] == "running"
    assert main(["results", "compare", str(rid), str(rid)]) == 2  # nothing finished to compare


WRITER = textwrap.dedent("""
    import argparse, os, sys, time
    from pathlib import Path
    from clickpaca.results import record
    who, n, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.01)
    for i in range(n):
        with record.recording("bench decode", argparse.Namespace(tokens=i, who=who)):
            record.attach("decode", {"params": {"who": who, "i": i},
                                     "llama_bench_tg": {"median": i, "samples": [float(i)] * 50}})
""")


def test_two_writers_at_once_are_both_kept(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite3"
    go = tmp_path / "go"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    n = 15
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, who, str(n), str(go)], stderr=subprocess.PIPE,
                              text=True) for who in ("a", "b")]
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    with Store(db) as s:
        runs = s.runs()
        assert len(runs) == 2 * n and {r["status"] for r in runs} == {"complete"}
        for who in ("a", "b"):
            mine = sorted(r["params"]["tokens"] for r in runs if r["params"]["who"] == who)
            assert mine == list(range(n))
        for r in runs:
            rounds = s.samples(r["id"])["llama_bench_tg"]["rounds"]
            assert list(rounds) == [float(r["params"]["tokens"])] * 50


def test_provenance_of_a_recorded_run(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite3"
    rid = _record(db, monkeypatch, {"params": {"tokens": 8}}, tokens=8, build="mainline")
    with Store(db) as s:
        run = s.run(rid)
    p = run["provenance"]
    assert run["status"] == "complete" and run["params"] == {"tokens": 8, "build": "mainline"}
    assert len(p["git"]["commit"]) == 40 and p["git"]["dirty"] in (True, False)
    assert run["git_commit"] == p["git"]["commit"]
    assert p["machine"]["cores"] >= 1 and p["machine"]["mem_gib"] > 0
    assert len(p["loadavg_start"]) == 3 and len(p["loadavg_end"]) == 3
    assert p["started_utc"] <= p["ended_utc"]
    assert "mainline" in p["builds"]


def test_emit_outside_a_recording_records_a_run_of_its_own(tmp_path, monkeypatch, capsys):
    """A bench called from Python (not through the command line) is recorded too, and its
    JSON export names the run and leaves the per-token samples in the store."""
    import json

    from clickpaca.results.report import emit

    db = tmp_path / "r.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    data = {"params": {"tokens": 4}, "rows": [{"seqs": 1, "tps": {"median": 2.0, "samples": [1.0, 2.0, 3.0]}}],
            "samples": {"f16": {"token_nll": [0.5, 1.5]}}}
    emit(str(tmp_path / "out"), "peer", data, "| t |", "A new bench")
    exported = json.loads((tmp_path / "out" / "peer.json").read_text())
    assert "samples" not in exported
    with Store(db) as s:
        [run] = s.runs()
        assert exported["results_run"] == run["id"] and run["command"] == "bench peer"
        assert run["status"] == "complete"
        smp = s.samples(run["id"])
    assert list(smp["rows/seqs=1/tps"]["rounds"]) == [1.0, 2.0, 3.0]
    assert list(smp["f16"]["token_nll"]) == [0.5, 1.5]


def test_bench_all_records_each_bench_in_one_group(tmp_path, monkeypatch):
    """`bench all` dispatches every bench inside its own recording, all in one group (the
    benches here are stand-ins that only emit, and their checks before work, which need the
    native tools, are tests/test_checks.py's: the real set takes minutes)."""
    from clickpaca.measure.bench import benches
    from clickpaca.measure.bench import cli as bench_cli
    from clickpaca.results.report import emit

    def emits(self, args):
        emit(str(tmp_path / "out"), self.name, {"params": {"repeats": args.repeats}}, "|x|", self.name)

    db = tmp_path / "r.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(db))
    monkeypatch.delenv("CLICKPACA_RUN_GROUP", raising=False)
    monkeypatch.setattr(benches.Bench, "run", emits)
    monkeypatch.setattr(bench_cli, "check", lambda args, needs: None)
    args = argparse.Namespace(what="all", repeats=1, tokens=None, seqs=None, prompt_tokens=None, cache=None,
                              out=str(tmp_path / "out"), model=None, build="mainline")
    assert bench_cli.run_bench(args) == 0
    with Store(db) as s:
        runs = s.runs()
    assert sorted(r["command"] for r in runs) == sorted(f"bench {b.name}" for b in benches.in_all())
    assert {r["status"] for r in runs} == {"complete"}
    [group] = {r["run_group"] for r in runs}
    assert group.startswith("bench-all-")
