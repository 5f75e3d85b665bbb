"""clickpaca.measure.bench: parsers of the native tools' output (captured samples), statistics
helpers, markdown tables, and two small real runs. No timing thresholds anywhere: the
numbers depend on the machine and its load."""

from __future__ import annotations

import argparse
import importlib
import json
import math

import numpy as np
import pytest

from clickpaca.measure.bench import tools
from clickpaca.results import stats, table
from clickpaca.measure.bench.cachetypes import pair_bpv
from clickpaca.llama.cachetypes import pair_name, parse_pair
from clickpaca.cli import build_parser

# ---------------------------------------------------------------- captured tool output

# builds/mainline/bin/llama-bench -m gemma-3-270m-q4_k_m.gguf -p 0 -n 16 -t 2 -r 2 -o json
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e57098",
    "build_number": 11312,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/root/.cache/clickpaca/models/gemma-3-270m-q4_k_m.gguf",
    "model_type": "gemma3 270M Q4_K - Medium",
    "model_size": 246587904,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": -1,
    "n_prompt": 0,
    "n_gen": 16,
    "n_depth": 0,
    "test_time": "2026-11-29T16:00:19Z",
    "avg_ns": 2550534978,
    "stddev_ns": 65613995,
    "avg_ts": 6.275270,
    "stddev_ts": 0.161435,
    "samples_ns": [ 2596931052, 2504138905 ],
    "samples_ts": [ 6.16112, 6.38942 ]
  }
]
"""

# llama-batched-bench -c 1024 -npp 16 -ntg 8 -npl 1,4 -t 2 --output-format jsonl
BATCHED_JSONL = """
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 1, "n_kv": 24, "t_pp": 0.432579, "speed_pp": 36.987461, "t_tg": 1.266513, "speed_tg": 6.316556, "t": 1.699092, "speed": 14.125192}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 4, "n_kv": 96, "t_pp": 1.353931, "speed_pp": 47.269768, "t_tg": 2.798522, "speed_tg": 11.434608, "t": 4.152453, "speed": 23.118866}
"""

# llama-batched-bench -c 512 -npp 8 -ntg 4 -npl 1,2 -t 2 (default markdown output)
BATCHED_MD = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.474 |    16.87 |    0.800 |     5.00 |    1.274 |     9.42 |
|     8 |      4 |    2 |     24 |    0.560 |    28.57 |    1.028 |     7.78 |    1.588 |    15.11 |
"""

# llama-perplexity -c 256 --chunks 2 -fa on -ctk f16 -ctv f16 -t 2 (stdout, then stderr)
PPL_STDOUT = "[1]14.7307,[2]17.8607,\n"
PPL_STDERR = """0.06.751.218 I perplexity: calculating perplexity over 2 chunks, n_ctx=256, batch_size=2048, n_seq=8
0.25.776.674 I perplexity: 19.03 seconds per pass - ETA 0.26.705.156 I Final estimate: PPL = 17.8607 +/- 3.55426
"""


def test_parse_llama_bench_json():
    [rec] = tools.parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert rec["n_gen"] == 16 and rec["n_prompt"] == 0 and rec["n_threads"] == 2
    assert rec["avg_ts"] == pytest.approx(6.27527)
    assert rec["samples_ts"] == [6.16112, 6.38942]
    assert rec["build_commit"] == "0c1e57098"


def test_parse_llama_bench_jsonl():
    line = json.dumps(json.loads(LLAMA_BENCH_JSON)[0])
    [rec] = tools.parse_llama_bench_json(line + "\n")
    assert rec["avg_ts"] == pytest.approx(6.27527)


def test_parse_llama_bench_empty():
    with pytest.raises(tools.ToolError):
        tools.parse_llama_bench_json("  \n")


def test_parse_batched_bench_jsonl():
    rows = tools.parse_batched_bench(BATCHED_JSONL)
    assert [r["pl"] for r in rows] == [1, 4]
    assert rows[1]["speed_tg"] == pytest.approx(11.434608)
    assert rows[1]["t_tg"] == pytest.approx(2.798522)
    # S_TG = pl * tg / t_tg
    assert rows[1]["speed_tg"] == pytest.approx(4 * 8 / rows[1]["t_tg"], rel=1e-4)


def test_parse_batched_bench_markdown():
    rows = tools.parse_batched_bench(BATCHED_MD)
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(8, 4, 1), (8, 4, 2)]
    assert rows[0]["speed_tg"] == 5.00 and rows[1]["speed_tg"] == 7.78
    assert rows[1]["n_kv"] == 24


