"""native/build.py and native/prereqs.py: a fresh machine needs only the README's
prerequisites, a missing one stops the set-up in one line, and a failed build leaves
nothing the cache would take as finished.

The finishing step runs for real on a copy of the real build's outputs, with a PATH that
holds only the prerequisites (a fresh machine has no patchelf; the first release of the
build step called it and failed there). Older source trees: tool targets, library
places and identity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bindgen.versions import native_build

ROOT = Path(__file__).resolve().parent.parent
BUILD_PY = ROOT / "native" / "build.py"
PREREQS = ROOT / "native" / "prereqs.py"
PREREQ_TOOLS = ("cc", "c++", "cmake", "ninja")


def prereq_only_path(tmp_path: Path, leave_out: str | None = None) -> str:
    """A directory holding links to the prerequisites (and python) and nothing else."""
    bindir = tmp_path / "prereq-bin"
    bindir.mkdir(exist_ok=True)
    for tool in (*PREREQ_TOOLS, "python3"):
        if tool == leave_out:
            continue
        found = sys.executable if tool == "python3" else shutil.which(tool)
        assert found, f"{tool} is a README prerequisite and must be on this machine"
        (bindir / tool).symlink_to(found)
    return str(bindir)


def run_prereqs(path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env["PATH"] = path
    return subprocess.run([sys.executable, str(PREREQS)], env=env, capture_output=True, text=True)


def test_prerequisites_present_pass(tmp_path):
    proc = run_prereqs(prereq_only_path(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("missing,named", [("ninja", "Ninja"), ("cmake", "CMake"),
                                          ("cc", "a C compiler"), ("c++", "a C++ compiler")])
def test_a_missing_prerequisite_is_one_line_naming_it_and_the_fix(tmp_path, missing, named):
    proc = run_prereqs(prereq_only_path(tmp_path, leave_out=missing))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and f"`{missing}`" in lines[0] and "install" in lines[0]


def test_make_setup_checks_prerequisites_before_anything_else(tmp_path):
    """`make setup` runs the check first; with ninja missing it stops there, non-zero."""
    make = shutil.which("make")
    assert make
    dry = subprocess.run([make, "-n", "setup"], cwd=ROOT, capture_output=True, text=True).stdout
    # under `make test` the nested make adds "make[1]: Entering directory" lines
    commands = [line for line in dry.splitlines() if not line.startswith("make")]
    assert "prereqs.py" in commands[0], commands[:3]
    env = dict(os.environ, PATH=prereq_only_path(tmp_path, leave_out="ninja"))
    env.pop("CC", None), env.pop("CXX", None)
    proc = subprocess.run([make, "setup", "VENV=" + str(tmp_path / "venv")], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "Ninja is missing" in proc.stderr
    assert not (tmp_path / "venv").exists(), "the venv was created before the check"


def cached_build() -> Path:
    link = ROOT / "builds" / "mainline"
    assert (link / ".complete").exists(), "make test builds mainline first"
    return link.resolve()


def readelf_runpath(binary: Path) -> str:
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        if "RUNPATH" in line or "RPATH" in line:
            return line.split("[", 1)[1].rstrip("]")
    return ""


def test_finishing_step_needs_only_the_prerequisites(tmp_path):
    """assemble() on a copy of the real build's outputs, PATH = prerequisites only; the
    assembled tools then run from bin/ with their libraries found in lib/ by run path."""
    build = cached_build()
    out = tmp_path / "out"
    shutil.copytree(build / "cmake" / "bin", out / "cmake" / "bin", symlinks=True)
    src = json.loads((build / "build-info.json").read_text())["source_dir"]
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'native')!r}); import build; "
              f"from pathlib import Path; "
              f"build.assemble(Path({str(out)!r}), Path({src!r}), {{t: t for t in build.TOOLS}})")
    env = {"PATH": prereq_only_path(tmp_path), "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(out / "cmake")  # the tools must not lean on the build tree any more
    for tool in ("llama-bench", "llama-perplexity", "ggml-rpc-server"):
        exe = out / "bin" / tool
        assert "$ORIGIN/../lib" in readelf_runpath(exe), readelf_runpath(exe)
        run = subprocess.run([str(exe), "--help"], env={"PATH": "/nonexistent"},
                             capture_output=True, text=True, timeout=60)
        assert "error while loading shared libraries" not in run.stderr, run.stderr
    assert os.readlink(out / "bin" / "rpc-server") == "ggml-rpc-server"
    assert (out / "lib" / "libllama.so").exists() and (out / "include" / "llama.h").exists()


def test_a_failed_build_is_never_taken_as_finished(tmp_path):
    """A source tree whose configure fails: an error, and no `.complete` in the cache, so
    the next run builds again instead of reusing a broken tree."""
    src = tmp_path / "broken-llama"
    (src / "include").mkdir(parents=True)
    (src / "include" / "llama.h").write_text("/* not a real header */\n")
    (src / "CMakeLists.txt").write_text('message(FATAL_ERROR "this tree does not build")\n')
    cache = tmp_path / "cache"
    env = dict(os.environ, CLICKPACA_CACHE=str(cache), LLAMA_CPP_SRC=str(src))
    builds_link = ROOT / "builds" / "mainline"
    before = os.readlink(builds_link) if builds_link.is_symlink() else None
    for attempt in range(2):
        proc = subprocess.run([sys.executable, str(BUILD_PY), "mainline"], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 1
        assert "this tree does not build" in proc.stderr
        assert "cached build" not in proc.stderr, f"attempt {attempt} reused a failed build"
    outs = list((cache / "builds").iterdir())
    assert outs and not any((o / ".complete").exists() for o in outs)
    # the checkout's link still points at the real build
    assert (os.readlink(builds_link) if builds_link.is_symlink() else None) == before


# ------------------------------------------------------------------ older trees

nb = native_build()


def test_tools_are_the_targets_the_configured_tree_defines():
    # an old tree with examples off defines none; no tool is required
    assert nb.tools_in({"llama", "ggml", "ggml-base", "all", "clean"}) == {}
    # older trees call the RPC worker rpc-server
    assert nb.tools_in({"llama", "llama-bench", "rpc-server"}) == {
        "llama-bench": "llama-bench", "ggml-rpc-server": "rpc-server"}
    assert nb.tools_in(set(nb.TOOLS)) == {t: t for t in nb.TOOLS}


def test_a_compat_build_is_the_library_alone_unless_tools_are_asked_for():
    """Library-only and --tools compat builds are different cache entries; mainline's key
    does not depend on the compat option."""
    args = ("compat", "linux-cpu", "sdist:x", "", ["-DLLAMA_CURL=OFF"])
    lib_only = nb.build_key(*args, compat_stamp=["c", 1], compat_tools=False)
    with_tools = nb.build_key(*args, compat_stamp=["c", 1], compat_tools=True)
    assert lib_only != with_tools
    assert nb.build_key(*args, compat_stamp=["c", 1], compat_tools=False) == lib_only
    main = ("mainline", "linux-cpu", "sdist:x", "", [])
    assert nb.build_key(*main, compat_tools=False) == nb.build_key(*main, compat_tools=True)


def test_libraries_are_found_wherever_the_tree_puts_them(tmp_path):
    cm = tmp_path / "cmake"
    for rel in ("llama.cpp/src/libllama.so", "llama.cpp/ggml/src/libggml.so",
                "llama.cpp/ggml/src/libggml-base.so", "llama.cpp/ggml/src/ggml-cpu/libggml-cpu.so",
                "llama.cpp/src/CMakeFiles/x.dir/libnot.so"):
        (cm / rel).parent.mkdir(parents=True, exist_ok=True)
        (cm / rel).write_bytes(b"old")
    (cm / "bin").mkdir()
    (cm / "bin" / "libllama.so").write_bytes(b"new")  # bin/ wins when a tree uses it
    found = {p.name: p for p in nb.shared_libraries(cm)}
    assert sorted(found) == ["libggml-base.so", "libggml-cpu.so", "libggml.so", "libllama.so"]
    assert found["libllama.so"].read_bytes() == b"new"


def test_identity_from_the_git_metadata(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "one")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "two")
    commit = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=9", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert nb.git_identity(tmp_path) == {"commit": commit, "build_number": 2,
                                         "build_number_from": "git rev-list --count"}
    assert nb.git_identity(tmp_path, {f"build_number.{commit}": "4094"})["build_number"] == 4094
    git("tag", "b5308")
    assert nb.git_identity(tmp_path, {f"build_number.{commit}": "4094"})["build_number"] == 5308
    assert nb.git_identity(tmp_path / "nope")["commit"] == "unknown"

