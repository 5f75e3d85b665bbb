#!/usr/bin/env python3
"""The CUDA side of a `linux-cuda` build: which toolkit, which GPU architecture, which key.

Why a module of its own: a GPU build needs three things a CPU build does not (nvcc, the
GPU's compute capability, a CUDA runtime to link), each of which can be missing, and a
GPU build must never be taken for a CPU one from the cache. build.py asks this module for
the CMake options of a CUDA preset (they are part of the build's key) and for nothing else.

The toolkit is the machine's (CUDACXX, CUDA_HOME / CUDA_PATH, or nvcc on PATH), or one
assembled from the package registry into the cache, outside the checkout:

    python3 native/cudakit.py toolkit      # installs the pinned CUDA wheels, prints the root
    CUDA_HOME=$(python3 native/cudakit.py toolkit) CUDA_ARCH=90 \
        python3 native/build.py mainline --preset linux-cuda --only-tools ""

The registry's CUDA 12 nvcc package holds ptxas alone (no nvcc driver, no cicc), so the
registry toolkit is CUDA 13.0, whose wheels hold the whole compiler. The wheels carry no
libcuda.so (the driver's library, which ggml-cuda links for its virtual memory pool): the
root gets a link-time stub, generated from cuda.h, in lib/stubs (where CMake's
FindCUDAToolkit looks when no driver is installed); at run time the driver's real
libcuda.so.1 is loaded. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Presets that compile ggml's CUDA backend (CMakePresets.json).
CUDA_PRESETS = ("linux-cuda",)
# The registry toolkit: the wheels and their pinned versions, one CUDA release.
REGISTRY_CUDA = "13.0"
REGISTRY_WHEELS = {
    "nvidia-cuda-nvcc": "13.0.88",     # nvcc, ptxas, fatbinary, nvlink, cudafe++
    "nvidia-cuda-crt": "13.0.88",      # nvcc's crt/ headers
    "nvidia-nvvm": "13.0.88",          # cicc and libnvvm
    "nvidia-cuda-runtime": "13.0.96",  # cudart and its headers
    "nvidia-cublas": "13.0.2.14",      # cuBLAS (ggml-cuda's matrix products)
    "nvidia-cuda-cccl": "13.0.85",     # CUB / Thrust headers
}
# The one-line answer when no nvcc is found (prereqs.py prints it, build.py raises it).
NO_NVCC = ("the linux-cuda preset needs nvcc, the CUDA compiler, and none was found "
           "(CUDACXX, CUDA_HOME, CUDA_PATH, PATH): install a CUDA toolkit, or assemble one from "
           "the package registry with `CUDA_HOME=$(python3 native/cudakit.py toolkit)`")
ARCH = re.compile(r"^\d{2,3}[af]?$")


class CudaError(RuntimeError):
    """Something a CUDA build needs is missing; the message says what and how to get it."""


def is_cuda_preset(preset: str) -> bool:
    return preset in CUDA_PRESETS


def find_nvcc(env: dict | None = None) -> Path | None:
    """nvcc as CMake would pick it: CUDACXX, then $CUDA_HOME/bin, $CUDA_PATH/bin, then PATH."""
    env = os.environ if env is None else env
    candidates = [env.get("CUDACXX")]
    candidates += [str(Path(env[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if env.get(v)]
    candidates.append(shutil.which("nvcc", path=env.get("PATH")))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def toolkit_root(nvcc: Path) -> Path:
    """The toolkit an nvcc belongs to (bin/nvcc -> root), through a wrapper script's exec
    line or a link: what CUDAToolkit_ROOT must name for CMake to find its libraries."""
    nvcc = nvcc.resolve()
    try:
        text = nvcc.read_text(errors="strict") if nvcc.stat().st_size < 4096 else ""
    except (UnicodeDecodeError, OSError):
        text = ""
    m = re.search(r"exec\s+(\S+/bin/nvcc)\b", text)
    if m and Path(m.group(1)).is_file():
        nvcc = Path(m.group(1)).resolve()
    return nvcc.parent.parent


def nvcc_version(nvcc: Path) -> str:
    """`release 13.0, V13.0.88` -> "13.0.88"."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"\bV(\d+\.\d+\.\d+)", out)
    if not m:
        raise CudaError(f"{nvcc} --version printed no version: {out.strip()[-200:]!r}")
    return m.group(1)


def parse_compute_caps(text: str) -> list[str]:
    """nvidia-smi's `compute_cap` column ("9.0" per GPU) -> CMake architectures ("90"), in
    order, without repeats."""
    out: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        m = re.fullmatch(r"(\d+)\.(\d+)", line)
        if m and m.group(1) + m.group(2) not in out:
            out.append(m.group(1) + m.group(2))
    return out


