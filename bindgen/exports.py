"""Which declared functions a build's library really exports, checked in a fresh process.

Why a separate process: every llama.cpp build names its libraries alike (libggml.so,
libggml-base.so), so once one build is loaded, the dynamic linker binds the next build's
libllama to the first build's ggml. A check in the generating process then depends on the
order builds are processed. A child process loads exactly one build, by full path.

A library that cannot be loaded is an error, never an empty answer: a GPU build on a
machine without the driver must say so (or be generated with --no-export-check).

    python -m bindgen.exports /path/to/libllama.so < names   # prints the missing names (JSON)
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path


class ExportCheckError(RuntimeError):
    """The library could not be loaded, so its exports could not be checked."""


def missing_in_this_process(libpath: str, names: list[str]) -> list[str]:
    """dlopen the library (RTLD_LOCAL) and return the names dlsym cannot find in it or
    in the libraries it depends on."""
    lib = ctypes.CDLL(libpath, mode=os.RTLD_LOCAL)
    out = []
    for name in names:
        try:
            lib[name]
        except AttributeError:
            out.append(name)
    return out


def unexported(libpath: Path, names) -> list[str]:
    """The names among `names` that the library at `libpath` does not export (sorted)."""
    names = sorted(names)
    proc = subprocess.run([sys.executable, "-m", "bindgen.exports", str(Path(libpath).resolve())],
                          input=json.dumps(names), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        raise ExportCheckError(
            f"cannot load {libpath} to check which declared functions it exports:\n"
            f"{proc.stderr.strip()[-2000:]}\n(generate where the build can run, or pass "
            "--no-export-check to skip the check knowingly)")
    return json.loads(proc.stdout)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        missing = missing_in_this_process(argv[0], json.loads(sys.stdin.read()))
    except OSError as e:
        print(f"dlopen failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
