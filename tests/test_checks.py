"""The measuring commands' checks before any work (clickpaca/measure/checks.py), through the
real command line: one line naming the argument, a non-zero exit, and no run in the results
store (CLICKPACA_RESULTS is the tests' own store, conftest.results_store); and a failure
during the work: the run recorded with what was measured, marked failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clickpaca.llama.native import build_dir
from clickpaca.results.store import Store

ROOT = Path(__file__).resolve().parent.parent


def _runs() -> list[int]:
    with Store() as s:
        return [r["id"] for r in s.runs()]


def _cli(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clickpaca", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def bare_builds(tmp_path_factory):
    """A builds folder with the mainline build's record and nothing else: no llama.cpp tools,
    no llama-server (`make peer` not run), no turboquant build. The model checks still pass."""
    root = tmp_path_factory.mktemp("builds")
    (root / "mainline").mkdir()
    (root / "mainline" / "build-info.json").write_bytes((build_dir("mainline") / "build-info.json").read_bytes())
    return {"CLICKPACA_BUILDS": str(root)}


REFUSED = [
    (["ppl", "--cache", "bogus"], "clickpaca ppl: --cache 'bogus': K: unknown cache type 'bogus'; valid: "),
    (["ppl", "--cache", "f16", "--noise", "--noise-of", "q9"], "clickpaca ppl: --noise-of 'q9': K: unknown cache type"),
    (["ppl", "--ctx", "512", "--score-last", "4096"], "clickpaca ppl: --score-last"),
    (["ppl", "--score-last", "128", "--native"], "clickpaca ppl: --score-last: llama-perplexity (--native) cannot"),
    (["bench", "kv", "--cache", "nope"], "clickpaca bench kv: --cache 'nope': K: unknown cache type 'nope'"),
    (["bench", "state", "--cache", "f16/zz"], "clickpaca bench state: --cache 'f16/zz': V: unknown cache type 'zz'"),
    (["bench", "kv", "--cache", "turbo3", "--build", "kvcenter"],
     "clickpaca bench kv: --cache 'turbo3': a type of build 'turboquant', not of --build kvcenter"),
    (["ppl", "--model", "/nonexistent/model.gguf"], "clickpaca ppl: --model: "),
    (["bench", "decode", "--model", "nope-model"], "clickpaca bench decode: --model: "),
    (["bench", "state", "--text", "/nonexistent/play.txt"], "clickpaca bench state: --text /nonexistent/play.txt: no such file"),
    (["bench", "schemas"], "clickpaca bench schemas: needs a corpus"),
    (["bench", "schemas", "/nonexistent/schemas"], "clickpaca bench schemas: corpus '/nonexistent/schemas': not a directory"),
    (["bench", "batch", "--against", "no-such-rev"], "clickpaca bench batch: --against no-such-rev: not a commit"),
    (["bench", "batch", "--center", "/nonexistent/c.npz"], "clickpaca bench batch: --center /nonexistent/c.npz: "),
    (["bench", "batch", "--chain", "greedy,nope"], "clickpaca bench batch: --chain: unknown chain 'nope'; known: greedy, "),
    (["bench", "peer", "--loads", "greedy1,huge"], "clickpaca bench peer: --loads: unknown huge; known: greedy1, "),
    (["kv-retrieval", "--cache", "q4_0+c/q4_0"], "clickpaca kv-retrieval: --cache 'q4_0+c/q4_0': a centered pair"),
]
#: refused for what the (bare) builds folder lacks
REFUSED_BARE = [
    (["bench", "peer"], "clickpaca bench peer: llama-server: ", "run `make peer`"),
    (["bench", "decode"], "clickpaca bench decode: llama-bench not found in build 'mainline'", "run `make mainline`"),
    (["bench", "batch"], "clickpaca bench batch: llama-batched-bench not found", "run `make mainline`"),
    (["bench", "kv", "--cache", "f16", "--speed"], "clickpaca bench kv: llama-bench not found", "run `make mainline`"),
    (["ppl", "--native"], "clickpaca ppl: llama-perplexity not found", "run `make mainline`"),
    (["bench", "kv", "--cache", "q8_0/turbo3"], "clickpaca bench kv: --cache q8_0/turbo3 needs build 'turboquant'",
     "run `make turboquant`"),
    (["bench", "all"], "clickpaca bench all: decode: llama-bench not found", "run `make mainline`"),
]


def test_failures_read_from_a_result():
    from clickpaca.measure.checks import failures

    assert failures({"rows": [{"cache": "f16", "kv_bytes": 1}]}) == []
    assert failures(None) == [] and failures({"rows": []}) == []
    assert failures({"rows": [{"seqs": 8, "errors": []}]}) == []
    assert failures({"rows": [{"seqs": 8, "errors": ["json: cut"]}]}) == ["8: ['json: cut']"]
    got = failures({"rows": [{"cache": "q8_0", "error": "server died"}, {"cache": "f16", "speed_error": "x"}],
                    "problems": [{"source": "in-process", "message": "refused: f32/q8_0"}],
                    "server_problems": ["4 sequences: errors"]})
    assert got == ["refused: f32/q8_0", "4 sequences: errors", "q8_0: server died", "f16: x"]


def _refused(r: subprocess.CompletedProcess, start: str, end: str = "") -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith(start) and lines[0].endswith(end), lines[0]
    assert r.stdout == ""


@pytest.mark.model
@pytest.mark.parametrize("argv,start", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_argument_is_refused_in_one_line_before_any_work(argv, start):
    before = _runs()
    _refused(_cli(*argv), start)
    assert _runs() == before


@pytest.mark.model
@pytest.mark.parametrize("argv,start,end", REFUSED_BARE, ids=[" ".join(a) for a, *_ in REFUSED_BARE])
def test_a_missing_tool_or_build_is_refused_in_one_line_naming_the_make_target(argv, start, end, bare_builds):
    before = _runs()
    _refused(_cli(*argv, env=bare_builds), start, end)
    assert _runs() == before


@pytest.mark.model
@pytest.mark.slow
def test_a_failure_during_the_work_records_what_was_measured_marked_failed(tmp_path):
    """llama.cpp refuses f32 K with q8_0 V (flash attention off for f32, and a quantized V
    needs it), which only a server finds out: f16's row is measured and recorded, the run is
    marked failed, and the command says so in one line and exits 1."""
    before = _runs()
    r = _cli("bench", "kv", "--cache", "f16,f32/q8_0", "--kv-ctx", "256", "--out", str(tmp_path))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("clickpaca bench kv: ")]
    assert line.startswith("clickpaca bench kv: failed: f32/q8_0: "), line
    [new] = [i for i in _runs() if i not in before]
    with Store() as s:
        run = s.run(new)
    assert run["status"] == "failed" and "f32/q8_0" in run["error"], (run["status"], run["error"])
    rows = {row["cache"]: row for row in run["result"]["rows"]}
    assert rows["f16"]["kv_bytes"] > 0 and "error" in rows["f32/q8_0"]
    assert json.loads((tmp_path / "kv.json").read_text())["rows"][0]["cache"] == "f16"
