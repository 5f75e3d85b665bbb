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



# ------------------------------------------------------------------ CPUs (issue #23)

FAKE_TOOL_C = """#include <signal.h>
int main(void) {
#ifdef CRASH
    raise(SIGILL); /* what ggml's AMX path did on a CPU with AMX: tileloadd -> SIGILL */
#endif
    return 0;
}
"""


def fake_tree(tmp_path: Path, crash: bool) -> Path:
    """A tiny llama.cpp stand-in the real build step compiles in seconds: a libllama and
    every tool; its llama-bench dies with SIGILL when `crash`."""
    src = tmp_path / "fake-llama"
    (src / "include").mkdir(parents=True)
    (src / "include" / "llama.h").write_text("int llama_fake(void);\n")
    (src / "llama.c").write_text("int llama_fake(void) { return 1; }\n")
    (src / "tool.c").write_text(FAKE_TOOL_C)
    tools = " ".join(nb.TOOLS)
    (src / "CMakeLists.txt").write_text(
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "add_library(llama SHARED llama.c)\n"
        f"foreach(t {tools})\n  add_executable(${{t}} tool.c)\nendforeach()\n"
        + ("target_compile_definitions(llama-bench PRIVATE CRASH=1)\n" if crash else ""))
    return src


def run_fake_build(tmp_path: Path, crash: bool) -> tuple[subprocess.CompletedProcess, Path, Path]:
    cache, builds = tmp_path / "cache", tmp_path / "builds"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # the fake llama-bench never reads it
    env = dict(os.environ, CLICKPACA_CACHE=str(cache), CLICKPACA_BUILDS=str(builds),
               LLAMA_CPP_SRC=str(fake_tree(tmp_path, crash)), CLICKPACA_MODEL=str(model))
    proc = subprocess.run([sys.executable, str(BUILD_PY), "mainline"], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, cache, builds


def test_a_build_whose_smoke_test_dies_is_refused_in_one_line(tmp_path):
    """The real build step on a tree whose llama-bench raises SIGILL: one error line naming
    the signal, the CPU and the likely cause; nothing left that a later run takes as
    finished, and no link to it."""
    from clickpaca.llama.cpu import cpu_name

    proc, cache, builds = run_fake_build(tmp_path, crash=True)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[native] error:")]
    assert len(errors) == 1, proc.stderr
    line = errors[0]
    assert "SIGILL (illegal instruction)" in line and cpu_name() in line, line
    assert "AMX" in line and "remedy" in line, line
    assert not [p for p in (cache / "builds").iterdir() if (p / ".complete").exists()]
    assert not list((cache / "builds").iterdir()), "the failed build's tree was left in the cache"
    assert not (builds / "mainline").exists()


def test_a_build_whose_smoke_test_passes_records_its_cpu(tmp_path):
    proc, cache, builds = run_fake_build(tmp_path, crash=False)
    assert proc.returncode == 0, proc.stderr
    assert "smoke test passed" in proc.stderr
    info = json.loads((builds / "mainline" / "build-info.json").read_text())
    assert info["cpu"]["isa"] == nb.target_isa(nb.NO_AMX_FLAGS if nb.is_x86() else [])
    assert info["cpu"]["amx"] is False and info["cpu"]["portable"] is False
    if nb.is_x86():
        assert not any(m.startswith("__AMX") for m in info["cpu"]["isa"])
        assert "__SSE2__" in info["cpu"]["isa"]


def missing_macro() -> str:
    """An instruction-set macro whose instructions this CPU lacks."""
    from clickpaca.llama.cpu import CPUINFO_FLAG, cpu_flags

    flags = cpu_flags() or set()
    missing = [m for m, f in CPUINFO_FLAG.items() if f not in flags]
    assert missing, "this CPU has every instruction set clickpaca knows"
    return missing[-1]


def test_a_cached_build_keyed_for_other_instructions_is_not_taken(monkeypatch):
    """The key holds what -march=native resolves to: the cached build of this machine is
    found, and the same cache seen from a CPU that resolves to more (or other) instructions
    finds nothing, so that machine builds its own instead of dying on ours."""
    cpu = nb.cpu_options(amx=False, portable=False)
    here = nb.finished_pinned_build("mainline", "linux-cpu", cpu)
    assert here is not None and here == cached_build()
    real = nb.target_isa
    monkeypatch.setattr(nb, "target_isa", lambda cflags, native=True: sorted([*real(cflags, native), missing_macro()]))
    assert nb.finished_pinned_build("mainline", "linux-cpu", cpu) is None
    # the other CPU choices are keyed apart too
    monkeypatch.setattr(nb, "target_isa", real)
    assert nb.finished_pinned_build("mainline", "linux-cpu", nb.cpu_options(amx=True, portable=False)) != here


def test_loading_a_build_made_for_another_cpu_is_refused(tmp_path):
    """A build linked from elsewhere (a network home, a copied cache) whose build-info says
    it uses instructions this CPU lacks: refused at load in one line, before any call."""
    real = cached_build()
    fake = tmp_path / "builds" / "mainline"
    fake.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "build-info.json":
            (fake / entry.name).symlink_to(entry)
    info = json.loads((real / "build-info.json").read_text())
    macro = missing_macro()
    info["cpu"] = dict(info.get("cpu") or {}, isa=sorted([*info.get("cpu", {}).get("isa", []), macro]),
                       built_on="Some Other CPU")
    (fake / "build-info.json").write_text(json.dumps(info))
    script = ("from clickpaca.llama.native import load, NativeError\n"
              "try:\n    load('mainline')\nexcept NativeError as e:\n    print(e)\n"
              "else:\n    print('LOADED')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, CLICKPACA_BUILDS=str(tmp_path / "builds")), timeout=60)
    from clickpaca.llama.cpu import CPUINFO_FLAG

    out = proc.stdout.strip()
    assert "LOADED" not in out and len(out.splitlines()) == 1, out
    assert CPUINFO_FLAG[macro] in out and "Some Other CPU" in out and "make mainline" in out, out


def test_the_pinned_source_is_found_through_the_build_not_the_default_cache(tmp_path):
    """With CLICKPACA_CACHE pointing elsewhere (a second cache, an unwritable home) the tests
    and the code still find the vendored tree the build was made from (issue #23 item 6):
    one of the grammar tests that read llama.cpp's grammars/ runs that way."""
    env = dict(os.environ, CLICKPACA_CACHE=str(tmp_path / "elsewhere"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_grammars.py"), "-k",
                           "grammars_folder_found or llama_cpp_gbnf_compiles"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "error" not in proc.stdout.splitlines()[-1]


# ------------------------------------------------------------------ PORTABLE=1 (issue #23)

def pinned_source() -> Path:
    return Path(json.loads((cached_build() / "build-info.json").read_text())["source_dir"])


def test_the_cpu_variants_are_read_from_the_pinned_source():
    """GGML_CPU_ALL_VARIANTS' x86 variants as ggml's CMakeLists.txt declares them: the
    baseline has no feature, haswell is AVX2 without AVX-512, and only sapphirerapids
    carries AMX (the path that dies with SIGILL, #23)."""
    v = nb.cpu_variant_features(pinned_source())
    assert v["x64"] == []
    assert {"AVX2", "FMA", "F16C", "BMI2"} <= set(v["haswell"]) and "AVX512" not in v["haswell"]
    assert "AVX512" in v["skylakex"] and "AVX512_BF16" in v["zen4"]
    assert [name for name, feats in v.items() if any(f.startswith("AMX") for f in feats)] == ["sapphirerapids"]


def fake_portable_lib(out: Path, names: list[str]) -> None:
    (out / "lib").mkdir(parents=True)
    (out / "bin").mkdir()
    for name in names:
        (out / "lib" / name).write_bytes(b"\x7fELF")


PORTABLE_LIBS = ["libggml-base.so", "libggml-base.so.0", "libggml.so", "libllama.so",
                 "libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-zen4.so",
                 "libggml-cpu-sapphirerapids.so", "libggml-rpc.so"]


def test_a_portable_build_leaves_the_amx_variant_out_and_links_its_modules_into_bin(tmp_path):
    out = tmp_path / "out"
    fake_portable_lib(out, PORTABLE_LIBS)
    rec = nb.arrange_backend_modules(out, pinned_source(), amx=False)
    assert not (out / "lib" / "libggml-cpu-sapphirerapids.so").exists()
    assert set(rec["variants"]) == {"x64", "haswell", "zen4"}
    assert "AMX_TILE" in rec["variants_left_out"]["sapphirerapids"]
    assert rec["backend_modules"] == ["libggml-cpu-haswell.so", "libggml-cpu-x64.so",
                                      "libggml-cpu-zen4.so", "libggml-rpc.so"]
    for name in rec["backend_modules"]:  # where ggml_backend_load_all looks for a tool's
        link = out / "bin" / name
        assert os.readlink(link) == f"../lib/{name}" and link.resolve() == (out / "lib" / name).resolve()
    assert not (out / "bin" / "libggml-base.so").exists() and not (out / "bin" / "libllama.so").exists()


def test_amx_1_keeps_the_amx_variant(tmp_path):
    out = tmp_path / "out"
    fake_portable_lib(out, PORTABLE_LIBS)
    rec = nb.arrange_backend_modules(out, pinned_source(), amx=True)
    assert "sapphirerapids" in rec["variants"] and rec["variants_left_out"] == {}
    assert (out / "bin" / "libggml-cpu-sapphirerapids.so").exists()


def test_a_portable_build_without_a_cpu_backend_is_an_error(tmp_path):
    out = tmp_path / "out"
    fake_portable_lib(out, ["libggml-base.so", "libggml.so", "libllama.so", "libggml-rpc.so"])
    with pytest.raises(nb.BuildError, match="no CPU backend"):
        nb.arrange_backend_modules(out, pinned_source(), amx=False)


def test_only_portable_builds_arrange_backend_modules():
    assert nb.backend_dl(nb.cpu_options(amx=False, portable=True))
    assert not nb.backend_dl(nb.cpu_options(amx=False, portable=False))
    assert not nb.backend_dl(None)


def test_a_cpu_isa_build_is_keyed_apart_and_linked_under_its_own_name():
    """--cpu-isa sse42 (issue #27's ISA experiment): the CPU backend for SSE4.2 through
    ggml's own options (every other one off, so nothing adds AVX2 back), keyed and linked
    apart from the default build, whose key the option leaves unchanged."""
    default = nb.cpu_options(amx=False, portable=False)
    low = nb.cpu_options(amx=False, portable=False, cpu_isa="sse42")
    assert "-DGGML_NATIVE=OFF" in low["cmake"] and "-DGGML_SSE42=ON" in low["cmake"]
    assert "-DGGML_AVX2=OFF" in low["cmake"] and "-DGGML_FMA=OFF" in low["cmake"] and "-DGGML_AVX=OFF" in low["cmake"]
    assert low["cflags"] == default["cflags"]  # the rest of the build as the native one
    isa = nb.build_cpu("linux-cpu", low)
    assert "__SSE4_2__" in isa and "__AVX__" not in isa and "__AVX2__" not in isa
    keys = {nb.build_key("turboquant", "linux-cpu", "s", "p", [], cpu=c, isa=nb.build_cpu("linux-cpu", c))
            for c in (default, low)}
    assert len(keys) == 2
    assert nb.finished_pinned_build("mainline", "linux-cpu", default) == cached_build()
    assert nb.link_names("patched", None, low) == ["patched-sse42", "turboquant-sse42", "activations-sse42",
                                                   "kvcenter-sse42"]
    assert nb.link_names("patched", None, default) == ["patched", "turboquant", "activations", "kvcenter"]
    assert nb.link_names("compat", "0.3.16", low) == ["compat-0.3.16"]
    with pytest.raises(nb.BuildError, match="--cpu-isa"):
        nb.cpu_options(amx=False, portable=True, cpu_isa="sse42")
    with pytest.raises(nb.BuildError, match="not one of"):
        nb.cpu_options(amx=False, portable=False, cpu_isa="x86-64-v2")


def test_every_patched_flavor_is_keyed_by_the_shared_applier_too(tmp_path, monkeypatch):
    """native/patchset.py (the anchored-hook applier every patch set imports) is in each
    patched flavor's patch files, so a change to it changes their keys; mainline has none."""
    assert nb.patch_files("mainline") == [] and nb.patch_files("compat") == []
    for flavor, sets in nb.PATCH_SETS.items():
        if not sets:
            continue
        files = nb.patch_files(flavor)
        assert files[0] == nb.NATIVE / "patchset.py"
        assert all(nb.NATIVE / s / "apply.py" in files for s in sets)
    before = nb.patches_digest(nb.patch_files("patched"))
    shared = nb.NATIVE / "patchset.py"
    changed = tmp_path / "native" / "patchset.py"
    changed.parent.mkdir()
    changed.write_bytes(shared.read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(nb, "NATIVE", changed.parent)
    monkeypatch.setattr(nb, "SHARED_PATCH_FILES", [changed])
    for name in nb.PATCH_SETS["patched"]:
        (changed.parent / name).symlink_to(shared.parent / name)
    assert nb.patches_digest(nb.patch_files("patched")) != before


def test_an_interrupted_build_resumes_where_it_stopped(tmp_path):
    """A build of the same key that did not finish (a failure, or a CUDA compile stopped
    after an hour) goes on in its tree: what compiled stays compiled."""
    src = tmp_path / "tiny-llama"
    (src / "include").mkdir(parents=True)
    (src / "src").mkdir()
    (src / "include" / "llama.h").write_text("int llama_tiny(void);\n")
    (src / "src" / "a.c").write_text("int llama_tiny_a(void) { return 1; }\n")
    gate = tmp_path / "gate.h"  # outside the tree: the tree (and so the key) stays the same
    (src / "src" / "b.c").write_text(f'#if !__has_include("{gate}")\n#error the gate is shut\n#endif\n'
                                     "int llama_tiny(void) { return 2; }\n")
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.21)\nproject(tiny C)\n"
                                        "add_library(llama SHARED src/a.c src/b.c)\n")
    env = dict(os.environ, CLICKPACA_CACHE=str(tmp_path / "cache"), LLAMA_CPP_SRC=str(src),
               CLICKPACA_BUILDS=str(tmp_path / "links"))
    cmd = [sys.executable, str(BUILD_PY), "mainline", "--only-tools", "", "-j", "1"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert first.returncode == 1 and "the gate is shut" in first.stderr
    [out] = (tmp_path / "cache" / "builds").iterdir()
    [obj_a] = out.rglob("a.c.o")
    made = obj_a.stat().st_mtime_ns
    gate.write_text("/* open */\n")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert "resuming the interrupted build" in second.stderr
    assert (out / ".complete").exists() and (out / "lib" / "libllama.so").exists()
    assert obj_a.stat().st_mtime_ns == made  # a.c was not compiled again
