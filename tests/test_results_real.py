"""The results store fed by short real runs of the real commands (real server, real model):
`clickpaca ppl` with a small context, `clickpaca bench decode` with few tokens, then
`clickpaca results compare` on what they recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from clickpaca.results.store import Store

pytestmark = [pytest.mark.model, pytest.mark.slow]


def clickpaca(db, *args, check=True, env=None):
    env = dict(os.environ, CLICKPACA_RESULTS=str(db), OMP_WAIT_POLICY="passive", **(env or {}))
    p = subprocess.run([sys.executable, "-m", "clickpaca", *args], capture_output=True, text=True, env=env,
                       timeout=900)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def run_id(p) -> int:
    return int(re.search(r"\[results\] run (\d+) complete", p.stderr).group(1))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Three short ppl runs: f16,q8_0 and q4_0 over the same windows, f16 over other windows;
    a bench kv run with llama-bench speeds (as make kv-study, tiny) in a group; two decode runs
    of 8 tokens, 2 rounds."""
    d = tmp_path_factory.mktemp("real")
    db = d / "results.sqlite3"
    ids = {}
    out = d / "out"
    ids["ppl_f16_q8"] = run_id(clickpaca(db, "ppl", "--cache", "f16,q8_0", "--ctx", "128", "--chunks", "2",
                                         "--out", str(out)))
    ids["ppl_json"] = json.loads((out / "ppl.json").read_text())
    ids["ppl_q4"] = run_id(clickpaca(db, "ppl", "--cache", "q4_0", "--ctx", "128", "--chunks", "2",
                                     "--out", str(d / "out2")))
    ids["ppl_ctx64"] = run_id(clickpaca(db, "ppl", "--cache", "f16", "--ctx", "64", "--chunks", "2",
                                        "--out", str(d / "out3")))
    kv = clickpaca(db, "bench", "kv", "--cache", "f16", "--speed", "--prompt-tokens", "32", "--tokens", "4",
                   "--repeats", "2", "--kv-ctx", "256", "--out", str(d / "kv"), env={"CLICKPACA_RUN_GROUP": "study-1"})
    ids["kv"] = run_id(kv)
    for k in ("decode_a", "decode_b"):
        ids[k] = run_id(clickpaca(db, "bench", "decode", "--tokens", "8", "--repeats", "2",
                                  "--out", str(d / k)))
    return db, ids


def test_a_ppl_run_is_recorded_with_provenance_and_per_token_samples(recorded, model):
    from clickpaca.engine.kvstate import model_identity

    db, ids = recorded
    rid = ids["ppl_f16_q8"]
    with Store(db) as s:
        run, smp = s.run(rid), s.samples(rid)
    assert run["status"] == "complete" and run["command"] == "ppl"
    p = run["provenance"]
    ident = model_identity(model)
    assert p["model"]["edge_sha256"] == ident["edge_sha256"] == run["model_sha"]
    assert p["model"]["size"] == ident["size"]
    assert p["builds"]["mainline"]["commit"] == model.nat.info["commit"]
    assert p["builds"]["mainline"]["build_number"] == model.nat.info["build_number"]
    assert len(p["git"]["commit"]) == 40
    rows = {r["cache"]: r for r in run["result"]["rows"]}
    assert set(smp) == {"f16", "q8_0"}
    for name, r in rows.items():
        nll = smp[name]["token_nll"]
        assert len(nll) == r["tokens_server"] == r["tokens_inproc"] == len(smp[name]["token_nll_inproc"])
        assert float(np.exp(nll.mean())) == pytest.approx(r["ppl_server"], rel=1e-5)
    assert len(smp["q8_0"]["token_kl"]) == len(smp["q8_0"]["token_nll"])
    assert float(smp["q8_0"]["token_top1"].mean()) == pytest.approx(rows["q8_0"]["top1_agreement"])
    # bench-results/ppl.json: the latest export names its run and leaves the arrays in the store
    assert ids["ppl_json"]["results_run"] == rid and "samples" not in ids["ppl_json"]


