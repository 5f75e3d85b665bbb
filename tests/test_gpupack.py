"""`make gpu-pack` and native/gpurun.py without a GPU: the CPU stand-in of the GPU check.

The pack recipe is built for the CPU preset (the mainline build stands in for the CUDA
one; the wheels are this machine's Python's, the lent machine's are CPython 3.12's), then
the run script runs from a fresh copy of the checkout, inside a network namespace with
no network (`unshare -n`, where the machine allows it), with a Python that has only what
the lent image has of the project's needs (numpy, pytest, hypothesis: a venv without the
system's packages). Every step that needs no GPU passes there (the wheels, the twin model
made bit for bit as the recipe says in that other Python, the bindings, the agreement
with the CPU reference); the GPU steps are skipped by name. The pack and the checkout
must fit the 64 MiB one call carries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))
import gpupack  # noqa: E402
import gpurun  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.model]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
LEAN = ("numpy", "pytest", "hypothesis")  # what the lent image has of the project's needs


def can_unshare_network() -> bool:
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def glibc_platform() -> str:
    import platform

    major, minor = platform.libc_ver()[1].split(".")[:2]
    return f"manylinux_{major}_{minor}_x86_64"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpupack")
    pack = tmp / "pack"
    made = subprocess.run(["make", "gpu-pack", "PACK_PRESET=linux-cpu", f"PACK={pack}", f"PACK_PYTHON={PY}",
                           f"PACK_PLATFORM={glibc_platform()}"], cwd=ROOT, capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    checkout = tmp / "checkout"
    checkout.mkdir()
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    subprocess.run(["tar", "--null", "-T", "-", "-cf", str(tmp / "co.tar")], cwd=ROOT, input=files, check=True)
    subprocess.run(["tar", "-xf", str(tmp / "co.tar"), "-C", str(checkout)], check=True)
    lean = tmp / "lean"
    subprocess.run([sys.executable, "-m", "venv", str(lean)], check=True)  # no system site packages
    pip = subprocess.run([str(lean / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          *LEAN], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    jail = ["unshare", "-n"] if can_unshare_network() else []
    out = tmp / "out"
    run = subprocess.run([*jail, str(lean / "bin" / "python"), str(checkout / "native" / "gpurun.py"),
                          "--pack", str(pack), "--out", str(out)], cwd=tmp, capture_output=True, text=True,
                         timeout=900)
    return {"pack": pack, "out": out, "run": run, "lean": lean, "jailed": bool(jail), "checkout": checkout}


def test_the_lean_python_lacks_what_the_lent_image_lacks(stand_in):
    for module in ("cffi", "pycparser", "orjson", "llguidance", "jsonschema"):
        proc = subprocess.run([str(stand_in["lean"] / "bin" / "python"), "-c", f"import {module}"],
                              capture_output=True, text=True)
        assert proc.returncode != 0 and "No module named" in proc.stderr, module


def test_the_pack_and_the_checkout_fit_one_call(stand_in):
    manifest = json.loads((stand_in["pack"] / "pack.json").read_text())
    on_disk = sum(p.stat().st_size for p in stand_in["pack"].rglob("*") if p.is_file())
    checkout = sum(p.stat().st_size for p in stand_in["checkout"].rglob("*") if p.is_file())
    assert manifest["checkout_bytes"] == checkout
    assert on_disk + checkout <= gpupack.LIMIT == 64 << 20, (on_disk, checkout)
    assert manifest["fits"] is True
    assert set(manifest["files"]) >= {"build.tar.xz", "twin-recipe.json", "reference.json"}
    names = {w.split("-")[0].lower() for w in manifest["wheels"]}
    assert {"cffi", "pycparser", "orjson", "llguidance", "jsonschema"} <= names and "numpy" not in names


def test_the_run_passes_every_step_without_a_gpu_and_skips_the_gpu_ones_by_name(stand_in):
    run = stand_in["run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((stand_in["out"] / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    for s in summary["steps"]:
        assert set(s) >= {"step", "status", "exit", "seconds", "budget_s", "log"}
        if s["needs_gpu"]:
            assert s["status"] == "skipped" and s["reason"].startswith("needs a GPU"), s
        else:
            assert s["status"] == "passed" and s["exit"] == 0, s
    assert [s for s in steps if not steps[s]["needs_gpu"]] == [
        "unpack the build", "install the wheels into a target folder",
        "make the twin model (sha256 as the recipe says)", "load the bindings",
        "agree with the CPU reference (8 prompts, greedy)"]
    assert {"tests marked gpu", "bench decode vs llama-bench", "bench batch 1,8,64 vs llama-batched-bench",
            "bench peer: 64 mixed JSON-schema requests vs llama-server",
            "bench sampler: the host's share of the tick",
            "pre-selection vs the host path at 8 and 64 sequences",
            "steering slots: 8 and 64 sequences, plain and gated, vs none"} <= set(steps)
    assert summary["budget_seconds"] <= gpurun.GOAL_S
    assert summary["model"]["twin_of"] == "gemma-3-270m-q4_k_m.gguf"
    made = json.loads((stand_in["pack"] / "pack.json").read_text())["model"]["twin_sha256"]
    assert summary["model"]["twin_sha256"] == made
    files = sorted(p.name for p in stand_in["out"].iterdir())
    logs = [f for f in files if f.endswith(".log")]
    assert {"summary.json", "summary.md"} <= set(files) and len(files) <= 8 and len(logs) <= 6, files
    assert set(logs) <= {f"{n}.log" for n in gpurun.LOGS}
    text = (stand_in["out"] / "summary.md").read_text()
    assert "| tests marked gpu | skipped (needs a GPU" in text and "synthetic twin" in text
    setup_log = (stand_in["out"] / "setup.log").read_text()
    assert "8/8 prompts agree" in setup_log and "(as the recipe says)" in setup_log