def test_parse_batched_bench_nothing():
    with pytest.raises(tools.ToolError):
        tools.parse_batched_bench("llama_batched_bench: n_kv_max = 512\n")


def test_parse_perplexity():
    rec = tools.parse_perplexity(PPL_STDOUT + "\n" + PPL_STDERR)
    assert rec["ppl"] == pytest.approx(17.8607)
    assert rec["ppl_err"] == pytest.approx(3.55426)
    assert rec["chunk_estimates"] == [14.7307, 17.8607]


def test_parse_perplexity_missing():
    with pytest.raises(tools.ToolError):
        tools.parse_perplexity(PPL_STDOUT)


# ---------------------------------------------------------------- statistics


def test_median_skips_missing_and_nan():
    assert stats.median([3.0, None, 1.0, float("nan"), 2.0]) == 2.0
    assert stats.median([1, 2, 3, 4]) == 2.5
    assert stats.median([]) is None
    assert stats.median([None]) is None


def test_ratio():
    assert stats.ratio(9.0, 10.0) == pytest.approx(0.9)
    assert stats.ratio(None, 1.0) is None
    assert stats.ratio(1.0, 0) is None


def test_summary_and_spread():
    s = stats.summary([2.0, None, 5.0, 1.0])
    assert (s["median"], s["min"], s["max"]) == (2.0, 1.0, 5.0)
    assert s["samples"] == [2.0, None, 5.0, 1.0]


def test_alternate_interleaves_sides_and_turns_the_order():
    order = []
    res = stats.alternate({"a": lambda r: order.append(("a", r)) or r,
                           "b": lambda r: order.append(("b", r)) or 10 * r,
                           "c": lambda r: order.append(("c", r)) or 100 * r}, 4)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 2), ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("c", 3)]
    assert res == {"a": [0, 1, 2, 3], "b": [0, 10, 20, 30], "c": [0, 100, 200, 300]}
    assert stats.alternate({}, 3) == {}


def test_parse_list():
    assert stats.parse_list("1, 2,4,,8") == [1, 2, 4, 8]
    assert stats.parse_list("f16,q8_0/turbo3", str) == ["f16", "q8_0/turbo3"]
    assert stats.parse_list(None) == []


def test_cache_pairs():
    assert parse_pair("q8_0") == ("q8_0", "q8_0")
    assert parse_pair("q8_0/turbo3") == ("q8_0", "turbo3")
    assert pair_name("f16", "f16") == "f16" and pair_name("q8_0", "q4_0") == "q8_0/q4_0"
    assert pair_bpv("q8_0", "q4_0", {"q8_0": 8.5, "q4_0": 4.5}) == 6.5
    assert pair_bpv("x", "q4_0", {"q4_0": 4.5}) is None


# ---------------------------------------------------------------- tables


def test_markdown_table():
    out = table.markdown(["name", "tok/s", "ratio"], [("server", 53.21, 0.987), ("native", 54.0, None)])
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("| name") and "tok/s" in lines[0]
    assert lines[1].replace("|", "").replace("-", "").replace(":", "").strip() == ""
    assert lines[1].endswith(":|")  # numeric column right-aligned
    assert "53.21" in lines[2] and "0.987" in lines[2]
    assert lines[3].split("|")[3].strip() == "-"  # None renders as '-'
    assert len({len(line) for line in lines}) == 1  # columns are padded


def test_fmt():
    assert table.fmt(None) == "-"
    assert table.fmt(True) == "yes"
    assert table.fmt(75497472) == "75,497,472"
    assert table.fmt(1234.5) == "1,234"
    assert table.fmt(0.00643) == "0.00643"
    assert table.fmt("a|b") == "a\\|b"
    assert table.fmt(float("nan")) == "nan"


def test_kl_helpers():
    from clickpaca.measure.kl import kl_rows, log_softmax

    rng = np.random.default_rng(0)
    rows = rng.normal(size=(3, 50)).astype(np.float32)
    lp = log_softmax(rows)
    assert np.allclose(np.exp(lp).sum(axis=1), 1.0, atol=1e-5)
    assert np.allclose(kl_rows(lp, lp), 0.0, atol=1e-6)
    other = log_softmax(rows + rng.normal(size=rows.shape).astype(np.float32))
    assert (kl_rows(lp, other) > 0).all()


def test_cli_parses_bench_and_ppl():
    ap = build_parser()
    a = ap.parse_args(["bench", "batch", "--seqs", "1,8", "--tokens", "16"])
    assert a.what == "batch" and a.seqs == "1,8" and a.tokens == 16 and a.repeats is None
    a = ap.parse_args(["ppl", "--cache", "f16,q8_0/q4_0", "--ctx", "256", "--chunks", "2"])
    assert a.cache == "f16,q8_0/q4_0" and a.ctx == 256
    assert ap.parse_args(["bench", "batch", "--chain", "n_probs_5"]).chain == "n_probs_5"


