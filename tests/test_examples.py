"""Every script in examples/ runs on the default model, small (a few prompts), and
produces what docs/EXPERIMENTS.md says it does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, tmp_path: Path, n: int, tokens: int | None = None, *args: str) -> str:
    env = dict(os.environ, CLICKPACA_EXAMPLE_N=str(n), OMP_WAIT_POLICY="passive")
    if tokens is not None:
        env["CLICKPACA_EXAMPLE_TOKENS"] = str(tokens)
    p = subprocess.run([sys.executable, str(EXAMPLES / script), "--out", str(tmp_path), *args],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def test_every_example_has_a_test():
    tested = {"steerings_table.py", "document_questions.py", "cache_divergence.py", "user_step.py",
              "causal_trace.py", "steer_grid.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_steerings_table(tmp_path):
    out = run("steerings_table.py", tmp_path, 8, 8)
    assert "| greedy | 8 | 0 |" in out and "| sampled T=0.9 | 8 | 0 |" in out and "| penalised | 8 | 0 |" in out
    data = json.loads((tmp_path / "steerings_table.json").read_text())
    assert len(data["records"]) == 24
    assert [r["steering"] for r in data["records"]] == ["greedy"] * 8 + ["sampled T=0.9"] * 8 + ["penalised"] * 8
    assert all(0 < r["tokens_predicted"] <= 8 for r in data["records"])
    greedy = [r["text"] for r in data["records"][:8]]
    assert greedy[:4] != greedy[4:8]  # different prompts, different answers: results kept in order


def test_document_questions(tmp_path):
    out = run("document_questions.py", tmp_path, 6)
    assert "time to first token, cold" in out and "time to first token, forked" in out
    assert (tmp_path / "document_questions.png").stat().st_size > 5000
    data = json.loads((tmp_path / "document_questions.json").read_text())
    doc = data["document_tokens"]
    assert len(data["cold"]) == len(data["forked"]) == 6
    for cold, forked in zip(data["cold"], data["forked"]):
        assert cold["error"] is None and forked["error"] is None
        assert cold["tokens_prompt"] > doc > forked["tokens_prompt"]  # the fork skipped the document
        assert cold["ttft_ms"] > 0 and forked["ttft_ms"] > 0


def test_cache_divergence(tmp_path):
    out = run("cache_divergence.py", tmp_path, 4, 16)
    assert (tmp_path / "cache_divergence.png").stat().st_size > 5000
    data = json.loads((tmp_path / "cache_divergence.json").read_text())
    assert [r["cache"] for r in data["summary"]] == ["f16", "q8_0", "q4_0"]
    assert [r["cache_k"] for r in data["summary"]] == ["f16", "q8_0", "q4_0"]
    assert [(p["config"], p["index"]) for p in data["pairs"]] == [(c, i) for c in ("q8_0", "q4_0") for i in range(4)]
    for p in data["pairs"]:
        assert p["first_divergence"] is None or 0 <= p["first_divergence"] < 16
    # the recorded run is one `clickpaca results compare` accepts
    cmp = subprocess.run([sys.executable, "-m", "clickpaca", "results", "compare", str(data["run_id"])],
                         capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr
    assert "q8_0" in cmp.stdout and "q4_0" in cmp.stdout


def test_user_step(tmp_path):
    out = run("user_step.py", tmp_path, 6, 12)
    assert "| wordBias |" in out
    data = json.loads((tmp_path / "user_step.json").read_text())
    rows = {r["word_bias"]: r for r in data["rows"]}
    assert sorted(rows) == [0.0, 2.0, 4.0, 8.0] and all(r["outputs"] == 6 for r in rows.values())
    assert rows[0.0]["step_ms"] is None  # at wordBias 0 the step is off: it never ran
    assert all(rows[b]["step_ms"] > 0 for b in (2.0, 4.0, 8.0))
    assert rows[8.0]["per_output"] > rows[0.0]["per_output"]  # +8 nats on the listed words shows


@pytest.mark.activations
def test_causal_trace(tmp_path):
    """One noise sample: the corruption removes the answer, restoring the last layer at the
    last position brings it back, and restoring before the subject changes nothing."""
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    p = subprocess.run([sys.executable, str(EXAMPLES / "causal_trace.py"), "--samples", "1", "--plot",
                        str(tmp_path / "trace.png")], capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, f"causal_trace.py failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    r = json.loads(p.stdout)
    grid = r["grid"]  # positions x layers
    assert len(grid) == len(r["tokens"]) and r["cells"] == len(grid) * len(grid[0])
    assert r["p_clean"] > 0.3 and r["p_corrupt"] < r["p_clean"] / 10
    assert abs(grid[-1][-1] - r["p_clean"]) < 0.05  # the clean final state at the last token
    assert all(abs(x - r["p_corrupt"]) < 0.01 for x in grid[0])  # the BOS: before the subject
    assert (tmp_path / "trace.png").stat().st_size > 5000


def test_steer_grid(tmp_path):
    """Two derived vectors, a 3 x 3 strength grid in one batch with a trigger: every cell
    scored, the figure written."""
    out = run("steer_grid.py", tmp_path, 1, 8, "--seeds", "1")
    assert "9 outputs, 1 per cell" in out and "| sentiment \\ formality | -0.3 | +0 | +0.3 |" in out
    assert sum(line.startswith(("| -2 |", "| +0 |", "| +2 |")) for line in out.splitlines()) == 3
    assert (tmp_path / "steer-grid.png").stat().st_size > 5000
