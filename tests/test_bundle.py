"""native/bundle.py, clickpaca/base/offline.py and `make setup BUNDLE=dir`: a clone of the
checkout sets up on a machine without network from a bundle alone and serves.

The end-to-end test makes a bundle for this machine's Python in the cache (reused while
pyproject.toml and the pins are unchanged), the one step that may reach the package
registry, then copies the checkout's tracked files
to a temporary directory and runs `make setup BUNDLE=...` there with every download
blocked: in a network namespace of its own with no network at all (`unshare -n`, where
the machine allows it), pip told to use no index and pointed at an address where nothing
listens, and CLICKPACA_BUNDLE set so the project's own downloads refuse rather than
fetch. Its build cache is fresh except for a hard-linked copy of the cached mainline
build (compiling llama.cpp is not what this test is about; the sdist path of build.py is
tested on its own below). Then the clone's `make check` smoke test (a real server, the
real model assembled from the bundle's wheels, a JSON-schema grammar) runs there, offline.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bindgen.versions import native_build

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))
import bundle  # noqa: E402

from clickpaca.base import offline  # noqa: E402
from clickpaca.base.paths import cache_dir  # noqa: E402

nb = native_build()
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
NOWHERE = "http://127.0.0.1:9/simple"  # the discard port: nothing answers


def test_a_manylinux_platform_admits_every_older_one():
    got = bundle.platforms("manylinux_2_28_x86_64")
    assert got[0] == "manylinux_2_28_x86_64" and got[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"} <= set(got)
    assert "manylinux_2_29_x86_64" not in got
    assert bundle.platforms("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_this_machine_runs_wheels_for_its_own_platform_and_not_a_newer_glibc():
    here = bundle.this_platform()
    assert bundle.this_platform_ok(here)
    major, minor, arch = here.split("_", 3)[1], here.split("_", 3)[2], here.split("_", 3)[3]
    assert not bundle.this_platform_ok(f"manylinux_{major}_{int(minor) + 1}_{arch}")
    assert not bundle.this_platform_ok(f"manylinux_2_17_{'aarch64' if arch == 'x86_64' else 'x86_64'}")


def small_bundle(tmp_path: Path, files: dict[str, bytes], python_version: str = PY) -> Path:
    b = tmp_path / "bundle"
    (b / "files").mkdir(parents=True)
    (b / "wheels").mkdir()
    for name, data in files.items():
        (b / "files" / name).write_bytes(data)
    (b / "bundle.json").write_text(json.dumps({
        "python_version": python_version, "platform": bundle.this_platform(),
        "wheels": {}, "files": {n: bundle.sha256_file(b / "files" / n) for n in files}}))
    return b


def test_from_bundle_copies_a_recorded_file_and_refuses_a_missing_or_altered_one(tmp_path, monkeypatch):
    b = small_bundle(tmp_path, {"a.tar.gz": b"abc"})
    monkeypatch.setenv(offline.ENV, str(b))
    got = offline.from_bundle("a.tar.gz", tmp_path / "dl")
    assert got.read_bytes() == b"abc"
    with pytest.raises(offline.BundleError, match="b.whl is not in the bundle"):
        offline.from_bundle("b.whl", tmp_path / "dl")
    (b / "files" / "a.tar.gz").write_bytes(b"abd")
    with pytest.raises(offline.BundleError, match="differs from the sha256"):
        offline.from_bundle("a.tar.gz", tmp_path / "dl2")


def test_check_refuses_another_python_a_bundle_without_the_pinned_sdist_and_an_altered_file(tmp_path):
    other = "3.99"
    with pytest.raises(bundle.BundleError, match=f"for Python {other}"):
        bundle.check(small_bundle(tmp_path / "a", {}, python_version=other))
    with pytest.raises(bundle.BundleError, match="llama_cpp_python"):
        bundle.check(small_bundle(tmp_path / "b", {"x": b"1"}))
    with pytest.raises(bundle.BundleError, match="not a bundle"):
        bundle.check(tmp_path)


def test_build_py_takes_the_sdist_from_the_bundle_checked_and_never_downloads(tmp_path, monkeypatch):
    """The pinned sdist, copied out of a bundle into an empty cache and checked against the
    pin; a bundle without it is refused by name with pip pointed nowhere."""
    lock = nb.read_lock()
    cached = cache_dir() / "downloads" / lock["sdist"]
    if not cached.exists():  # the suite's builds came from it; fetch it once if a cache lost it
        nb.fetch_sdist(lock["package"], lock["version"], lock["sdist"], lock["sha256"])
    b = tmp_path / "bundle"
    (b / "files").mkdir(parents=True)
    os.link(cached, b / "files" / lock["sdist"])
    (b / "bundle.json").write_text(json.dumps({"files": {lock["sdist"]: lock["sha256"]}}))
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(offline.ENV, str(b))
    monkeypatch.setenv("PIP_INDEX_URL", NOWHERE)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    got = nb.fetch_sdist(lock["package"], lock["version"], lock["sdist"], lock["sha256"])
    assert got == tmp_path / "cache" / "downloads" / lock["sdist"]
    assert nb.sha256_file(got) == lock["sha256"]
    with pytest.raises(nb.BuildError, match="llama_cpp_python-0.3.2.tar.gz is not in the bundle"):
        nb.fetch_sdist(lock["package"], "0.3.2", "llama_cpp_python-0.3.2.tar.gz", lock["sha256.0.3.2"])
    assert not (tmp_path / "cache" / "downloads" / "llama_cpp_python-0.3.2.tar.gz").exists()


def can_unshare_network() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked (and not ignored untracked) files as they are now: a clone
    of the working tree, without builds/, .venv or caches."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def hardlinked_build(build: Path, cache: Path) -> None:
    """A copy of a finished build in another cache, its files hard links (no CMake tree)."""
    dest = cache / "builds" / build.name
    for p in build.rglob("*"):
        rel = p.relative_to(build)
        if rel.parts[0] in ("cmake", "bindings") or rel.parts[0].startswith(".bindings"):
            continue
        target = dest / rel
        if p.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(p))
        elif p.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, target)
    (dest / ".complete").write_text((build / ".complete").read_text())


@pytest.mark.slow
@pytest.mark.model
def test_a_clone_sets_up_from_a_bundle_with_every_download_blocked_and_serves(tmp_path):
    made = cache_dir() / "bundles" / f"selftest-py{PY}"
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "bundle.py"), "make", str(made)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    build = nb.finished_pinned_build("mainline", "linux-cpu", nb.cpu_from_env())
    assert build is not None, "the cached mainline build (make mainline) is what this test reuses"

    clone, cache = tmp_path / "clone", tmp_path / "cache"
    copy_checkout(clone)
    hardlinked_build(build, cache)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "CLICKPACA_", "VIRTUAL_ENV", "CUDA"))}
    env.update(CLICKPACA_CACHE=str(cache), PIP_INDEX_URL=NOWHERE, PIP_CONFIG_FILE=os.devnull,
               PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p))
    jail = ["unshare", "-n"] if can_unshare_network() else []
    setup = subprocess.run([*jail, "make", "setup", f"BUNDLE={made}", f"PYTHON={shutil.which('python3')}"],
                           cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert "taken from the bundle" not in setup.stderr  # the build was cached: no sdist needed
    model = (cache / "models" / "gemma-3-270m-q4_k_m.gguf")
    assert model.is_file() and (cache / "models" / "gemma-3-270m-q4_k_m.verified").is_file()
    assert (clone / "builds" / "mainline").resolve() == (cache / "builds" / build.name)
    assert (clone / "builds" / "mainline" / "bindings" / "_llama_cffi.py").is_file()
    # the venv holds only what came from the bundle: every installed distribution's wheel is there
    wheels = set(json.loads((made / "bundle.json").read_text())["wheels"])
    listed = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-m", "pip", "list", "--format=json",
                             "--disable-pip-version-check"], env=env, capture_output=True, text=True, check=True)
    norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()  # noqa: E731 - PEP 503 (ruamel.yaml: ruamel_yaml-*.whl)
    names = {norm(d["name"]) for d in json.loads(listed.stdout)} - {"pip", "clickpaca"}
    in_bundle = {norm(w.split("-")[0]) for w in wheels}
    assert names <= in_bundle, names - in_bundle

    offline_env = dict(env, CLICKPACA_BUNDLE=str(made), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(made / "wheels"))
    served = subprocess.run([*jail, str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-x",
                             "-p", "no:cacheprovider", "tests/test_smoke_server.py"],
                            cwd=clone, env=offline_env, capture_output=True, text=True, timeout=600)
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-2000:]
    assert "1 passed" in served.stdout


def test_make_setup_with_a_bundle_for_another_python_stops_in_one_line_before_the_venv(tmp_path):
    b = small_bundle(tmp_path, {}, python_version="3.99")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "CLICKPACA_BUNDLE"))}
    proc = subprocess.run(["make", "setup", f"BUNDLE={b}", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("make:", "make["))]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "is for Python 3.99" in lines[0] and f"PYTHON_VERSION={PY}" in lines[0]
    assert not (tmp_path / "venv").exists()
