"""Where a run's numbers came from: code, build, model, machine and time.

Captured once when a run starts (and the machine's load again when it ends), so two
records can be told apart, or found comparable, long after the checkout, the build
cache or the machine changed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from ..llama.native import REPO, build_dir


def clickpaca_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("clickpaca")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return None


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """Commit and dirty flag of the checkout clickpaca runs from (None outside git)."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "branch": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip()),
            "branch": branch.strip() if branch else None}


def build_info(name: str) -> dict[str, Any] | None:
    """The build-info.json of a build (flavor, llama.cpp commit and build number, preset, cache key)."""
    p = build_dir(name) / "build-info.json"
    try:
        info = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    keep = ("flavor", "preset", "key", "commit", "build_number", "origin", "patches_sha256",
            "libllama_sha256", "built_at")
    return {k: info.get(k) for k in keep} | {"dir": str(p.parent.resolve())}


def model_file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """Size and the hash of the first and last MiB: the file part of kvstate.model_identity
    (the same algorithm, so a results record and a state file name a model the same way)."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return {"path": str(p.resolve()), "file": p.name, "size": size, "edge_sha256": h.hexdigest()}


def machine() -> dict[str, Any]:
    """Where and when the numbers were measured (load average: the machine may be shared)."""
    cpu = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": mem_gib, "accelerator": None,
            "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": list(os.getloadavg()),
            "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def capture(model_path: str | None, builds: list[str]) -> dict[str, Any]:
    """Everything known about a run before it starts."""
    m = machine()
    model = None
    if model_path:
        try:
            model = model_file_identity(model_path)
        except OSError as e:
            model = {"path": str(model_path), "error": str(e)}
    return {"clickpaca_version": clickpaca_version(), "git": git_state(),
            "builds": {b: build_info(b) for b in sorted(set(builds))}, "model": model,
            "machine": {k: v for k, v in m.items() if k not in ("loadavg", "utc")},
            "loadavg_start": m["loadavg"], "started_utc": m["utc"],
            "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "CLICKPACA_MODEL") if os.environ.get(k)}}


def finish(prov: dict[str, Any], builds: list[str] | None = None) -> dict[str, Any]:
    """The provenance with the end time, the load at the end and any builds learnt on the way."""
    m = machine()
    out = dict(prov)
    out["loadavg_end"] = m["loadavg"]
    out["ended_utc"] = m["utc"]
    if builds:
        out["builds"] = dict(prov.get("builds") or {})
        for b in builds:
            if b not in out["builds"]:
                out["builds"][b] = build_info(b)
    return out
