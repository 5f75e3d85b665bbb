"""native/build.py's handling of older source trees: tool targets, library places, identity."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bindgen.versions import native_build

nb = native_build()


def test_tools_are_the_targets_the_configured_tree_defines():
    # an old tree with examples off defines none; no tool is required
    assert nb.tools_in({"llama", "ggml", "ggml-base", "all", "clean"}) == {}
    # older trees call the RPC worker rpc-server
    assert nb.tools_in({"llama", "llama-bench", "rpc-server"}) == {
        "llama-bench": "llama-bench", "ggml-rpc-server": "rpc-server"}
    assert nb.tools_in(set(nb.TOOLS)) == {t: t for t in nb.TOOLS}


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


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
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