def test_bench_batch_side_servers_are_the_ones_asked_for():
    from clickpaca.measure.bench.batch import side_servers

    ap = build_parser()
    assert side_servers(ap.parse_args(["bench", "batch"])) == {}
    got = side_servers(ap.parse_args(["bench", "batch", "--preselect", "--center", "c.npz", "--build", "kvcenter"]))
    assert got == {"preselect": ("pre", {"preselect": True}), "centered": ("cen", {"kvCenter": "c.npz"})}
    assert side_servers(ap.parse_args(["bench", "batch", "--ubatch", "63"])) == {"ubatch": ("ub", {"nUbatch": 63})}


def test_bench_batch_chain_fields():
    """--chain: a scenario's fields that differ from the defaults, the EOG bans merged into
    its own logit_bias (a ban wins over the scenario's bias of the same token)."""
    from clickpaca.measure.bench.batch import chain_params
    from clickpaca.sampling import SamplerParams
    from clickpaca.sampling.bench import SCENARIOS

    ban = {"logit_bias": [{"token": 1, "bias": -1e9}, {"token": 2, "bias": -1e9}]}
    assert chain_params(None, ban) == chain_params("greedy", ban) == {"temperature": 0, **ban}
    assert chain_params("n_probs_5", ban) == {"nProbs": 5, **ban}
    assert chain_params("temperature_only", ban) == {"topK": 0, "topP": 1.0, "temperature": 0.9, **ban}
    bp = chain_params("bias_penalties", ban)
    assert [b["token"] for b in bp["logit_bias"]] == [1, 2, 106, 1000, 2000]
    assert {b["token"]: b["bias"] for b in bp["logit_bias"]}[2] == -1e9
    want = SCENARIOS["bias_penalties"][0]
    got = SamplerParams.from_request(bp)
    assert (got.penalty_repeat, got.penalty_freq, got.penalty_present) == (
        want.penalty_repeat, want.penalty_freq, want.penalty_present)
    with pytest.raises(ValueError, match="--chain: unknown chain 'grammar_10pct'"):
        chain_params("grammar_10pct", ban)


# ---------------------------------------------------------------- small real runs


def _args(tmp_path, **kw):
    base = dict(what=None, seqs=None, tokens=None, prompt_tokens=None, threads=None, repeats=1,
                cache=None, doc_tokens=None, kv_ctx=None, text=None, model=None, build="mainline",
                out=str(tmp_path), plot=True)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.model
@pytest.mark.slow
def test_bench_sampler_real(tmp_path, monkeypatch):
    from clickpaca.measure.bench import sampler

    monkeypatch.setattr(sampler, "SYNTH_REPEATS", 5)
    monkeypatch.setattr(sampler, "REAL_ROWS", 4)
    monkeypatch.setattr(sampler, "STEP_REPEATS", 1)

    out = sampler.run(_args(tmp_path, what="sampler", repeats=1))
    data = json.loads((tmp_path / "sampler.json").read_text())
    assert data["params"]["n_vocab"] == 262_144
    assert len(out["results"]) == len(sampler.SCENARIOS)
    for r in out["results"]:
        assert r["us_per_token"] > 0 and math.isfinite(r["us_per_token"])
        assert r["steps_us"]
        assert r["real_rows"]["chain_cpu"] > 0  # the model loaded: real rows were measured
        host = r["preselect_real_decode"]  # the pre-selection's whole host share, on a real decode
        if r["scenario"] == "trace":
            assert host is None  # trace takes the host path
        else:
            assert all(host[k] > 0 for k in ("order", "callbacks", "read", "sample", "again")), host
            assert host["total"] == pytest.approx(host["order"] + host["callbacks"] + host["read"] + host["sample"],
                                                  abs=0.25)
    assert (tmp_path / "sampler.png").stat().st_size > 0
    from clickpaca.sampling import registry

    named = {s.name for s in registry.steps() if s.run is not None} - {"logit_bias"}
    assert named <= set(data["steps"])  # every llama.cpp step, beside llama.cpp's C sampler
    for name in named:
        v = data["steps"][name]
        assert v["ours_us"] > 0 and v["llama_us"] > 0 and v["ratio"] > 0, (name, v)
    assert "trace" in next(r for r in out["results"] if r["scenario"] == "trace")["steps_us"]


