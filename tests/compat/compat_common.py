"""Helpers of the compat tests (imported by them and by conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAINLINE = ROOT / "builds" / "mainline"
MAINLINE_MANIFEST = MAINLINE / "bindings" / "manifest.json"


def compat_build() -> Path:
    value = os.environ.get("COMPAT_BUILD")
    if not value:
        pytest.skip("set COMPAT_BUILD=builds/compat-X (make test-compat does)")
    build = Path(value)
    if not build.is_absolute():
        build = ROOT / build
    assert (build / "build-info.json").exists(), (
        f"COMPAT_BUILD={value} is not a build: run `python3 native/build.py compat --sdist-version X`")
    return build


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def generate_bindings() -> tuple[Path, str]:
    """Generate the compat build's bindings, as `python -m bindgen B --against mainline`."""
    build = compat_build()
    args = ["-m", "bindgen", str(build)]
    if MAINLINE_MANIFEST.exists():
        args += ["--against", str(MAINLINE_MANIFEST)]
    proc = run(*args)
    assert proc.returncode == 0, f"bindgen failed on {build} (no hand edits allowed):\n{proc.stderr}"
    sys.stderr.write(proc.stdout)  # the change report, visible with -s
    return build, proc.stdout
