"""native/activations: the patch (a live eval callback, the per-sequence control vector)
applies to the pinned source (every anchor exactly once, all or nothing) and the patched
sources compile. The activations build is made of it (native/build.py PATCH_SETS); what it
does is tested through the server (tests/test_activations_server.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("activations_apply", ROOT / "native" / "activations" / "apply.py")
patch = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = patch  # (dataclasses look their module up)
spec.loader.exec_module(patch)


@pytest.fixture(scope="module")
def pinned_copy(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "native"))
    import build  # native/build.py: the pinned sdist, from the cache

    src = Path(build.resolve_source("mainline", None)["src"])
    dest = tmp_path_factory.mktemp("llama") / "llama.cpp"
    for sub in ("include", "src", "ggml/include"):
        shutil.copytree(src / sub, dest / sub)
    return dest


def test_applies_once_to_the_pinned_source(pinned_copy):
    before = {p: p.read_text() for p in (pinned_copy / "src").glob("llama-*.*")}
    patch.apply(pinned_copy)
    h = (pinned_copy / "include" / "llama.h").read_text()
    assert "llama_set_adapter_cvec_seq" in h and "llama_clear_adapter_cvec_seq" in h
    assert "LLAMA_API void llama_set_eval_callback(" in h
    assert all(f"LLAMA_API int32_t llama_steer_{name}(" in h
               for name in ("set_slots", "set_slot", "set_table", "set_gate", "n_reserve"))
    changed = {p.name for p, t in before.items() if p.read_text() != t}
    assert changed == {"llama-adapter.h", "llama-adapter.cpp", "llama-graph.h", "llama-graph.cpp",
                       "llama-context.h", "llama-context.cpp"}
    with pytest.raises(patch.PatchError, match="already carries"):
        patch.plan(pinned_copy)


def test_a_missing_anchor_writes_nothing(tmp_path, pinned_copy):
    tree = tmp_path / "t"
    shutil.copytree(pinned_copy / "include", tree / "include")
    (tree / "include" / "llama.h").write_text("// not llama.cpp's header\n")
    with pytest.raises(patch.PatchError, match="include/llama.h: anchor"):
        patch.apply(tree)
    assert (tree / "include" / "llama.h").read_text() == "// not llama.cpp's header\n"


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["llama-graph.cpp", "llama-adapter.cpp", "llama-context.cpp"])
def test_the_patched_sources_compile(pinned_copy, unit):
    if "clickpaca activations" not in (pinned_copy / "include" / "llama.h").read_text():
        patch.apply(pinned_copy)
    cxx = shutil.which("c++") or shutil.which("g++")
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Iinclude", "-Iggml/include", "-Isrc",
                        f"src/{unit}"], cwd=pinned_copy, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