def local_archs() -> list[str]:
    """The compute capabilities of this machine's GPUs ([] without nvidia-smi or a GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        proc = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_compute_caps(proc.stdout) if proc.returncode == 0 else []


def resolve_arch(requested: str | None, local: list[str]) -> str:
    """CUDA_ARCH (e.g. "90", or "90;120a"), else the local GPUs'; required when there is none."""
    if requested:
        archs = [a.strip() for a in requested.replace(",", ";").split(";") if a.strip()]
        bad = [a for a in archs if not ARCH.match(a)]
        if not archs or bad:
            raise CudaError(f"CUDA_ARCH={requested!r}: expected compute capabilities such as 90 "
                            f"(H100/H200) or 80;86, not {', '.join(bad) or 'nothing'}")
        return ";".join(archs)
    if not local:
        raise CudaError("no NVIDIA GPU here to build for (nvidia-smi found none): "
                        "name the architecture, e.g. CUDA_ARCH=90 for H100/H200")
    return ";".join(local)


def cmake_args(nvcc: Path, arch: str) -> list[str]:
    """The CMake options of a CUDA build: its compiler, toolkit, architectures, and a run
    path to the toolkit's libraries (cudart, cuBLAS), which a registry toolkit keeps in
    the cache where the dynamic loader would not look. Part of the build's key."""
    root = toolkit_root(nvcc)
    libdir = next((d for d in (root / "lib64", root / "lib") if (d / "libcudart.so").exists()
                   or any(d.glob("libcudart.so.*"))), root / "lib64")
    rpath = f"-Wl,-rpath,{libdir}"
    return [f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}", f"-DCUDAToolkit_ROOT={root}",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            f"-DCMAKE_SHARED_LINKER_FLAGS={rpath}", f"-DCMAKE_EXE_LINKER_FLAGS={rpath}"]


def preset_cmake(preset: str, env: dict | None = None) -> tuple[list[str], dict]:
    """(CMake options, what build-info.json records) for a preset: ([], {}) for a CPU one.
    Raises CudaError (one line) when a CUDA preset lacks nvcc or an architecture."""
    if not is_cuda_preset(preset):
        return [], {}
    env = os.environ if env is None else env
    nvcc = find_nvcc(env)
    if nvcc is None:
        raise CudaError(NO_NVCC)
    arch = resolve_arch(env.get("CUDA_ARCH"), local_archs())
    root = toolkit_root(nvcc)
    return cmake_args(nvcc, arch), {"arch": arch, "nvcc": str(root / "bin" / "nvcc"),
                                    "version": nvcc_version(root / "bin" / "nvcc"), "root": str(root)}


# The oldest driver branch each CUDA major release runs on (NVIDIA's CUDA release notes,
# "minor version compatibility": any 13.x toolkit's code runs on a 580 driver or newer).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def driver_version(smi: str | None = None) -> str | None:
    """The NVIDIA driver's version ("580.82.07") from nvidia-smi; None without one."""
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    return lines[0].strip() if lines else None


def driver_problem(driver: str | None, toolkit: str) -> str | None:
    """One line naming both when the driver is too old for the toolkit the build was
    compiled with (a CUDA 13 build on a 570 driver fails at its first call with error 35,
    "driver version is insufficient"); None when they fit or the pair is not in the table."""
    major = int(toolkit.split(".")[0])
    need = MIN_DRIVER.get(major)
    if driver is None:
        return f"no NVIDIA driver answered nvidia-smi, and a CUDA {toolkit} build needs one ({need} or newer)"
    if need is not None and int(driver.split(".")[0]) < need:
        return (f"NVIDIA driver {driver} is older than CUDA {toolkit} needs ({need} or newer): "
                f"use a build compiled with the node's own older toolkit (CUDA_HOME=...), docs/GPU.md")
    return None


def gpu_preflight(env: dict | None = None, toolkit: str | None = None) -> tuple[str | None, str | None]:
    """`make gpu-check`'s first step: (the architecture to build for, None), or (None, one
    line saying what this machine lacks: a GPU, nvcc, or a driver new enough for the
    toolkit). `toolkit`: the CUDA version a prebuilt build was compiled with (a GPU pack);
    None: the version of the nvcc found here."""
    env = os.environ if env is None else env
    archs = local_archs()
    if not archs:
        return None, "make gpu-check needs an NVIDIA GPU, and nvidia-smi lists none here (docs/GPU.md)"
    if toolkit is None:
        nvcc = find_nvcc(env)
        if nvcc is None:
            return None, "make gpu-check: " + NO_NVCC
        toolkit = nvcc_version(nvcc)
    problem = driver_problem(driver_version(), toolkit)
    if problem:
        return None, "make gpu-check: " + problem
    return env.get("CUDA_ARCH") or ";".join(archs), None


# ---------------------------------------------------------------- the registry toolkit


def registry_root(cache: Path) -> Path:
    """Where the registry toolkit of these pins is assembled (a new pin, a new directory)."""
    pins = json.dumps(REGISTRY_WHEELS, sort_keys=True)
    return cache / "toolchains" / f"cuda-{REGISTRY_CUDA}-{hashlib.sha256(pins.encode()).hexdigest()[:8]}"