@pytest.mark.model
@pytest.mark.slow
def test_bench_batch_runs_several_chains_in_the_same_rounds(tmp_path):
    """--chain a,b: one row per chain on the same servers and rounds (one native run per
    round), each with its ratio to the first chain's figures on the same server, and
    every sequence made its G tokens on every side."""
    from clickpaca.measure.bench import batch

    out = batch.run(_args(tmp_path, what="batch", seqs="2", tokens=4, prompt_tokens=8, chain="greedy,default",
                          preselect=True))
    rows = out["rows"]
    assert [(r["seqs"], r["chain"]) for r in rows] == [(2, "greedy"), (2, "default")]
    assert rows[0]["native_s_tg"] == rows[1]["native_s_tg"]  # one llama-batched-bench run serves both
    assert rows[0]["server_vs_first"]["rounds"] == [1.0] and rows[0]["pre_vs_first"]["rounds"] == [1.0]
    for r in rows:
        assert r["server_tokens"] == [[4, 4]] and r["pre_tokens"] == [[4, 4]]
        assert r["server_vs_first"]["median"] > 0 and r["pre_vs_first"]["median"] > 0
    fields = out["params"]["infer_fields"]  # each chain's own: greedy's temperature 0, default's its own
    assert fields["greedy"]["temperature"] == 0 and "temperature" not in fields["default"]
    text = batch.table(out)
    assert "server / first chain" in text and "preselect / its first chain" in text


@pytest.mark.model
@pytest.mark.slow
def test_bench_batch_fresh_servers_start_a_process_per_round(tmp_path):
    """--fresh-servers: each side runs every round on a process of its own, each closed
    cleanly (a problem at shutdown would be listed), and the rows are as without it."""
    from clickpaca.measure.bench import batch

    out = batch.run(_args(tmp_path, what="batch", seqs="1,2", tokens=4, prompt_tokens=8, repeats=2,
                          fresh_servers=True))
    assert out["server_processes"] == {"server": 4}  # 2 rounds at each of 2 N
    assert out["server_problems"] == [] and out["params"]["fresh_servers"] is True
    assert [r["seqs"] for r in out["rows"]] == [1, 2]
    assert [r["server_tokens"] for r in out["rows"]] == [[[4]] * 2, [[4, 4]] * 2]
    assert any("--fresh-servers" in n for n in out["notes"])


@pytest.mark.model
@pytest.mark.slow
def test_bench_sampler_ticks_real(tmp_path, monkeypatch):
    """--seqs: per tick, the decode beside the host's sampling (per sequence and batched,
    which the bench itself checks equal)."""
    from clickpaca.measure.bench import sampler, sampler_ticks

    monkeypatch.setattr(sampler_ticks, "TICKS", 1)
    out = sampler.run(_args(tmp_path, what="sampler", seqs="1,3", repeats=1))
    data = json.loads((tmp_path / "sampler.json").read_text())
    assert [t["n_seq"] for t in data["ticks"]] == [1, 3]
    for t in out["ticks"]:
        assert t["decode_ms"] > 0
        assert t["sides"] == ["per_seq", "batched", "threads"]  # threads: the decode's
        assert set(t["scenarios"]) == set(sampler_ticks.TICK_SCENARIOS)
        for s in t["scenarios"].values():
            assert s["per_seq_wall_ms"] > 0 and s["batched_wall_ms"] > 0 and s["threads_wall_ms"] > 0
            assert s["threads_proc_cpu_ms"] > 0
            assert s["fraction_per_seq"] == pytest.approx(s["per_seq_wall_ms"] / t["decode_ms"], rel=0.02)


@pytest.mark.model
@pytest.mark.slow
def test_bench_kv_f16_real(tmp_path):
    from clickpaca.measure.bench import kv

    out = kv.run(_args(tmp_path, what="kv", cache="f16", kv_ctx=1024))
    [row] = out["rows"]
    assert row["cache"] == "f16" and row["n_ctx"] == 1024
    # Gemma 3 270M: 18 layers x 1 KV head x 256 dims x (K + V) x 2 bytes per token
    assert row["bytes_per_token"] == 18 * 256 * 2 * 2
    assert row["bpv_nominal"] == 16.0 and row["bpv_effective"] == 16.0
    data = json.loads((tmp_path / "kv.json").read_text())
    assert data["rows"][0]["kv_bytes"] == 1024 * 18432
    assert "| f16" in data["table_markdown"]


