"""llama.cpp header versions, checked without building them.

Whether bindgen survives an upgrade depends on the headers alone: parse them, generate the
cffi declarations and the manifest, and prove every record's layout against the C
compiler. This module gets the headers of a pinned llama-cpp-python sdist (downloaded by
pip into the build cache, sha256-checked against native/llama-cpp.lock, exactly as
native/build.py does) and of our patch sets applied to the current pin (the turboquant and
activations flavors).

    python -m bindgen.versions                 # every version: one line each
    python -m bindgen.versions 0.3.16 0.3.36   # the change report from 0.3.16 to 0.3.36
    python -m bindgen.versions --features      # the feature table of every version (Markdown)

Only the headers and the vendored tree's git metadata (commit, build number) are taken
out of the archive: a few MB out of 50-80, cached under $CLICKPACA_CACHE/headers/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The llama-cpp-python releases whose vendored llama.cpp `make test` verifies:
# b4094 (Nov 2024), b5308 (May 2025), b6170 (Aug 2025), b11312 (the current pin).
VERSIONS = ["0.3.2", "0.3.9", "0.3.16", "0.3.36"]
TURBOQUANT = "turboquant"
# The patched builds of the current pin by the names they are loaded by (native/build.py
# BUILD_NAMES: one patched flavor holds every patch set), checked from their headers.
PATCHED = (TURBOQUANT, "activations", "kvcenter")


def _load_by_path(name: str, path: Path) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def native_build() -> Any:
    """native/build.py (standard library only; it is a script, not a package module)."""
    return _load_by_path("clickpaca_native_build", ROOT / "native" / "build.py")


def sdist_archive(version: str) -> Path:
    """The sdist of one version, from the cache or the registry, sha256-checked."""
    nb = native_build()
    lock = nb.read_lock()
    sha = lock["sha256"] if version == lock["version"] else lock.get(f"sha256.{version}")
    if sha is None:
        raise nb.BuildError(f"native/llama-cpp.lock pins no sha256 for llama-cpp-python {version}")
    return nb.fetch_sdist(lock["package"], version, f"llama_cpp_python-{version}.tar.gz", sha)


def _wanted(member: str, top: str, subdir: str) -> bool:
    rel = member[len(top) + 1:] if member.startswith(top + "/") else None
    if rel is None:
        return False
    if rel == f"{subdir}/.git":
        return True  # the gitfile pointing at the module below
    git_module = f".git/modules/{subdir}/"
    if rel.startswith(git_module):
        return not rel[len(git_module):].startswith("modules/")  # not nested submodules
    for d in ("include", "ggml/include"):
        prefix = f"{subdir}/{d}/"
        if rel.startswith(prefix) and rel.endswith(".h") and "/" not in rel[len(prefix):]:
            return True
    return False


def header_tree(version: str) -> Path:
    """A directory with the version's headers (include/, ggml/include/) and git metadata."""
    nb = native_build()
    subdir = nb.read_lock()["subdir"]
    stem = f"llama_cpp_python-{version}"
    dest = nb.cache_dir() / "headers" / stem
    marker = dest / ".clickpaca-extracted"
    if not marker.exists():
        archive = sdist_archive(version)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if _wanted(m.name, stem, subdir)]
            tar.extractall(dest, members=members, filter="data")
        marker.write_text(archive.name + "\n")
    src = dest / stem / subdir
    if not (src / "include" / "llama.h").exists():
        raise FileNotFoundError(f"{stem} has no {subdir}/include/llama.h")
    return src


def flat_include(src: Path, out: Path, texts: dict[Path, str] | None = None) -> Path:
    """include/ and ggml/include/ headers in one directory, as a build's include/ holds
    them; `texts` replaces some files' contents (a patch set's header edits)."""
    out.mkdir(parents=True, exist_ok=True)
    for d in ("include", "ggml/include"):
        for h in sorted((src / d).glob("*.h")):
            text = (texts or {}).get(h.resolve())
            (out / h.name).write_text(text if text is not None else h.read_text())
    return out


def patched_include(name: str) -> Path:
    """The current pin's headers with a patched build's header edits (every patch set its
    flavor holds)."""
    nb = native_build()
    flavor = nb.FLAVOR_OF[name]
    lock = nb.read_lock()
    archive = sdist_archive(lock["version"])
    src = nb.extract_sdist(archive, lock["subdir"])  # the patch plan reads the whole tree
    texts: dict[Path, str] = {}
    for name in nb.PATCH_SETS[flavor]:  # in the build's order, each set over the earlier ones' texts
        apply = _load_by_path(f"clickpaca_{name}_apply", ROOT / "native" / name / "apply.py")
        texts.update(apply.PATCH.plan(src.resolve(), texts))
    digest = nb.patches_digest(nb.patch_files(flavor))[:16]
    return flat_include(src, nb.cache_dir() / "headers" / f"{flavor}-{digest}" / "include", texts)


def include_of(version: str) -> tuple[Path, dict[str, Any]]:
    """(include dir, stamp) of a version name: an sdist version or a PATCHED flavor."""
    nb = native_build()
    lock = nb.read_lock()
    if version in PATCHED:
        include = patched_include(version)
        return include, {"flavor": version, "commit": lock["commit"],
                         "build_number": int(lock["build_number"]), "sdist": lock["version"]}
    src = header_tree(version)
    include = flat_include(src, src.parent.parent / "flat-include")
    ident = nb.git_identity(src, lock)
    if version == lock["version"]:
        ident.update(commit=lock["commit"], build_number=int(lock["build_number"]))
    return include, {"flavor": "mainline" if version == lock["version"] else "compat",
                     "commit": ident["commit"], "build_number": ident["build_number"],
                     "sdist": version}


def manifest_of(version: str) -> tuple[dict[str, Any], int]:
    """Parse, generate and prove one version's headers: (manifest, fields proved)."""
    from .generate import make_manifest
    include, stamp = include_of(version)
    stamp["export_check"] = "not run: headers only, no library"
    return make_manifest(include, stamp, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bindgen.versions", description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="sdist versions or a patched flavor, 'turboquant' or 'activations' (default: all; "
                    "two: the change report from the first to the second)")
    ap.add_argument("--full", action="store_true", help="list ggml/gguf and offset-only changes too")
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    ap.add_argument("--features", action="store_true",
                    help="the feature table (clickpaca/llama/features.py) of the versions, as Markdown")
    args = ap.parse_args(argv)
    from .report import build_report, render_text
    if args.features:
        from .feature_table import markdown
        print(markdown({v: manifest_of(v)[0] for v in args.versions or VERSIONS}))
        return 0
    if len(args.versions) == 2:
        old, _ = manifest_of(args.versions[0])
        new, _ = manifest_of(args.versions[1])
        rep = build_report(old, new)
        print(json.dumps(rep, indent=1) if args.json else render_text(rep, full=args.full))
        return 0
    for v in args.versions or [*VERSIONS, *PATCHED]:
        t0 = time.monotonic()
        m, n_fields = manifest_of(v)
        s = m["stamp"]
        print(f"{v}: {s['flavor']} commit {s['commit']} build {s['build_number']}: "
              f"{len(m['functions'])} functions, {len(m['records'])} records "
              f"({n_fields} field offsets proved), {len(m['enums'])} enums "
              f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
