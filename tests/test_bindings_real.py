"""The generated bindings of the real mainline build: complete, exact, and guarded.

Needs builds/mainline with its bindings (`make mainline bindgen`); skipped only when the
build itself is absent. A build without bindings, or with stale ones, is a failure.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bindgen import layout
from clickpaca.llama import native

pytestmark = pytest.mark.model

BUILD = native.build_dir("mainline")
if not (BUILD / "build-info.json").exists():
    pytest.skip(f"no mainline build at {BUILD} (run `make mainline`)", allow_module_level=True)

BINDINGS = BUILD / "bindings"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def manifest() -> dict:
    path = BINDINGS / "manifest.json"
    assert path.exists(), f"{BUILD} has no generated bindings: run `make bindgen`"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def nat(manifest) -> native.Native:
    return native.load("mainline")


def read_stamp(module_path: Path) -> dict:
    for line in reversed(module_path.read_text().splitlines()):
        if line.startswith("STAMP = "):
            return json.loads(ast.literal_eval(line.removeprefix("STAMP = ")))
    raise AssertionError(f"{module_path} has no STAMP line")


def test_stamp_matches_build_info(manifest, nat):
    info = json.loads((BUILD / "build-info.json").read_text())
    stamp = read_stamp(BINDINGS / "_llama_cffi.py")
    assert stamp == nat.stamp == manifest["stamp"]
    assert stamp["flavor"] == info["flavor"] == "mainline"
    assert stamp["commit"] == info["commit"]
    assert stamp["build_number"] == info["build_number"]
    assert stamp["llama_h_sha256"] == info["llama_h_sha256"] == sha256(BUILD / "include" / "llama.h")
    assert stamp["libllama_sha256"] == info["libllama_sha256"] == sha256(BUILD / "lib" / "libllama.so")


def test_every_manifest_function_is_exposed(manifest, nat):
    missing = []
    for name in manifest["functions"]:
        try:
            getattr(nat.lib, name)
        except (AttributeError, nat.ffi.error):
            missing.append(name)
    assert not missing, f"declared in the manifest but not callable: {missing}"
    assert len(manifest["functions"]) > 300  # llama.h + the ggml headers it includes
    for core in ("llama_model_load_from_file", "llama_init_from_model", "llama_decode",
                 "llama_tokenize", "llama_batch_init", "llama_get_logits_ith"):
        assert core in manifest["functions"]


def test_every_enum_value_matches_manifest_and_compiler(manifest, nat, tmp_path):
    names, values = [], []
    for enum, members in manifest["enums"].items():
        for name, value in members.items():
            assert getattr(nat.lib, name) == value, f"{enum}.{name}"
            names.append(name)
            values.append(value)
    assert "LLAMA_FLASH_ATTN_TYPE_AUTO" in names and "GGML_TYPE_COUNT" in names
    # and the C compiler agrees with the manifest
    src = tmp_path / "enums.c"
    body = "\n".join(f'    printf("%lld\\n", (long long){n});' for n in names)
    src.write_text(f'#include <stdio.h>\n#include "llama.h"\nint main(void) {{\n{body}\n    return 0;\n}}\n')
    subprocess.run(["gcc", "-std=c11", "-w", "-I", str(BUILD / "include"), "-o", str(tmp_path / "enums"),
                    str(src)], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "enums")], check=True, capture_output=True, text=True).stdout
    assert [int(x) for x in out.split()] == values


def test_layout_proof_holds(manifest, nat):
    n = layout.prove(manifest["records"], ["llama.h"], [BUILD / "include"])
    assert n > 100
    for name in ("struct llama_model_params", "struct llama_context_params", "struct llama_batch"):
        rec = manifest["records"][name]
        assert nat.ffi.sizeof(name) == rec["size"]
        for f in rec["fields"]:
            if "bits" not in f:
                assert nat.ffi.offsetof(name, f["name"]) == f["offset"]


# ---------------------------------------------------------------- refusing mismatched pairs


def copy_build(root: Path, name: str, edit_stamp=None) -> Path:
    """builds/<name> in a tmp root: lib/ and include/ linked, bindings copied (stamp edited)."""
    d = root / name
    (d / "bindings").mkdir(parents=True)
    (d / "lib").symlink_to((BUILD / "lib").resolve())
    (d / "include").symlink_to((BUILD / "include").resolve())
    shutil.copy2(BUILD / "build-info.json", d / "build-info.json")
    src = (BINDINGS / "_llama_cffi.py").read_text()
    if edit_stamp is not None:
        stamp = read_stamp(BINDINGS / "_llama_cffi.py")
        edit_stamp(stamp)
        lines = src.splitlines()
        i = max(k for k, line in enumerate(lines) if line.startswith("STAMP = "))
        lines[i] = f"STAMP = {json.dumps(stamp, sort_keys=True)!r}"
        src = "\n".join(lines) + "\n"
    (d / "bindings" / "_llama_cffi.py").write_text(src)
    return d


def test_load_accepts_an_intact_copy(tmp_path, monkeypatch, manifest):
    copy_build(tmp_path, "intact")
    monkeypatch.setenv("CLICKPACA_BUILDS", str(tmp_path))
    nat = native.load("intact")
    assert nat.build_dir == tmp_path / "intact"
    assert nat.stamp == manifest["stamp"]
    assert nat.lib.llama_max_devices() >= 1


@pytest.mark.parametrize("key,value,expect", [
    ("commit", "0000000", "commit"),
    ("build_number", 1, "build_number"),
    ("libllama_sha256", "0" * 64, "libllama.so differs"),
])
def test_load_refuses_a_tampered_stamp(tmp_path, monkeypatch, key, value, expect):
    name = f"tampered-{key}"
    copy_build(tmp_path, name, lambda s: s.__setitem__(key, value))
    monkeypatch.setenv("CLICKPACA_BUILDS", str(tmp_path))
    with pytest.raises(native.NativeError) as ei:
        native.load(name)
    msg = str(ei.value)
    assert "make bindgen" in msg
    assert expect in msg


def test_load_refuses_a_build_without_bindings(tmp_path, monkeypatch):
    d = copy_build(tmp_path, "unbound")
    shutil.rmtree(d / "bindings")
    monkeypatch.setenv("CLICKPACA_BUILDS", str(tmp_path))
    with pytest.raises(native.NativeError, match="make bindgen"):
        native.load("unbound")


def test_a_function_this_build_lacks_is_named_not_an_attribute_error(nat):
    """An older API name (removed from this version) is refused with the build and the
    llama.cpp version in the message; hasattr() still probes capabilities."""
    with pytest.raises(native.MissingFunction,
                       match=r"build 'mainline' \(llama\.cpp b\d+\) has no llama_kv_self_seq_rm"):
        nat.lib.llama_kv_self_seq_rm
    assert not hasattr(nat.lib, "llama_kv_self_seq_rm")
    assert hasattr(nat.lib, "llama_decode") and nat.lib.llama_decode is nat.lib.llama_decode