def test_bench_all_runs_every_bench_and_keeps_explicit_options(monkeypatch, tmp_path):
    """`bench all` is the table's rows with options of their own: every row's checks before
    any bench measures, then each bench with the user's options winning over the set's."""
    from clickpaca.measure.bench import benches
    from clickpaca.measure.bench import cli as bench_cli

    events = []
    monkeypatch.setattr(bench_cli, "check", lambda args, needs: events.append(("check", args.what, needs)))
    monkeypatch.setattr(benches.Bench, "run", lambda self, args: events.append(
        ("run", self.name, (args.repeats, args.tokens, args.seqs))) or {"rows": []})
    args = build_parser().parse_args(["bench", "all", "--repeats", "1", "--out", str(tmp_path)])
    assert bench_cli.run_bench(args) == 0
    in_all = [b.name for b in benches.in_all()]
    assert in_all == [b.name for b in benches.BENCHES if b.name != "schemas"]
    assert events[:len(in_all)] == [("check", b.name, b.needs) for b in benches.in_all()]
    seen = {name: got for kind, name, got in events[len(in_all):]}
    assert [e[0] for e in events[len(in_all):]] == ["run"] * len(in_all) and list(seen) == in_all
    assert all(v[0] == 1 for v in seen.values())  # the explicit --repeats wins
    assert seen["batch"][1:] == (32, "1,8,64")  # the set's defaults fill the rest


def test_the_command_line_offers_every_row_of_the_bench_table():
    from clickpaca.measure import checks
    from clickpaca.measure.bench import benches

    ap = build_parser()
    for b in benches.BENCHES:
        assert ap.parse_args(["bench", b.name]).what == b.name
        assert importlib.import_module(f"clickpaca.measure.bench.{b.module}").run
        for need in b.needs:  # every declared check exists, and its option is one of bench's
            name, _, option = need.partition(" if ")
            assert name in checks.CHECKS, (b.name, need)
            assert not option or hasattr(ap.parse_args(["bench", b.name]), option), (b.name, need)
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "decode_against"])
    help_text = ap._subparsers._group_actions[0].choices["bench"].format_help()
    assert all(f"  {b.name}" in help_text and b.help[:40] in " ".join(help_text.split()) for b in benches.BENCHES)


def test_group_stats_steady_state_window():
    from clickpaca.measure.bench.serve import SeqRun, group_stats

    def run(sid, times):
        return SeqRun(sid, 0.0, tokens=len(times), t_first=times[0], t_last=times[-1], times=times,
                      final={"type": "done", "eval_tps": 1.0, "tokens_prompt": 3,
                             "stop_reason": "max_tokens", "_t": times[-1]})

    # sequence 1 got its prompt one tick later (admission skew of 1 s)
    st = group_stats([run(0, [1.0, 2.0, 3.0, 4.0]), run(1, [2.0, 3.0, 4.0, 5.0])])
    assert st["steady_tps"] == 2.0  # both generating between t=2 and t=4: 4 tokens in 2 s
    assert st["wall_tps"] == st["steady_tps"]
    assert st["span_tps"] == 1.5  # 6 tokens after the firsts, over t=1..5
    assert st["admission_skew_ms"] == 1000.0
    assert st["latency_per_token_ms"] == 1000.0
    assert st["tokens"] == [4, 4] and st["ok"] == 2 and st["prompt_tokens"] == [3]


def test_group_stats_counts_errors():
    from clickpaca.measure.bench.serve import SeqRun, group_stats

    bad = SeqRun(0, 0.0, final={"type": "error", "message": "KV cache full"})
    st = group_stats([bad])
    assert st["ok"] == 0 and st["errors"] == ["KV cache full"] and st["wall_tps"] is None


def test_sampler_ticks_compare_the_fields_every_sides_result_has():
    """An earlier commit's SampleResult may lack a field added since (``fallback``): the
    sides are compared on the fields all have, and a difference there still shows."""
    import dataclasses

    from clickpaca.measure.bench.sampler_ticks import _seen, _shared_fields

    @dataclasses.dataclass
    class Old:
        token: int
        logprob: float

    @dataclasses.dataclass
    class New:
        token: int
        logprob: float
        fallback: str | None = None

    old, new = [Old(3, float("nan"))], [New(3, float("nan"), "why")]
    shared = _shared_fields(old + new)
    assert shared == ("token", "logprob") and _seen(old, shared) == _seen(new, shared)
    assert _seen([Old(4, float("nan"))], shared) != _seen(new, shared)
    assert _shared_fields(new) == ("token", "logprob", "fallback")


