"""Where clickpaca keeps what it downloads and builds, and how it fingerprints files.

One place for the `$CLICKPACA_CACHE` lookup and the file digest, used by the runtime
(models, corpus, results store, build stamps) and by bindgen. native/build.py keeps
its own copies: it runs before any venv exists and imports the standard library only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """$CLICKPACA_CACHE, else ~/.cache/clickpaca (shared by every checkout)."""
    return Path(os.environ.get("CLICKPACA_CACHE", Path.home() / ".cache" / "clickpaca"))


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: The builds the Makefile has a target of their own for (`make activations`, ...).
MAKE_TARGETS = ("mainline", "patched", "turboquant", "activations", "kvcenter")


def make_target(build: str) -> str:
    """The `make` target that makes build ``build``: its own name for the builds above,
    `setup` for any other."""
    return build if build in MAKE_TARGETS else "setup"

