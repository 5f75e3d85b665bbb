"""Generate one build's cffi ABI-mode bindings from its own llama.h.

    python -m bindgen                     # every build under builds/
    python -m bindgen builds/mainline     # one build
    python -m bindgen builds/x --against builds/mainline/bindings/manifest.json

Writes <build>/bindings/: _llama_cffi.py (out-of-line ABI module, imports in ~0.06 s,
stamped with the commit, build number and header/library sha256), manifest.json and
changes.txt (the change report against the previous manifest of the same flavor, kept
in $CLICKPACA_CACHE/manifests/, or against --against).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cffi

from clickpaca.paths import cache_dir, sha256_file

from . import layout
from .cparse import BindgenError, parse, preprocess
from .manifest import build_manifest, diff_manifests, format_report

BINDGEN_VERSION = "1"
MODULE = "_llama_cffi"
ROOT = Path(__file__).resolve().parent.parent


def unexported(ffi: cffi.FFI, libpath: Path, names) -> list[str]:
    """The declared functions dlsym cannot find in the library or its dependencies.

    Empty when the library cannot be loaded here (e.g. a GPU build on a machine without
    the driver): the check is then left to load time.
    """
    try:
        lib = ffi.dlopen(str(libpath))
    except OSError:
        return []
    errors = (AttributeError, getattr(ffi, "error", AttributeError))
    missing = []
    for name in names:
        try:
            getattr(lib, name)
        except errors:
            missing.append(name)
    ffi.dlclose(lib)
    return missing


def generate(build: Path, against: Path | None = None, quiet: bool = False) -> dict:
    """Generate, prove and write the bindings of one build; return its manifest."""
    build = build.resolve()
    info = json.loads((build / "build-info.json").read_text())
    include = build / "include"
    header = include / "llama.h"
    t0 = time.monotonic()
    decls = parse(preprocess(header, [include]), str(header))
    ffi = cffi.FFI()
    ffi.cdef(decls.cdef)
    stamp = {
        "flavor": info["flavor"],
        "commit": info["commit"],
        "build_number": info["build_number"],
        "llama_h_sha256": sha256_file(header),
        "libllama_sha256": sha256_file(build / "lib" / "libllama.so"),
        "bindgen_version": BINDGEN_VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in unexported(ffi, build / "lib" / "libllama.so", decls.functions):
        # Declared in a header, defined in no library (ggml.h has had such declarations):
        # the cdef keeps it (accessing it raises), the manifest says it is not callable.
        del decls.functions[name]
        decls.skipped[name] = "declared in the header but exported by no library"
    manifest = build_manifest(ffi, decls, stamp)
    n_fields = layout.prove(manifest["records"], ["llama.h"], [include])

    out = build / "bindings"
    tmp = Path(tempfile.mkdtemp(prefix=".bindings-", dir=build))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the bindings are read by whoever runs the build
    builder = cffi.FFI()
    builder.cdef(decls.cdef)
    builder.set_source(MODULE, None)
    builder.emit_python_code(str(tmp / f"{MODULE}.py"))
    with open(tmp / f"{MODULE}.py", "a") as f:
        f.write("\n# Written by bindgen/generate.py: the build these bindings belong to.\n")
        f.write(f"STAMP = {json.dumps(stamp, sort_keys=True)!r}\n")
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    history = cache_dir() / "manifests" / f"{info['flavor']}.json"
    old_path = against or (history if history.exists() else None)
    old = json.loads(old_path.read_text()) if old_path else None
    report = format_report(old["stamp"] if old else None, stamp,
                           diff_manifests(old or {}, manifest) if old else [])
    (tmp / "changes.txt").write_text(report + "\n")
    # Several checkouts share one build cache: swap the directory under a lock so two
    # concurrent `make setup` runs never remove each other's bindings mid-rename.
    with open(build / ".bindings.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    if against is None:
        history.parent.mkdir(parents=True, exist_ok=True)
        history.write_text(json.dumps(manifest) + "\n")
    if not quiet:
        print(f"bindgen: {build.name}: {len(decls.functions)} functions, "
              f"{len(manifest['records'])} records ({n_fields} field offsets proved), "
              f"{len(decls.enums)} enums, {len(decls.callbacks)} callback types, "
              f"{len(decls.skipped)} skipped, in {time.monotonic() - t0:.1f} s")
        print(report)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bindgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", type=Path, help="build directories (default: builds/*)")
    ap.add_argument("--against", type=Path, help="manifest.json to report changes against")
    args = ap.parse_args(argv)
    builds = args.builds or sorted(p for p in (ROOT / "builds").glob("*")
                                   if (p / "build-info.json").exists())
    if not builds:
        print("bindgen: no builds found; run `make mainline` first", file=sys.stderr)
        return 1
    for b in builds:
        try:
            generate(b, args.against)
        except (BindgenError, layout.LayoutError) as e:
            print(f"bindgen: {b}: {e}", file=sys.stderr)
            return 1
    return 0
