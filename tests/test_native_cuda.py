"""native/cudakit.py and the CUDA side of native/build.py / prereqs.py: without nvcc a
CUDA set-up stops in one line naming it, the architecture is the local GPU's or named,
and a CUDA build is keyed apart from every CPU build (a cache shared by a GPU node and a
CPU machine never hands one's build to the other). The compile itself is proven once,
outside the suite (docs/GPU.md); these tests need neither a GPU nor a toolkit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from bindgen.versions import native_build

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))
import cudakit  # noqa: E402

nb = native_build()


def fake_toolkit(tmp_path: Path) -> Path:
    """A directory shaped like a toolkit root whose bin/nvcc answers --version as nvcc does
    (what find_nvcc, toolkit_root and nvcc_version read; nothing is compiled with it)."""
    root = tmp_path / "cuda-x"
    (root / "bin").mkdir(parents=True)
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so.13").write_bytes(b"")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    return root


def test_compute_caps_become_cmake_architectures():
    assert cudakit.parse_compute_caps("9.0\n9.0\n8.6\n") == ["90", "86"]
    assert cudakit.parse_compute_caps("12.0\n") == ["120"]
    assert cudakit.parse_compute_caps("No devices were found\n") == []


@given(st.lists(st.sampled_from(["7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]), max_size=8))
def test_compute_caps_keep_order_without_repeats(caps):
    got = cudakit.parse_compute_caps("\n".join(caps))
    assert len(got) == len(set(got))
    assert got == list(dict.fromkeys(c.replace(".", "") for c in caps))


def test_the_architecture_is_named_or_the_local_gpus_and_required_without_one():
    assert cudakit.resolve_arch("90", []) == "90"
    assert cudakit.resolve_arch("80, 90", ["86"]) == "80;90"
    assert cudakit.resolve_arch(None, ["90", "86"]) == "90;86"
    with pytest.raises(cudakit.CudaError, match="CUDA_ARCH=90"):
        cudakit.resolve_arch(None, [])
    with pytest.raises(cudakit.CudaError, match="sm_90"):
        cudakit.resolve_arch("sm_90", [])


def test_nvcc_is_found_as_cmake_would_and_its_toolkit_root_behind_a_wrapper(tmp_path):
    root = fake_toolkit(tmp_path)
    env = {"PATH": "/nonexistent"}
    assert cudakit.find_nvcc(env) is None
    assert cudakit.find_nvcc({**env, "CUDA_HOME": str(root)}) == root / "bin" / "nvcc"
    assert cudakit.find_nvcc({**env, "CUDACXX": str(root / "bin" / "nvcc"), "CUDA_HOME": "/x"}) == root / "bin" / "nvcc"
    wrapper = tmp_path / "wrap" / "nvcc"  # /usr/local/bin/nvcc as some images ship it
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {root}/bin/nvcc \"$@\"\n")
    wrapper.chmod(0o755)
    assert cudakit.find_nvcc({"PATH": str(wrapper.parent)}) == wrapper
    assert cudakit.toolkit_root(wrapper) == root
    assert cudakit.nvcc_version(wrapper) == "13.0.88"


def test_cuda_options_name_compiler_toolkit_arch_and_a_run_path_to_its_libraries(tmp_path):
    root = fake_toolkit(tmp_path)
    args, info = cudakit.preset_cmake("linux-cuda", {"PATH": "/nonexistent", "CUDA_HOME": str(root),
                                                      "CUDA_ARCH": "90"})
    assert f"-DCMAKE_CUDA_COMPILER={root}/bin/nvcc" in args
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{root}/lib64" in args
    assert info == {"arch": "90", "nvcc": f"{root}/bin/nvcc", "version": "13.0.88", "root": str(root)}
    assert cudakit.preset_cmake("linux-cpu", {}) == ([], {})
    with pytest.raises(cudakit.CudaError, match="needs nvcc"):
        cudakit.preset_cmake("linux-cuda", {"PATH": "/nonexistent", "CUDA_ARCH": "90"})


def test_a_cuda_build_is_keyed_apart_from_cpu_builds_and_by_architecture(tmp_path, monkeypatch):
    root = fake_toolkit(tmp_path)
    cpu = nb.cpu_options(amx=False, portable=False)
    isa = nb.build_cpu("linux-cpu", cpu)
    base = ("mainline", "linux-cpu", "sdist:x", "", [])
    cpu_key = nb.build_key(*base, cpu=cpu, isa=isa)
    keys = set()
    for arch in ("90", "80", "90;120a"):
        args, _ = cudakit.preset_cmake("linux-cuda", {"PATH": "", "CUDA_HOME": str(root), "CUDA_ARCH": arch})
        keys.add(nb.build_key("mainline", "linux-cuda", "sdist:x", "", args, cpu=cpu, isa=isa))
    assert len(keys) == 3 and cpu_key not in keys
    # the library alone is keyed apart from the library with every tool; all tools = the old key
    assert nb.build_key(*base, cpu=cpu, isa=isa, tools=[]) != cpu_key
    assert nb.build_key(*base, cpu=cpu, isa=isa, tools=list(nb.TOOLS)) == cpu_key
    # and the cache's CPU build is never what a CUDA preset finds
    monkeypatch.setenv("CUDA_HOME", str(root))
    monkeypatch.setenv("CUDA_ARCH", "90")
    found = nb.finished_pinned_build("mainline", "linux-cuda", cpu)
    assert found is None or "linux-cuda" in found.name


def test_only_tools_names_known_tools():
    assert nb.selected_tools(None) is None
    assert nb.selected_tools("") == []
    assert nb.selected_tools("llama-batched-bench,llama-bench") == ["llama-bench", "llama-batched-bench"]
    with pytest.raises(nb.BuildError, match="llama-server"):
        nb.selected_tools("llama-server")


def test_the_driver_stub_defines_each_function_by_its_link_name(tmp_path):
    """cuda.h renames functions with `#define cuFoo cuFoo_v2`: the stub must define the
    name the linker sees, which the preprocessor gives."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "cuda.h").write_text(
        "typedef int CUresult;\n#define CUDAAPI\n#define cuMemAlloc cuMemAlloc_v2\n"
        + "".join(f"CUresult CUDAAPI cuF{i}(int x);\n" for i in range(120))
        + "CUresult CUDAAPI cuMemAlloc(void **p, unsigned long n);\n")
    names = cudakit.driver_functions(inc / "cuda.h")
    assert "cuMemAlloc_v2" in names and "cuMemAlloc" not in names and len(names) == 121
    stub = cudakit.write_driver_stub(tmp_path)
    syms = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    assert " T cuMemAlloc_v2" in syms and " T cuF119" in syms
    soname = subprocess.run(["objdump", "-p", str(stub)], capture_output=True, text=True).stdout
    assert "SONAME               libcuda.so.1" in soname


