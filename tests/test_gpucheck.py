"""`make gpu-check` (clickpaca/measure/gpucheck.py) where there is no GPU: it stops in one
line before setting anything up; what it would run builds only the targets it needs and
reuses the existing benches; its summary renders every step. The run itself is for a GPU
machine (docs/GPU.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from clickpaca.measure import gpucheck

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))
import cudakit  # noqa: E402


def test_without_a_gpu_make_gpu_check_stops_in_one_line(tmp_path):
    proc = subprocess.run(["make", "gpu-check", f"VENV={tmp_path / 'venv'}", f"GPU_CHECK_OUT={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("make:", "make["))]
    if cudakit.local_archs():  # a GPU machine: the preflight passes (the rest is the real run)
        assert cudakit.gpu_preflight()[0]
        return
    assert proc.returncode != 0
    assert lines == ["make gpu-check needs an NVIDIA GPU, and nvidia-smi lists none here (docs/GPU.md)"], proc.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


def test_preflight_names_nvcc_when_the_gpu_is_there_but_no_compiler(monkeypatch):
    monkeypatch.setattr(cudakit, "local_archs", lambda: ["90"])
    arch, problem = cudakit.gpu_preflight({"PATH": "/nonexistent"})
    assert arch is None and "needs nvcc" in problem
    monkeypatch.setattr(cudakit, "find_nvcc", lambda env=None: Path("/x/bin/nvcc"))
    monkeypatch.setattr(cudakit, "nvcc_version", lambda nvcc: "13.0.88")
    monkeypatch.setattr(cudakit, "driver_version", lambda smi=None: "580.82.07")
    assert cudakit.gpu_preflight({"PATH": ""}) == ("90", None)
    assert cudakit.gpu_preflight({"PATH": "", "CUDA_ARCH": "80"}) == ("80", None)


def test_preflight_names_the_driver_and_the_toolkit_in_one_line_when_the_driver_is_too_old(monkeypatch):
    monkeypatch.setattr(cudakit, "local_archs", lambda: ["90"])
    monkeypatch.setattr(cudakit, "driver_version", lambda smi=None: "570.124.06")
    arch, problem = cudakit.gpu_preflight({"PATH": ""}, toolkit="13.0.88")
    assert arch is None and "\n" not in problem
    assert "driver 570.124.06" in problem and "CUDA 13.0.88" in problem and "580 or newer" in problem
    monkeypatch.setattr(cudakit, "driver_version", lambda smi=None: "580.65.06")
    assert cudakit.gpu_preflight({"PATH": ""}, toolkit="13.0.88") == ("90", None)


def test_the_driver_table_by_toolkit_major():
    assert cudakit.driver_problem("579.99", "13.0.88") and not cudakit.driver_problem("580.0", "13.0.88")
    assert cudakit.driver_problem("520.61.05", "12.4.1") and not cudakit.driver_problem("535.1", "12.4.1")
    assert not cudakit.driver_problem("570.1", "12.8.93")  # a CUDA 12 build runs on a 570 driver
    assert "no NVIDIA driver" in cudakit.driver_problem(None, "13.0.88")


def test_the_steps_build_only_what_they_need_and_reuse_the_benches(tmp_path):
    plan = gpucheck.steps(tmp_path, 16)
    names = [n for n, _, _ in plan]
    assert names[:3] == ["build mainline", "build llama-server", "build patched"]
    builds = [cmd for _, cmd, is_build in plan if is_build and "native/" in " ".join(cmd)]
    assert all("--preset" in c and c[c.index("--preset") + 1] == "linux-cuda" and c[c.index("-j") + 1] == "16"
               for c in builds)
    assert builds[0][builds[0].index("--only-tools") + 1] == "llama-bench,llama-batched-bench"
    assert builds[2][builds[2].index("--only-tools") + 1] == ""  # the patched library alone
    benches = {cmd[4] for _, cmd, _ in plan if cmd[2:4] == ["clickpaca", "bench"]}
    assert benches == {"decode", "batch", "peer", "sampler"}
    tests = next(cmd for n, cmd, _ in plan if n == "tests marked gpu")
    assert tests[tests.index("-m", 3) + 1] == "gpu"


def test_the_summary_lists_every_step_and_says_whether_the_budget_held():
    summary = {"arch": "90", "gpus": ["NVIDIA H200, 143771 MiB, 570.1"], "cores": 16,
               "steps": [{"step": "build mainline", "exit": 0, "seconds": 200.0},
                         {"step": "tests marked gpu", "exit": 1, "seconds": 30.0}],
               "total_seconds": 600.0, "budget_seconds": gpucheck.BUDGET_S, "within_budget": False,
               "passed": False, "results": {"decode": {"table_markdown": "| a |\n|---|\n| 1 |"}}}
    text = gpucheck.render(summary)
    assert "NVIDIA H200" in text and "sm_90" in text and re.search(r"\| build mainline +\| +0 \| 200 +\|", text)
    assert "EXCEEDED" in text and "NOT all passed" in text and "## decode" in text


def test_the_benches_json_is_collected_as_the_benches_write_it(tmp_path):
    from clickpaca.results.report import write_json

    write_json(tmp_path / "decode", "decode", {"table_markdown": "| side |\n|---|\n| server |", "notes": ["n"]})
    write_json(tmp_path / "sampler", "sampler", {"table_markdown": "| n |\n|---|\n| 64 |"})
    got = gpucheck.collect(tmp_path)
    assert set(got) == {"decode", "sampler"}
    assert got["decode"] == {"file": "decode/decode.json", "table_markdown": "| side |\n|---|\n| server |",
                             "notes": ["n"]}
