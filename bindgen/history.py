"""Manifest history, one file per (flavor, commit), shared by every checkout of the cache.

A build's change report compares it with the version before it. Keying the history by
flavor alone let every run overwrite the one file, so a compat build's report was later
rewritten against whichever version ran last. Here each version keeps its own manifest:

    $CLICKPACA_CACHE/manifests/<flavor>/<commit>.json

The baseline of a build is the most recently generated manifest of the same flavor with
another commit (the version you upgraded from); compat builds, which are older versions
checked against the current one, take the newest mainline manifest instead.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("CLICKPACA_CACHE", Path.home() / ".cache" / "clickpaca")) / "manifests"


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(part)) or "_"


def path_of(flavor: str, commit: str) -> Path:
    return root() / _safe(flavor) / f"{_safe(commit)}.json"


def save(manifest: dict) -> Path:
    """Keep this version's manifest (replacing only an earlier run of the same version)."""
    stamp = manifest["stamp"]
    path = path_of(stamp["flavor"], stamp["commit"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest) + "\n")
    tmp.replace(path)
    return path


def baseline(flavor: str, commit: str) -> Path | None:
    """The manifest a build of (flavor, commit) is reported against, if any."""
    base_flavor = "mainline" if flavor == "compat" else flavor
    d = root() / _safe(base_flavor)
    if not d.is_dir():
        return None
    others = [p for p in d.glob("*.json")
              if not (base_flavor == flavor and p.stem == _safe(commit))]
    return max(others, key=lambda p: p.stat().st_mtime_ns, default=None)
