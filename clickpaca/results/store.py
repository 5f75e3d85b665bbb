"""The local results database: one row per measured run, its raw samples, noise floors.

SQLite (the standard library's sqlite3) in WAL mode with a busy timeout, so two runs
that finish at the same moment are both kept; every write is one short transaction.
A run row is inserted as `running` when the command starts and set to `complete` or
`failed` when it ends: a process that dies in between leaves a row that `list` shows
as incomplete, never a half-written row that looks finished.

The schema carries its version in `schema_version` and migrates forward in order
(MIGRATIONS). A file that is not a readable SQLite database, or that was written by a
newer clickpaca, raises ResultsStoreError and is left exactly as it was.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..base.paths import cache_dir

#: Forward migrations: MIGRATIONS[i] takes the schema from version i to version i + 1.
MIGRATIONS: tuple[str, ...] = (
    # 1: runs and their raw samples
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        command TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('running', 'complete', 'failed')),
        started_utc TEXT NOT NULL,
        ended_utc TEXT,
        host TEXT,
        pid INTEGER,
        git_commit TEXT,
        git_dirty INTEGER,
        model_path TEXT,
        model_sha TEXT,
        builds TEXT,
        params TEXT NOT NULL,
        provenance TEXT NOT NULL,
        result TEXT,
        error TEXT
    );
    CREATE INDEX runs_command ON runs(command, started_utc);
    CREATE TABLE samples (
        run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        series TEXT NOT NULL,
        metric TEXT NOT NULL,
        n INTEGER NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (run_id, series, metric)
    );
    """,
    # 2: runs grouped by one invocation (`bench all`, `make kv-study`); noise floors
    """
    ALTER TABLE runs ADD COLUMN run_group TEXT;
    CREATE INDEX runs_group ON runs(run_group);
    CREATE TABLE noise_floor (
        model_sha TEXT NOT NULL,
        build TEXT NOT NULL,
        measure TEXT NOT NULL,
        value REAL NOT NULL,
        source TEXT,
        recorded_utc TEXT NOT NULL,
        PRIMARY KEY (model_sha, build, measure)
    );
    """,
    # 3: the start time of the recording process, so a reused pid is not taken for it
    """
    ALTER TABLE runs ADD COLUMN proc_start INTEGER;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


class ResultsStoreError(RuntimeError):
    """The results database cannot be used (the message says why and what to do)."""


def default_path() -> Path:
    """$CLICKPACA_RESULTS, else results.sqlite3 in the clickpaca cache (outside the checkout)."""
    env = os.environ.get("CLICKPACA_RESULTS")
    if env:
        return Path(env).expanduser()
    return cache_dir() / "results.sqlite3"


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _damaged(path: Path, e: Exception) -> ResultsStoreError:
    return ResultsStoreError(
        f"{path} is not a readable clickpaca results database ({e}). It was left untouched: "
        "move it aside (or set CLICKPACA_RESULTS to another file) and run again")


def schema_version(conn: sqlite3.Connection) -> int:
    has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    if not has:
        return 0
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: sqlite3.Connection, upto: int = SCHEMA_VERSION) -> int:
    """Apply the missing migrations up to `upto`, all in one transaction; the new version."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                     "applied_utc TEXT NOT NULL)")
        current = schema_version(conn)
        for v in range(current, upto):
            for stmt in MIGRATIONS[v].split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute("INSERT INTO schema_version VALUES (?, ?)", (v + 1, utc_now()))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return max(current, upto)


def pack(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype="<f8").tobytes()