def test_compare_prints_delta_ppl_with_interval_and_verdict(recorded):
    db, ids = recorded
    rid = ids["ppl_f16_q8"]
    with Store(db) as s:
        rows = {r["cache"]: r for r in s.run(rid)["result"]["rows"]}
    out = clickpaca(db, "results", "compare", str(rid)).stdout
    line = next(x for x in out.splitlines() if x.startswith(f"| {rid}:f16 | {rid}:q8_0"))
    delta = float(re.search(r"\| ([+-][0-9.]+) \[", line).group(1))
    assert delta == pytest.approx(rows["q8_0"]["ppl_server"] - rows["f16"]["ppl_server"], abs=2e-3)
    assert re.search(r"(within noise|higher|lower)\s*\|$", line)
    data = json.loads(clickpaca(db, "results", "compare", str(rid), "--json").stdout)
    [p] = data["pairs"]
    lo, hi = p["delta_ppl_ci"]
    assert lo <= p["delta_ppl"] <= hi
    assert p["kl"]["ci"][0] <= p["kl"]["mean"] <= p["kl"]["ci"][1]


def test_compare_two_real_runs_of_different_cache_types(recorded):
    db, ids = recorded
    a, b = ids["ppl_f16_q8"], ids["ppl_q4"]
    data = json.loads(clickpaca(db, "results", "compare", f"{a}:f16", f"{b}:q4_0", "--json").stdout)
    [p] = data["pairs"]
    with Store(db) as s:
        f16 = s.run(a)["result"]["rows"][0]
        q4 = s.run(b)["result"]["rows"][0]
    assert p["tokens"] == f16["tokens_server"] == q4["tokens_server"]
    assert p["delta_ppl"] == pytest.approx(q4["ppl_server"] - f16["ppl_server"], rel=1e-4)
    assert p["verdict"] in ("within noise", "higher", "lower")
    # the other windows: refused with the reason, then forced and still unpairable
    c = ids["ppl_ctx64"]
    refused = clickpaca(db, "results", "compare", str(a), str(c), check=False)
    assert refused.returncode == 2 and "the window (--ctx) differs" in refused.stderr
    forced = clickpaca(db, "results", "compare", f"{a}:f16", f"{c}:f16", "--force", check=False)
    assert forced.returncode == 2 and "cannot be paired" in forced.stderr


def test_bench_decode_records_its_rounds_and_compares_by_ratio(recorded):
    db, ids = recorded
    a, b = ids["decode_a"], ids["decode_b"]
    with Store(db) as s:
        run, smp = s.run(a), s.samples(a)
    assert run["status"] == "complete" and run["command"] == "bench decode"
    assert run["params"]["tokens"] == 8 and run["params"]["repeats"] == 2
    assert len(smp["llama_bench_tg"]["rounds"]) == 2
    assert len(smp["server/greedy/eval_tps"]["rounds"]) == 2
    assert (smp["server/greedy/eval_tps"]["rounds"] > 0).all()
    data = json.loads(clickpaca(db, "results", "compare", str(a), str(b), "--json").stdout)
    names = {p["a"].split(":", 1)[1] for p in data["pairs"]}
    assert {"llama_bench_tg", "server/greedy/eval_tps", "server/default_chain/wall_tps"} <= names
    for p in data["pairs"]:
        assert p["kind"] == "speed" and p["rounds_a"] == p["rounds_b"] == 2
        assert p["ci"][0] <= p["ratio"] <= p["ci"][1]
    listed = clickpaca(db, "results", "list", "--command", "bench decode").stdout
    assert "2 run(s)" in listed


def test_bench_kv_speed_records_the_repetitions_in_its_group(recorded):
    db, ids = recorded
    with Store(db) as s:
        run, smp = s.run(ids["kv"]), s.samples(ids["kv"])
    assert run["status"] == "complete" and run["run_group"] == "study-1"
    [row] = run["result"]["rows"]
    assert row["bytes_per_token"] == 18 * 256 * 2 * 2 and row["pp_vs_f16"] == 1.0
    assert list(smp["rows/cache=f16/pp_tps"]["rounds"]) == row["pp_tps"]["samples"]
    assert len(smp["rows/cache=f16/tg_tps"]["rounds"]) == 2
    listed = clickpaca(db, "results", "list", "--group", "study-1").stdout
    assert "1 run(s)" in listed and "bench kv" in listed