def test_a_tool_links_against_a_library_that_calls_the_driver_only_with_the_link_time_stub(tmp_path):
    """llama-bench links against libggml-cuda, which needs libcuda.so.1: on a machine with
    no driver ld cannot resolve the driver calls, unless build.py puts the stub, named
    libcuda.so.1, on LD_LIBRARY_PATH (cudakit.link_time_driver) for the build alone."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "cuda.h").write_text("typedef int CUresult;\n#define CUDAAPI\n"
                                + "".join(f"CUresult CUDAAPI cuF{i}(int x);\n" for i in range(120)))
    stub = cudakit.write_driver_stub(tmp_path)
    (tmp_path / "gpu.c").write_text("int cuF7(int);\nint gpu_call(void) { return cuF7(0); }\n")
    (tmp_path / "tool.c").write_text("int gpu_call(void);\nint main(void) { return gpu_call(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libgpu.so"), str(tmp_path / "gpu.c"),
                    str(stub)], check=True)
    no_driver = tmp_path / "ldconfig-empty"
    no_driver.write_text("#!/bin/sh\necho '1 libs found in cache'\n")
    with_driver = tmp_path / "ldconfig-driver"
    with_driver.write_text("#!/bin/sh\necho '\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/libcuda.so.1'\n")
    for f in (no_driver, with_driver):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    link = ["cc", "-o", str(tmp_path / "tool"), str(tmp_path / "tool.c"), f"-L{tmp_path}", "-lgpu"]
    bare = subprocess.run(link, capture_output=True, text=True, env=env)
    assert bare.returncode != 0 and "cuF7" in bare.stderr, bare.stderr
    assert cudakit.link_time_driver(tmp_path, tmp_path / "links", ldconfig=str(with_driver)) is None
    stubs = cudakit.link_time_driver(tmp_path, tmp_path / "links", ldconfig=str(no_driver))
    assert stubs is not None and (stubs / "libcuda.so.1").resolve() == stub.resolve()
    linked = subprocess.run(link, capture_output=True, text=True, env=dict(env, LD_LIBRARY_PATH=str(stubs)))
    assert linked.returncode == 0, linked.stderr


def no_nvcc_env(tmp_path: Path) -> dict:
    """PATH with the prerequisites (and python) but no nvcc, and no toolkit variables."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("cc", "c++", "cmake", "ninja", "make", "python3"):
        found = sys.executable if tool == "python3" else shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CUDACXX", "CC", "CXX")}
    env["PATH"] = str(bindir)
    return env


def test_make_setup_for_cuda_without_nvcc_stops_in_one_line_naming_it(tmp_path):
    env = no_nvcc_env(tmp_path)
    proc = subprocess.run(["make", "setup", "PRESET=linux-cuda", "VENV=" + str(tmp_path / "venv")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make")]
    assert len(lines) == 1 and "nvcc" in lines[0] and "linux-cuda" in lines[0], proc.stderr
    assert not (tmp_path / "venv").exists(), "the venv was created before the check"


def test_build_py_for_cuda_without_nvcc_stops_in_one_line_before_any_download(tmp_path):
    env = no_nvcc_env(tmp_path)
    env["CLICKPACA_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "mainline", "--preset", "linux-cuda"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "needs nvcc" in proc.stderr
    assert not (tmp_path / "cache" / "downloads").exists()
