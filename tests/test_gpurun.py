"""native/gpurun.py's pure parts: the pre-selection row its summary proposes, where it
finds cuBLAS, and the summary's table (the run itself: tests/test_gpupack.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))
import gpurun  # noqa: E402


def write_rows(folder: Path, ratios: list[float | None]) -> Path:
    folder.mkdir()
    rows = [{"seqs": n, "chain": "greedy", "pre_ratio_to_default": x} for n, x in zip((8, 64), ratios)]
    (folder / "batch.json").write_text(json.dumps({"rows": rows}))
    return folder


def test_the_cuda_row_is_on_only_where_preselection_won_every_row(tmp_path):
    assert gpurun.preselect_row(write_rows(tmp_path / "a", [1.2, 1.05]))["on"] is True
    off = gpurun.preselect_row(write_rows(tmp_path / "b", [1.2, 0.9]))
    assert off["on"] is False and off["evidence"].startswith("measured: preselect / host 0.90-1.20 over 2")
    assert gpurun.preselect_row(write_rows(tmp_path / "c", [1.2, None])) is None
    assert gpurun.preselect_row(tmp_path / "missing") is None


def test_cublas_is_found_under_cuda_home_only_with_both_libraries(tmp_path, monkeypatch):
    lib = tmp_path / "lib64"
    lib.mkdir()
    (lib / "libcublas.so.13").write_bytes(b"")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    found = gpurun.find_cublas()
    assert found != str(lib)  # libcublasLt.so.13 is missing there
    (lib / "libcublasLt.so.13").write_bytes(b"")
    assert gpurun.find_cublas() == str(lib)


def test_the_summary_table_has_each_step_its_status_and_budget():
    s = {"gpus": [], "model": {"what": "synthetic twin of m.gguf", "twin_sha256": "ab" * 32},
         "pack": {"build": {"flavor": "patched", "preset": "linux-cuda", "cuda": {"arch": "90"}}, "made_at": "t"},
         "steps": [{"step": "unpack the build", "status": "passed", "exit": 0, "seconds": 1.0, "budget_s": 15},
                   {"step": "tests marked gpu", "status": "skipped", "reason": "needs a GPU", "exit": None,
                    "seconds": 0.0, "budget_s": 75}],
         "total_seconds": 1.0, "budget_seconds": 90, "goal_seconds": 360, "within_goal": True,
         "failed": [], "skipped": ["tests marked gpu"], "results": {}, "preselect_row": None}
    text = gpurun.render(s)
    assert "| unpack the build | passed | 0 | 1 | 15 |" in text
    assert "| tests marked gpu | skipped (needs a GPU) |  | 0 | 75 |" in text
    assert "goal 360 s: held" in text and "CUDA (clickpaca/llama/backends.py): not measured" in text
