"""Generate one build's cffi ABI-mode bindings from its own llama.h (and ggml-rpc.h).

    python -m bindgen                         # every build under builds/
    python -m bindgen builds/mainline         # one build
    python -m bindgen builds/mainline --against builds/compat-0.3.16   # report OLD -> NEW

Writes <build>/bindings/: _llama_cffi.py (out-of-line ABI module, imports in ~0.06 s,
stamped with the commit, build number and header/library sha256), manifest.json,
changes.txt and changes.json (the change report, see bindgen/report.py). The report runs
from the older version to the newer one (by build number): against --against (a manifest
or a build directory), else against the previous version in the manifest history
(bindgen/history.py: one manifest per flavor and commit).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cffi

from clickpaca.base.paths import cache_dir, sha256_file

from . import history, layout
from .cparse import (BindgenError, Declarations, add_macro_constants, deprecations,
                     integer_macros, parse, preprocess)
from .exports import ExportCheckError, unexported
from .manifest import build_manifest
from .report import build_report, render_text

BINDGEN_VERSION = "2"
MODULE = "_llama_cffi"
ROOT = Path(__file__).resolve().parent.parent


# The headers a build's bindings come from: llama.h (which includes ggml.h and
# ggml-backend.h), then the optional ones a build may lack (ggml-rpc.h exists only where
# the RPC backend was built).
HEADERS = ("llama.h",)
OPTIONAL_HEADERS = ("ggml-rpc.h",)


def bound_headers(include: Path) -> list[str]:
    """The headers of HEADERS and OPTIONAL_HEADERS that this include directory has."""
    return [*HEADERS, *(h for h in OPTIONAL_HEADERS if (include / h).exists())]


def parse_headers(include: Path, headers: list[str]) -> Declarations:
    """Preprocess and parse the headers as one translation unit (an umbrella header that
    includes them in order, so shared ggml declarations are read once), plus the integer
    macros of the optional headers (ggml-rpc.h states its protocol version only as
    #defines, which the preprocessor would otherwise drop)."""
    with tempfile.TemporaryDirectory(prefix="clickpaca-bindgen-") as tmp:
        umbrella = Path(tmp) / "clickpaca-bindings.h"
        umbrella.write_text("".join(f'#include "{h}"\n' for h in headers))
        top = include / headers[0] if len(headers) == 1 else umbrella
        decls = parse(preprocess(top, [include]), str(top))
    for h in headers:
        if h in OPTIONAL_HEADERS:
            add_macro_constants(decls, integer_macros((include / h).read_text(errors="replace")))
    return decls


def make_manifest(include: Path, stamp: dict[str, Any], libpath: Path | None,
                  keep: dict | None = None) -> tuple[dict[str, Any], int]:
    """Parse include/llama.h (and the optional headers present), check exports (when a
    library is given), build the manifest and prove its layouts against the compiler:
    (manifest, fields proved). `keep` receives the declarations (for writing the module)."""
    headers = bound_headers(include)
    stamp["headers"] = {h: sha256_file(include / h) for h in headers}  # the module's STAMP too
    decls = parse_headers(include, headers)
    ffi = cffi.FFI()
    ffi.cdef(decls.cdef)
    if libpath is not None:
        for name in unexported(libpath, decls.functions):
            # Declared in a header, defined in no library (ggml.h has had such declarations):
            # the cdef keeps it (accessing it raises), the manifest says it is not callable.
            del decls.functions[name]
            decls.signatures.pop(name, None)
            decls.skipped[name] = "declared in the header but exported by no library"
    manifest = build_manifest(ffi, decls, stamp)
    hints = deprecations("\n".join((include / h).read_text(errors="replace") for h in headers))
    manifest["deprecated"] = {k: v for k, v in sorted(hints.items()) if k in manifest["functions"]}
    n_fields = layout.prove(manifest["records"], headers, [include])
    if keep is not None:
        keep["decls"] = decls
    return manifest, n_fields


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest given as a file or as a build directory (its bindings/manifest.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "bindings" / "manifest.json"
    return json.loads(path.read_text())


def generate(build: Path, against: Path | None = None, quiet: bool = False,
             export_check: bool = True, full: bool = False, as_json: bool = False) -> dict:
    """Generate, prove and write the bindings of one build; return its manifest."""
    label = Path(build).name  # builds/compat-0.3.16, not the cache directory it links to
    build = build.resolve()
    info = json.loads((build / "build-info.json").read_text())
    include = build / "include"
    header = include / "llama.h"
    t0 = time.monotonic()
    stamp = {
        "flavor": info["flavor"],
        "commit": info["commit"],
        "build_number": info["build_number"],
        "llama_h_sha256": sha256_file(header),
        # (a missing library is reported by the export check, after the header is read)
        "libllama_sha256": sha256_file(lib) if (lib := build / "lib" / "libllama.so").exists() else None,
        "bindgen_version": BINDGEN_VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "export_check": "every declared function looked up in the library (own process)"
                        if export_check else "skipped (--no-export-check)",
    }
    keep: dict = {}
    manifest, n_fields = make_manifest(include, stamp, build / "lib" / "libllama.so"
                                       if export_check else None, keep)
    decls = keep["decls"]

    out = build / "bindings"
    tmp = Path(tempfile.mkdtemp(prefix=".bindings-", dir=build))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the bindings are read by whoever runs the build
    builder = cffi.FFI()
    builder.cdef(decls.cdef)
    builder.set_source(MODULE, None)
    with contextlib.redirect_stdout(sys.stderr):  # cffi says "generating ..."; stdout is the report
        builder.emit_python_code(str(tmp / f"{MODULE}.py"))
    with open(tmp / f"{MODULE}.py", "a") as f:
        f.write("\n# Written by bindgen/generate.py: the build these bindings belong to.\n")
        f.write(f"STAMP = {json.dumps(stamp, sort_keys=True)!r}\n")
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    base_path = against or history.baseline(info["flavor"], info["commit"])
    report = build_report(read_manifest(base_path) if base_path else None, manifest)
    text = render_text(report, full=full)
    (tmp / "changes.txt").write_text(render_text(report) + "\n")
    (tmp / "changes.json").write_text(json.dumps(report, indent=1) + "\n")
    # Several checkouts share one build cache: swap the directory under a lock so two
    # concurrent `make setup` runs never remove each other's bindings mid-rename.
    with open(build / ".bindings.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    history.save(manifest)
    if as_json:
        print(json.dumps(report, indent=1))
    elif not quiet:
        print(f"bindgen: {label}: {len(decls.functions)} functions, "
              f"{len(manifest['records'])} records ({n_fields} field offsets proved), "
              f"{len(decls.enums)} enums, {len(decls.callbacks)} callback types, "
              f"{len(decls.skipped)} skipped, in {time.monotonic() - t0:.1f} s")
        print(text)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bindgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", type=Path, help="build directories (default: builds/*)")
    ap.add_argument("--against", type=Path,
                    help="the other version: a manifest.json or a build directory")
    ap.add_argument("--full", action="store_true",
                    help="list ggml/gguf internals and offset-only moves one by one")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-export-check", action="store_true",
                    help="do not load the library to check its exports (a build that cannot "
                         "run here); recorded in the stamp")
    args = ap.parse_args(argv)
    # mainline first: the other builds' reports compare with it (bindgen/history.py)
    # Every build with headers: builds/peer holds only llama-server and its libraries.
    builds = args.builds or sorted((p for p in (ROOT / "builds").glob("*")
                                    if (p / "build-info.json").exists()
                                    and (p / "include" / "llama.h").exists()),
                                   key=lambda p: (p.name != "mainline", p.name))
    if not builds:
        print("bindgen: no builds found; run `make mainline` first", file=sys.stderr)
        return 1
    # One build under several names (builds/patched, turboquant, activations): generated once.
    seen: set[Path] = set()
    builds = [b for b in builds if not (b.resolve() in seen or seen.add(b.resolve()))]
    for b in builds:
        try:
            generate(b, args.against, export_check=not args.no_export_check,
                     full=args.full, as_json=args.json)
        except (BindgenError, layout.LayoutError, ExportCheckError) as e:
            print(f"bindgen: {b}: {e}", file=sys.stderr)
            return 1
    return 0
