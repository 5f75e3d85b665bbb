"""native/kvcenter: the key-centering patch applies to the pinned source after the
activations set (as native/build.py applies them: PATCH_SETS), every anchor exactly once,
all or nothing, and refuses a tree it already patched. What it does is tested in the
patched build (tests/test_kvcenter_native.py: the study's callback, bit for bit)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_apply", ROOT / "native" / name / "apply.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


activations, kvcenter = _load("activations"), _load("kvcenter")


@pytest.fixture()
def pinned_copy(tmp_path):
    sys.path.insert(0, str(ROOT / "native"))
    import build  # native/build.py: the pinned sdist, from the cache

    src = Path(build.resolve_source("mainline", None)["src"])
    dest = tmp_path / "llama.cpp"
    for sub in ("include", "src", "ggml/include"):
        shutil.copytree(src / sub, dest / sub)
    return dest


def test_the_build_applies_it_after_activations():
    sys.path.insert(0, str(ROOT / "native"))
    import build

    sets = build.PATCH_SETS["patched"]
    assert sets.index("activations") < sets.index("kvcenter")
    assert "kvcenter" in build.BUILD_NAMES["patched"]


def test_applies_once_after_activations(pinned_copy):
    activations.apply(pinned_copy)
    before = {p: p.read_text() for p in (pinned_copy / "src").glob("llama-*.*")}
    kvcenter.apply(pinned_copy)
    h = (pinned_copy / "include" / "llama.h").read_text()
    assert "LLAMA_API int32_t llama_set_kv_center(" in h
    changed = {p.name for p, t in before.items() if p.read_text() != t}
    assert changed == {"llama-adapter.h", "llama-adapter.cpp", "llama-graph.cpp", "llama-context.h", "llama-context.cpp"}
    graph = (pinned_copy / "src" / "llama-graph.cpp").read_text()
    assert graph.count("cvec->center_k(ctx0, k_cur, il)") == 2  # the KV attention and the sliding-window one
    with pytest.raises(kvcenter.PatchError, match="already carries"):
        kvcenter.plan(pinned_copy)


def test_without_activations_nothing_is_written(pinned_copy):
    before = {p: p.read_text() for p in pinned_copy.rglob("*") if p.is_file()}
    with pytest.raises(kvcenter.PatchError, match="llama-context.h: anchor"):
        kvcenter.apply(pinned_copy)
    assert before == {p: p.read_text() for p in pinned_copy.rglob("*") if p.is_file()}
