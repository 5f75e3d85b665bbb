"""The export check loads one build per process, and a load failure is an error.

Two synthetic builds each ship a `libdep.so` (one soname, different contents, like every
llama.cpp build's libggml.so) and a `libllama.so` that depends on it through $ORIGIN.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bindgen.exports import ExportCheckError, unexported

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")
ROOT = Path(__file__).resolve().parent.parent
NAMES = ["llama_x", "dep_a", "dep_b"]


def cc(out: Path, src: str, *extra: str) -> None:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c), *extra], check=True)


def fake_build(root: Path, dep_symbol: str, dep_name: str = "dep") -> Path:
    lib = root / "lib"
    lib.mkdir(parents=True)
    cc(lib / f"lib{dep_name}.so", f"int {dep_symbol}(void) {{ return 1; }}\n", f"-Wl,-soname,lib{dep_name}.so")
    cc(lib / "libllama.so", f"int {dep_symbol}(void);\nint llama_x(void) {{ return {dep_symbol}(); }}\n",
       f"-L{lib}", f"-l{dep_name}", "-Wl,-rpath,$ORIGIN")
    if dep_name != "dep":
        (lib / f"lib{dep_name}.so").unlink()  # a dependency that is not there
    return lib / "libllama.so"


def test_each_build_is_checked_against_its_own_dependencies(tmp_path):
    a = fake_build(tmp_path / "a", "dep_a")
    b = fake_build(tmp_path / "b", "dep_b")
    for _ in range(2):  # in either order, any number of times
        assert unexported(a, NAMES) == ["dep_b"]
        assert unexported(b, NAMES) == ["dep_a"]


def test_one_process_for_two_builds_gets_the_second_wrong(tmp_path):
    """Why the check runs in a child: loaded after A, B's libllama binds to A's libdep."""
    a = fake_build(tmp_path / "a", "dep_a")
    b = fake_build(tmp_path / "b", "dep_b")
    code = ("import json, sys; from bindgen.exports import missing_in_this_process as m\n"
            f"m({str(a)!r}, []); print(json.dumps(m({str(b)!r}, {NAMES!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    # B cannot even load (its llama_x needs dep_b, which the loaded libdep lacks), or it
    # reports A's symbols: either way not B's truth, which the isolated check gives.
    assert proc.returncode != 0 or json.loads(proc.stdout) != ["dep_a"]


def test_a_library_that_cannot_load_is_an_error(tmp_path):
    broken = fake_build(tmp_path / "c", "dep_c", dep_name="gone")
    with pytest.raises(ExportCheckError, match="libgone.so"):
        unexported(broken, NAMES)