def unpack(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<f8").copy()


def proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc; None elsewhere or if gone)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int | None, started: int | None) -> bool:
    """Whether the process that recorded the run still runs (same pid, same start time)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or proc_start(pid) == started


class Store:
    """An open results database (use as a context manager or call close())."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_path()
        existed = self.path.exists() and self.path.stat().st_size > 0
        if not existed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        except sqlite3.Error as e:
            raise ResultsStoreError(f"cannot open {self.path}: {e}") from e
        try:
            # A read first: on a damaged file this fails before anything is written.
            version = schema_version(self.conn)
            if version > SCHEMA_VERSION:
                raise ResultsStoreError(
                    f"{self.path} has results schema version {version}; this clickpaca reads up to "
                    f"{SCHEMA_VERSION}. Update clickpaca (the file was left untouched)")
            if existed:
                problem = self.conn.execute("PRAGMA quick_check").fetchone()[0]
                if problem != "ok":
                    raise sqlite3.DatabaseError(f"integrity check: {problem}")
            self.conn.execute("PRAGMA busy_timeout=60000")
            _set_wal(self.conn)
            self.conn.execute("PRAGMA foreign_keys=ON")
            if version < SCHEMA_VERSION:
                migrate(self.conn)
        except ResultsStoreError:
            self.conn.close()
            raise
        except sqlite3.DatabaseError as e:
            self.conn.close()
            raise _damaged(self.path, e) from e

    def close(self) -> None:
        self.conn.close()


    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction (taken at once: no lock upgrade deadlocks)."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as e:
            raise _damaged(self.path, e) from e
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------ writing a run

    def open_run(self, command: str, params: dict, provenance: dict, run_group: str | None = None) -> int:
        """Insert the run as `running`; its id."""
        git = provenance.get("git") or {}
        model = provenance.get("model") or {}
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO runs (command, status, started_utc, host, pid, proc_start, git_commit, git_dirty, "
                "model_path, model_sha, builds, params, provenance, run_group) "
                "VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (command, provenance.get("started_utc") or utc_now(), socket.gethostname(), os.getpid(),
                 proc_start(os.getpid()),
                 git.get("commit"), None if git.get("dirty") is None else int(bool(git["dirty"])),
                 model.get("path"), model.get("edge_sha256"),
                 ",".join(sorted(provenance.get("builds") or {})),
                 json.dumps(params, default=str), json.dumps(provenance, default=str), run_group))
            return int(cur.lastrowid)

    def close_run(self, run_id: int, result: dict | None, samples: dict[str, dict[str, Sequence[float]]],
                  provenance: dict, error: str | None = None, params: dict | None = None) -> None:
        """Store the result and samples and mark the run complete (or failed), in one transaction
        (params, when given, replace the ones known at the start)."""
        status = "failed" if error else "complete"
        with self._write() as c:
            for series, metrics in (samples or {}).items():
                for metric, values in metrics.items():
                    if values is None:
                        continue
                    c.execute("INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?)",
                              (run_id, str(series), metric, len(values), pack(values)))
            c.execute("UPDATE runs SET status=?, ended_utc=?, result=?, error=?, provenance=?, builds=? "
                      "WHERE id=?",
                      (status, provenance.get("ended_utc") or utc_now(),
                       None if result is None else json.dumps(result, default=str), error,
                       json.dumps(provenance, default=str),
                       ",".join(sorted(provenance.get("builds") or {})), run_id))
            if params is not None:
                c.execute("UPDATE runs SET params=? WHERE id=?", (json.dumps(params, default=str), run_id))

    def set_noise_floor(self, model_sha: str, build: str, measure: str, value: float,
                        source: str | None = None) -> None:
        with self._write() as c:
            c.execute("INSERT OR REPLACE INTO noise_floor VALUES (?, ?, ?, ?, ?, ?)",
                      (model_sha, build, measure, float(value), source, utc_now()))

    # ------------------------------------------------------------ reading

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        self.conn.row_factory = sqlite3.Row
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            raise _damaged(self.path, e) from e

    def noise_floor(self, model_sha: str | None, build: str | None, measure: str) -> float | None:
        if not model_sha or not build:
            return None
        rows = self._query("SELECT value FROM noise_floor WHERE model_sha=? AND build=? AND measure=?",
                           (model_sha, build, measure))
        return float(rows[0]["value"]) if rows else None

    def runs(self, command: str | None = None, model: str | None = None, build: str | None = None,
             since: str | None = None, until: str | None = None, text: str | None = None,
             group: str | None = None, limit: int | None = None) -> list[dict]:
        """Run rows, newest first (without result and samples), filtered."""
        where, args = [], []
        if command:
            where.append("command LIKE ?")
            args.append(f"{command}%")
        if model:
            where.append("(model_path LIKE ? OR model_sha LIKE ?)")
            args += [f"%{model}%", f"{model}%"]
        if build:
            where.append("builds LIKE ?")
            args.append(f"%{build}%")
        if since:
            where.append("started_utc >= ?")
            args.append(since)
        if until:
            where.append("started_utc < ?")
            args.append(until)
        if text:
            where.append("params LIKE ?")
            args.append(f"%{text}%")
        if group:
            where.append("run_group = ?")
            args.append(group)
        sql = ("SELECT id, command, status, started_utc, ended_utc, host, pid, proc_start, git_commit, git_dirty, "
               "model_path, model_sha, builds, params, run_group, error FROM runs")
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [self._row(r) for r in self._query(sql, args)]

    def run(self, run_id: int) -> dict:
        """One run with its provenance and result (ResultsStoreError when there is none)."""
        rows = self._query("SELECT * FROM runs WHERE id=?", (int(run_id),))
        if not rows:
            raise ResultsStoreError(f"no run {run_id} in {self.path}")
        rec = self._row(rows[0])
        rec["provenance"] = json.loads(rows[0]["provenance"])
        rec["result"] = json.loads(rows[0]["result"]) if rows[0]["result"] else None
        return rec

    def samples(self, run_id: int) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for r in self._query("SELECT series, metric, data FROM samples WHERE run_id=? ORDER BY rowid",
                             (int(run_id),)):
            out.setdefault(r["series"], {})[r["metric"]] = unpack(r["data"])
        return out

    @staticmethod
    def _row(r: sqlite3.Row) -> dict:
        rec = dict(r)
        rec["params"] = json.loads(rec["params"]) if rec.get("params") else {}
        if rec["status"] == "running":
            same_host = rec.get("host") == socket.gethostname()
            # a `running` row whose process is gone never finished
            alive = same_host and _pid_alive(rec.get("pid"), rec.get("proc_start"))
            rec["status"] = "running" if alive else "incomplete"
        return rec


def _set_wal(conn: sqlite3.Connection, wait_s: float = 60.0) -> None:
    """WAL mode. Switching a new file to it while another process does the same can answer
    "database is locked" at once (the busy timeout does not cover it): retry for a while."""
    end = time.monotonic() + wait_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > end:
                raise
            time.sleep(0.05)
