"""An earlier commit's tree beside this one, for `bench sampler|batch --against REV`.

`git archive REV` of a part of the package into a temporary directory: batch runs REV's
whole server from there (`server_env`: REV's package first on the path, the working
directory never, this checkout's builds), sampler imports REV's clickpaca/sampling as a
package of its own (sampler_against.py). Both sides then share the same alternating rounds.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from ...llama.native import builds_root

ROOT = Path(__file__).resolve().parents[3]


def extract(rev: str, into: Path, part: str = "clickpaca") -> Path:
    """REV's `part` (a path in the repository) under ``into``; returns ``into``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, part],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def server_env(root: Path) -> dict[str, str]:
    """The environment of a `clickpaca serve` that runs the package under ``root``: it
    first on the path and the working directory off it (PYTHONSAFEPATH: `python -m` would
    otherwise put this checkout first), on this checkout's builds."""
    return {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1", "CLICKPACA_BUILDS": str(builds_root())}
