#!/usr/bin/env python3
"""Check the system prerequisites before anything is downloaded or built.

The README's prerequisites are the whole list of what a machine must bring: everything
else comes from the package registries through the project's own steps. `make setup`
runs this first so a missing tool stops the set-up in one line, not after a six-minute
build. Standard library only: it runs before any venv exists.

    python3 native/prereqs.py            # exit 0, or one line per missing tool and exit 1
    python3 native/prereqs.py --preset linux-cuda   # and nvcc, for a CUDA preset
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# (what, command, minimum version or None, how to get it). Kept in step with the README.
CMAKE_MIN = (3, 21)
PYTHON_MIN = (3, 10)
TOOLS = [
    ("a C compiler", "cc", None, "apt-get install gcc (or set CC)"),
    ("a C++ compiler", "c++", None, "apt-get install g++ (or set CXX)"),
    ("CMake", "cmake", CMAKE_MIN, "apt-get install cmake, or pip install cmake"),
    ("Ninja", "ninja", None, "apt-get install ninja-build, or pip install ninja"),
]


def version_of(cmd: str) -> tuple[int, ...] | None:
    """The first dotted version number a tool prints for --version, or None."""
    try:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def compiler_name(default: str, env_var: str) -> str:
    return os.environ.get(env_var, "").split(" ")[0] or default


def missing(preset: str = "linux-cpu") -> list[str]:
    """One line per unmet prerequisite: what is missing and how to get it. A CUDA preset
    also needs nvcc and a GPU architecture (CUDA_ARCH, else the local GPU's; native/cudakit.py)."""
    problems = []
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cudakit as cuda
    if cuda.is_cuda_preset(preset):
        if cuda.find_nvcc() is None:
            problems.append(cuda.NO_NVCC)  # one line: the architecture matters only after
        else:
            try:
                cuda.resolve_arch(os.environ.get("CUDA_ARCH"), cuda.local_archs())
            except cuda.CudaError as e:
                problems.append(str(e))
    if os.environ.get("CLICKPACA_BUNDLE"):  # make setup BUNDLE=dir: whole, and for this machine
        import bundle
        try:
            bundle.check(Path(os.environ["CLICKPACA_BUNDLE"]))
        except bundle.BundleError as e:
            problems.append(str(e))
    if sys.version_info[:2] < PYTHON_MIN:
        problems.append(f"Python {'.'.join(map(str, PYTHON_MIN))} or newer is required "
                        f"({sys.executable} is {sys.version.split()[0]}): install a newer python3")
    for module, fix in (("venv", "apt-get install python3-venv"),
                        ("ensurepip", "apt-get install python3-venv")):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"Python's {module} module is missing ({sys.executable}): {fix}")
    for what, cmd, minimum, fix in TOOLS:
        if cmd == "cc":
            cmd = compiler_name("cc", "CC")
        elif cmd == "c++":
            cmd = compiler_name("c++", "CXX")
        path = shutil.which(cmd)
        if path is None:
            problems.append(f"{what} is missing (no `{cmd}` on PATH): {fix}")
            continue
        if minimum is not None:
            have = version_of(path)
            if have is None or have[:len(minimum)] < minimum:
                shown = ".".join(map(str, have)) if have else "unknown"
                problems.append(f"{what} {'.'.join(map(str, minimum))} or newer is required "
                                f"(`{cmd}` is {shown}): {fix}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=os.environ.get("PRESET", "linux-cpu"))
    problems = missing(ap.parse_args(argv).preset)
    for line in problems:
        print(f"clickpaca prerequisites: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