def test_group_stats_counts_whole_ticks():
    from clickpaca.measure.bench.serve import SeqRun, group_stats

    def run(sid, times):
        return SeqRun(sid, 0.0, tokens=len(times), t_first=times[0], t_last=times[-1], times=times,
                      final={"type": "done", "eval_tps": 1.0, "tokens_prompt": 3,
                             "stop_reason": "max_tokens", "_t": times[-1]})

    # three ticks one second apart; within a tick the events are stamped 10 us apart
    a = run(0, [1.0, 2.0, 3.0])
    b = run(1, [1.00001, 2.00001, 3.00001])
    st = group_stats([a, b])
    assert st["steady_tps"] == pytest.approx(4 / (3.0 - 1.00001))  # ticks 2 and 3, both sequences
    assert st["span_tps"] == pytest.approx(4 / (3.00001 - 1.0))


def test_ppl_noise_plan_of_f16_is_unchanged_and_of_another_type_drops_fa_off():
    from clickpaca.measure.kl import NOISE
    from clickpaca.measure.bench.ppl import plan_variants

    v, refs, at = plan_variants([("f16", "f16"), ("turbo3", "turbo3")], "f32", True)
    assert [x.name for x in v[at[0]:at[0] + 1]] == ["f16"] and at[0] == 0
    assert [v[i] for i in at[1:]] == list(NOISE) and refs == [2, 0]
    v, refs, at = plan_variants([("f16", "f16"), ("turbo3", "turbo3")], "f32", True, ("turbo3", "turbo3"))
    assert at[0] == len(v) - 1 - (len(at) - 1) and v[at[0]].name == "turbo3 default"
    assert at[0] in refs
    changed = [v[i] for i in at[1:]]
    assert all(x.pair == "turbo3/turbo3" for x in changed)
    assert [x.name for x in changed] == [n.name for n in NOISE if n.flash_attn == "on"]
    v, refs, at = plan_variants([("turbo3", "turbo3")], "f16", True, ("turbo3", "turbo3"))
    assert at[0] == 0 and refs == [0]


@pytest.mark.model
def test_ppl_no_server_takes_ppl_from_the_in_process_windows_only(tmp_path):
    from clickpaca.measure.bench.ppl import measure, table

    a = build_parser().parse_args(["ppl", "--cache", "f16,q8_0", "--ctx", "64", "--chunks", "1", "--no-server",
                                   "--out", str(tmp_path)])
    out = measure(a)
    assert out["params"]["server"] is False and not out["server_problems"] and not out["problems"]
    for r in out["rows"]:
        assert "ppl_server" not in r and "error_server" not in r
        assert r["ppl_inproc"] > 1 and r["tokens_inproc"] == 31
    assert "--no-server" in " ".join(out["notes"]) and "q8_0" in table(out)


@pytest.mark.model
@pytest.mark.parametrize("cache,server", [("f16,f32/q8_0,q8_0", False), ("f32/q8_0,f16,q8_0", False),
                                          ("f16,f32/q8_0,q8_0", True)])
def test_ppl_a_refused_type_gets_its_error_and_the_others_are_measured(tmp_path, capsys, cache, server):
    """llama.cpp refuses a context for f32/q8_0 (attention() turns flash attention off for the
    f32 K, and a quantized V needs it), as it refuses turbo types where the head size is no
    multiple of their block: that type's row carries the refusal, an in-process problem names
    it, and the other types are measured as usual, against the first type when it was measured
    (the second case: the reference itself refused, so no KL, but each PPL). With the server's
    pass, its server refuses it too: that one is a SERVER PROBLEM, the in-process one is not."""
    from clickpaca.measure.bench.ppl import measure, table
    from clickpaca.results.report import IN_PROCESS, emit

    a = build_parser().parse_args(["ppl", "--cache", cache, "--ctx", "64", "--chunks", "1", "--out", str(tmp_path)]
                                  + ([] if server else ["--no-server"]))
    out = measure(a)
    rows = {r["cache"]: r for r in out["rows"]}
    bad = rows["f32/q8_0"]
    assert "quantized V cache requires flash_attn" in bad["error_inproc"] and "ppl_inproc" not in bad
    if server:
        assert "ppl_server" not in bad and bad["error_server"]
        assert out["server_problems"] and all(p.startswith("score with f32/q8_0: ") for p in out["server_problems"])
        for name in ("f16", "q8_0"):
            assert rows[name]["ppl_server"] == pytest.approx(rows[name]["ppl_inproc"], rel=0.02)
    else:
        assert out["server_problems"] == []
    [p] = out["problems"]
    assert p["source"] == IN_PROCESS and "f32/q8_0" in p["message"] and "requires flash_attn" in p["message"]
    for name in ("f16", "q8_0"):
        assert rows[name]["ppl_inproc"] > 1 and rows[name]["tokens_inproc"] == 31
    if cache.startswith("f16"):
        assert rows["f16"]["kl_mean"] == 0.0 and rows["q8_0"]["kl_ref"] == "f16"
        assert 0 <= rows["q8_0"]["kl_mean"] < 0.1 and rows["q8_0"]["top1_agreement"] > 0.5
    else:  # the reference was refused: no KL against it, not a KL of 0
        assert rows["f16"]["kl_mean"] is None and rows["q8_0"]["kl_mean"] is None
        assert rows["q8_0"]["kl_ref"] is None
    t = table(out)
    assert "refused" in next(line for line in t.splitlines() if line.startswith("| f32/q8_0"))
    emit(str(tmp_path), "ppl", out, t, "ppl")
    printed = capsys.readouterr().out
    assert "- PROBLEM (in-process run): refused: f32/q8_0" in printed
    assert ("- SERVER PROBLEM: score with f32/q8_0" in printed) == server
    assert ("SERVER PROBLEM" in printed) == server