def driver_functions(cuda_h: Path, cc: str = "cc") -> list[str]:
    """Every driver API function cuda.h declares, by its link name (the header's
    `#define cuFoo cuFoo_v2` applied): what a stub libcuda.so must define."""
    proc = subprocess.run([cc, "-E", "-P", "-I", str(cuda_h.parent), "-x", "c", str(cuda_h)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaError(f"could not preprocess {cuda_h}: {proc.stderr.strip()[-300:]}")
    names = re.findall(r"\b(cu[A-Z]\w*)\s*\(", proc.stdout)
    return sorted(set(names))


def write_driver_stub(root: Path, cc: str = "cc") -> Path:
    """lib/stubs/libcuda.so: every driver function returning CUDA_ERROR_STUB_LIBRARY (34),
    soname libcuda.so.1, for linking only (the driver's library replaces it at run time)."""
    stubs = root / "lib" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    names = driver_functions(root / "include" / "cuda.h", cc)
    if len(names) < 100:
        raise CudaError(f"{root / 'include' / 'cuda.h'} declares only {len(names)} driver functions")
    src = stubs / "libcuda-stub.c"
    src.write_text("/* generated by native/cudakit.py: a link-time stand-in for the driver */\n"
                   + "".join(f"int {n}(void) {{ return 34; }}\n" for n in names))
    out = stubs / "libcuda.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaError(f"could not compile the libcuda stub: {proc.stderr.strip()[-300:]}")
    return out


def link_time_driver(root: Path, dest: Path, ldconfig: str | None = None) -> Path | None:
    """`dest` holding libcuda.so.1 -> the toolkit's driver stub, for the linker alone: an
    executable linked against libggml-cuda (llama-bench, llama-server) must resolve the
    library's driver calls, and ld looks for libcuda.so.1, which only a driver installs.
    Put on LD_LIBRARY_PATH while building, never at run time (the stub answers error 34).
    None where the driver's library is installed (ld finds it) or the toolkit has no stub."""
    cache = subprocess.run([ldconfig or shutil.which("ldconfig") or "/sbin/ldconfig", "-p"],
                           capture_output=True, text=True).stdout
    if "libcuda.so.1 " in cache:
        return None
    for sub in ("lib/stubs", "lib64/stubs", "targets/x86_64-linux/lib/stubs"):
        stub = root / sub / "libcuda.so"
        if stub.exists():
            dest.mkdir(parents=True, exist_ok=True)
            link = dest / "libcuda.so.1"
            link.unlink(missing_ok=True)
            link.symlink_to(stub)
            return dest
    return None


def assemble_registry_toolkit(cache: Path, wheels: Path | None = None) -> Path:
    """Install the pinned CUDA wheels into the cache (from `wheels`, a bundle's directory,
    when given: no index then) and make their prefix look like a toolkit root: unversioned
    library links (CMake finds libcudart.so, not .so.13), lib64 beside lib, the driver stub.
    Idempotent; a marker file says the root is finished."""
    root_dir = registry_root(cache)
    marker = root_dir / ".complete"
    if marker.exists():
        return Path(marker.read_text().strip())
    shutil.rmtree(root_dir, ignore_errors=True)
    site = root_dir / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
           "--only-binary", ":all:", "--target", str(site),
           *(["--no-index", "--find-links", str(wheels)] if wheels else []),
           *(f"{name}=={version}" for name, version in REGISTRY_WHEELS.items())]
    print(f"[cuda] installing CUDA {REGISTRY_CUDA} from {wheels or 'the package registry'} into {site} ...",
          file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaError(f"pip could not install the CUDA wheels: {proc.stderr.strip()[-1500:]}")
    roots = [p.parent.parent for p in site.glob("nvidia/*/bin/nvcc")]
    if len(roots) != 1:
        raise CudaError(f"expected one nvcc under {site}/nvidia/*/bin, found {len(roots)}")
    root = roots[0]
    lib = root / "lib"
    for so in sorted(lib.glob("lib*.so.*")):
        plain = lib / (so.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(so.name)
    if not (root / "lib64").exists():
        (root / "lib64").symlink_to("lib")
    write_driver_stub(root)
    nvcc_version(root / "bin" / "nvcc")  # it runs
    marker.write_text(str(root) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("toolkit", help="assemble the registry CUDA toolkit in the cache; print its root")
    t.add_argument("--wheels", type=Path, help="install from this directory only (a bundle's wheels)")
    sub.add_parser("arch", help="print the architecture a linux-cuda build here would target")
    sub.add_parser("preflight", help="make gpu-check's first step: a GPU and nvcc, or one line")
    args = ap.parse_args(argv)
    cache = Path(os.environ.get("CLICKPACA_CACHE", Path.home() / ".cache" / "clickpaca"))
    try:
        if args.cmd == "toolkit":
            print(assemble_registry_toolkit(cache, args.wheels))
        elif args.cmd == "preflight":
            arch, problem = gpu_preflight()
            if problem:
                print(problem, file=sys.stderr)
                return 1
            print(arch)
        else:
            print(resolve_arch(os.environ.get("CUDA_ARCH"), local_archs()))
    except CudaError as e:
        print(f"[cuda] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