@pytest.mark.model
def test_compare_variants_raises_a_refusal_unless_told_to_keep_it(model_path):
    """Without keep_refused (the kv-sim study, kl.compare), a refused context stops the
    comparison as before, before anything is decoded."""
    from clickpaca.llama.core import ContextError
    from clickpaca.measure.kl import Variant, compare_variants

    bad = Variant("f32/q8_0", "f32", "q8_0", flash_attn="off")
    with pytest.raises(ContextError, match="quantized V cache requires flash_attn"):
        compare_variants(str(model_path), [Variant("f16"), bad], [0], np.arange(2, 200, dtype=np.int32), 64,
                         threads=2)


def test_problems_are_labelled_by_their_source(tmp_path, capsys):
    """A spawned server's problem is a SERVER PROBLEM; one met in this process (ppl's KL pass,
    with or without --no-server) or by llama-perplexity says so, not SERVER; each once."""
    import json

    from clickpaca.results.report import IN_PROCESS, emit, problem, problem_lines

    data = {"server_problems": ["llama-server exited with 1", "llama-server exited with 1"],
            "problems": [problem(IN_PROCESS, "KL / top-1 failed: boom"), problem(IN_PROCESS, "KL / top-1 failed: boom"),
                         problem("llama-perplexity", "not run")]}
    assert problem_lines(dict(data)) == ["SERVER PROBLEM: llama-server exited with 1",
                                         "PROBLEM (in-process run): KL / top-1 failed: boom",
                                         "PROBLEM (llama-perplexity): not run"]
    assert problem_lines({"server_problems": []}) == []
    emit(str(tmp_path), "ppl", {"params": {}, "rows": [], "server_problems": [],
                                "problems": [problem(IN_PROCESS, "KL / top-1 failed: boom")]}, "| t |", "t")
    printed = capsys.readouterr().out
    assert "- PROBLEM (in-process run): KL / top-1 failed: boom" in printed and "SERVER PROBLEM" not in printed
    exported = json.loads((tmp_path / "ppl.json").read_text())
    assert exported["problems"] == [{"source": IN_PROCESS, "message": "KL / top-1 failed: boom"}]
    assert exported["server_problems"] == []


def test_ppl_table_names_its_second_kl_reference():
    from clickpaca.measure.bench.ppl import table

    rows = [{"cache": "f16", "build": "mainline", "kl_ref": "f16", "kl_mean": 0.0},
            {"cache": "turbo3", "build": "turboquant", "kl_ref": "f16", "kl_mean": 0.5,
             "kl_ref2": "turbo3 default", "kl_mean_ref2": 0.0}]
    head = table({"params": {"ref": "f16"}, "rows": rows, "noise": []}).splitlines()[0]
    assert "KL mean vs turbo3 default" in head and head.count("KL mean vs f16") == 1


@pytest.mark.model
@pytest.mark.slow
def test_bench_batch_against_an_earlier_commit_is_a_side_of_the_same_rounds(tmp_path):
    """--against REV: REV's server (here HEAD's tree, extracted) beside this tree's, each
    sequence its G tokens, the ratio per round; with --deterministic both run in
    deterministic mode and each round's tokens are compared (HEAD's server is this one)."""
    from clickpaca.measure.bench import batch

    out = batch.run(_args(tmp_path, what="batch", seqs="2", tokens=4, prompt_tokens=8, against="HEAD",
                          deterministic=True))
    [row] = out["rows"]
    assert row["old_tokens"] == [[4, 4]] and row["server_tokens"] == [[4, 4]] and row["det_tokens"] == [[4, 4]]
    assert len(row["old_paired_ratios"]) == 1 and row["old_ratio_to_default"] > 0 and row["old_ratio_to_det"] > 0
    assert row["old_same_tokens_as_det"] == [True]
    text = batch.table(out)
    assert out["params"]["against"] == "HEAD" and "against / default" in text and "| yes" in text


@pytest.mark.model
@pytest.mark.slow
def test_bench_batch_against_an_earlier_commit_with_preselect_holds_its_preselect_to_ours(tmp_path):
    """--against REV --preselect: REV's pre-selecting server is one more side, and each
    row gives its tok/s over this tree's pre-selecting server's, per round."""
    from clickpaca.measure.bench import batch

    out = batch.run(_args(tmp_path, what="batch", seqs="2", tokens=4, prompt_tokens=8, against="HEAD",
                          preselect=True))
    [row] = out["rows"]
    assert row["oldpre_tokens"] == [[4, 4]] and row["pre_tokens"] == [[4, 4]] and row["old_tokens"] == [[4, 4]]
    assert len(row["oldpre_paired_ratios_to_pre"]) == 1 and row["oldpre_ratio_to_pre"] > 0
    text = batch.table(out)
    assert "against-preselect / preselect" in text and "against-preselect tok/s" in text


@pytest.mark.model
@pytest.mark.slow
def test_bench_sampler_against_an_earlier_commit_per_tick(tmp_path, monkeypatch):
    """--against REV --seqs: REV's sampling sides beside this tree's on the same logits of
    each tick (the bench checks every side's results equal the first's)."""
    from clickpaca.measure.bench import sampler, sampler_ticks

    monkeypatch.setattr(sampler_ticks, "TICKS", 1)
    out = sampler.run(_args(tmp_path, what="sampler", seqs="2", against="HEAD", threads=2))
    [t] = out["ticks"]
    assert t["sides"][:2] == ["old_per_seq", "old_batched"] and "new_batched" in t["sides"]
    assert json.loads((tmp_path / "sampler-against.json").read_text())["params"]["against"] == "HEAD"
    assert out["params"]["ticks"] == 1 and len(t["samples"]["greedy"]["new_batched_wall_ms"]) == 1
    from clickpaca.measure.bench import sampler_against

    [line] = [x for x in sampler_against.ticks_table(out["ticks"]).splitlines() if "| greedy" in x]
    assert line.count("(") == 2  # new / old per tick for per_seq and batched


def test_bench_sampler_against_summary_gives_each_rounds_ratio():
    """Each side's median per measure, and new / old round by round with its spread;
    a measure only one side took has no ratio."""
    from clickpaca.measure.bench import sampler_against as A

    res = {"default": {"old_synthetic": [10.0, 12.0, 11.0], "new_synthetic": [11.0, 12.0, 9.9],
                       "new_threads_wall": [5.0, 6.0, 7.0]}}
    d = A.summary(res)["default"]
    assert d["old_synthetic"] == 11.0 and d["new_synthetic"] == 11.0 and d["new_threads_wall"] == 6.0
    r = d["synthetic_ratio"]
    assert r["rounds"] == [1.1, 1.0, 0.9] and (r["min"], r["max"]) == (0.9, 1.1) and r["median"] == 1.0
    assert "real_ratio" not in d
    text = A.table(res, {"row_max": 1.0, "row_exp": 2.0})
    [line] = [x for x in text.splitlines() if x.startswith("| default")]
    assert [c.strip() for c in line.split("|")[1:5]] == ["default", "11.00", "11.00", "1.000 (0.900-1.100)"]


@pytest.mark.slow
def test_bench_sampler_against_keeps_every_round_of_both_sides():
    """compare() on the synthetic rows only (no model): REV (here HEAD) and this tree
    each give one sample per round for every chain both know."""
    from clickpaca.measure.bench import sampler_against as A

    res, cal = A.compare("HEAD", None, rounds=2)
    assert {"default", "greedy", "top_p_only"} <= set(res)
    for d in res.values():
        assert len(d["old_synthetic"]) == 2 and len(d["new_synthetic"]) == 2
        assert all(v > 0 for v in d["old_synthetic"] + d["new_synthetic"])
    assert cal["row_max"] > 0 and cal["row_exp"] > 0


def test_group_stats_digests_every_sequences_tokens_in_order():
    from clickpaca.measure.bench.serve import SeqRun, group_stats

    def runs(*ids):
        return [SeqRun(i, 0.0, tokens=len(t), ids=list(t), final={"type": "done"}) for i, t in enumerate(ids)]

    same = group_stats(runs([1, 2], [3, 4]))["tokens_digest"]
    assert same == group_stats(runs([1, 2], [3, 4]))["tokens_digest"]
    assert same != group_stats(runs([1, 2], [3, 5]))["tokens_digest"]
    assert same != group_stats(runs([3, 4], [1, 2]))["tokens_digest"]
