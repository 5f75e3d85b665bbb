"""clickpaca.results.samples and compare on runs written to a real store with synthetic
outputs (no model): naming of samples, pairing rules, refusals with reasons."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

from clickpaca.cli import main
from clickpaca.results import record
from clickpaca.results.compare import CompareError, compare
from clickpaca.results.samples import speed_rounds, split_samples
from clickpaca.results.store import Store


def test_speed_rounds_are_named_by_their_place_and_row():
    out = {"params": {"x": {"median": 1, "samples": [1.0]}},
           "llama_bench_tg": {"median": 50.0, "min": 49.0, "max": 51.0, "samples": [49.0, 51.0]},
           "server": {"greedy": {"eval_tps": {"median": 48.0, "samples": [47.0, 49.0]}, "tokens": [8, 8]}},
           "rows": [{"seqs": 8, "server_wall_tps": {"median": 2.0, "samples": [2.0, None, 2.5]}},
                    {"seqs": 64, "grammar": "lark", "tps": {"median": 3.0, "samples": [3.0]}}]}
    assert speed_rounds(out) == {"llama_bench_tg": [49.0, 51.0], "server/greedy/eval_tps": [47.0, 49.0],
                                 "rows/seqs=8/server_wall_tps": [2.0, 2.5],
                                 "rows/seqs=64,grammar=lark/tps": [3.0]}


def test_split_samples_keeps_per_token_series_out_of_the_result():
    data = {"params": {}, "rows": [{"cache": "f16"}], "samples": {"f16": {"token_nll": [1, 2], "token_kl": None}}}
    samples, result = split_samples(data)
    assert samples == {"f16": {"token_nll": [1.0, 2.0]}}
    assert "samples" not in result and result["rows"] == [{"cache": "f16"}]


def _ppl_data(types, nll, text="t1", ctx=128, chunks=2):
    """A ppl output as measure() shapes it: nll[type] per-token NLL; KL/top-1 vs the first."""
    ref = types[0]
    samples = {}
    for t in types:
        samples[t] = {"token_nll": list(nll[t])}
        if t != ref:
            d = np.abs(np.asarray(nll[t]) - np.asarray(nll[ref]))
            samples[t].update(token_kl=list(d / 10), token_top1=list((d < 0.1).astype(float)))
    return {"params": {"cache": types, "ctx": ctx, "chunks": chunks, "text_sha256": text,
                       "tokens_sha256": text + str(ctx)},
            "rows": [{"cache": t, "build": "mainline", "ppl_server": float(np.exp(np.mean(nll[t])))} for t in types],
            "samples": samples}


def _store_run(data, command="ppl"):
    with record.recording(command, argparse.Namespace(cache=",".join(data["params"].get("cache", [])))) as st:
        record.attach(command.split()[-1], data)
    return st["id"]


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = tmp_path / "r.sqlite3"
    monkeypatch.setenv("CLICKPACA_RESULTS", str(path))
    return path


def _nll(seed, n=256, shift=0.0):
    rng = np.random.default_rng(seed)
    return rng.gamma(2.0, 1.5, size=n) + shift


def test_one_ppl_run_compares_every_type_with_its_first(db):
    base = _nll(1)
    rid = _store_run(_ppl_data(["f16", "q8_0", "q4_0"], {"f16": base, "q8_0": base + 0.001,
                                                         "q4_0": base + 0.3}))
    with Store(db) as s:
        rep = compare(s, [str(rid)])
    assert [(p["a"], p["b"]) for p in rep["pairs"]] == [(f"{rid}:f16", f"{rid}:q8_0"), (f"{rid}:f16", f"{rid}:q4_0")]
    q8, q4 = rep["pairs"]
    assert q8["delta_nll"] == pytest.approx(0.001) and q4["delta_nll"] == pytest.approx(0.3)
    assert q4["verdict"] == "higher" and q4["delta_ppl_ci"][0] > 0
    assert q4["kl"]["mean"] == pytest.approx(0.03) and q4["top1"]["mean"] == 0.0
    assert q8["top1"]["mean"] == 1.0


def test_same_named_types_of_two_runs_pair_with_kl_differences(db):
    base = _nll(2)
    a = _store_run(_ppl_data(["f16", "q4_0"], {"f16": base, "q4_0": base + 0.2}))
    b = _store_run(_ppl_data(["f16", "q4_0"], {"f16": base, "q4_0": base + 0.2}))
    with Store(db) as s:
        rep = compare(s, [str(a), str(b)])
    assert [(p["a"], p["b"]) for p in rep["pairs"]] == [(f"{a}:f16", f"{b}:f16"), (f"{a}:q4_0", f"{b}:q4_0")]
    for p in rep["pairs"]:
        assert p["delta_ppl"] == 0 and p["verdict"] == "identical"
    assert rep["pairs"][1]["kl_diff"]["diff"] == 0 and rep["pairs"][1]["top1_diff"]["ci"] == [0.0, 0.0]
    assert rep["pairs"][1]["kl_diff"]["verdict"] == "identical"
    # a type that changed in the second run: its KL against the same reference moved
    c = _store_run(_ppl_data(["f16", "q4_0"], {"f16": base, "q4_0": base + 0.5}))
    with Store(db) as s:
        [_, q4] = compare(s, [str(a), str(c)])["pairs"]
    assert q4["kl_diff"]["diff"] == pytest.approx(0.03) and q4["kl_diff"]["verdict"] == "higher"
    assert q4["top1_diff"]["diff"] == 0.0  # both already disagree everywhere (|d| >= 0.1)


def test_different_text_or_window_is_refused_unless_forced(db, capsys):
    base = _nll(3)
    a = _store_run(_ppl_data(["f16"], {"f16": base}))
    b = _store_run(_ppl_data(["f16"], {"f16": base + 0.1}, text="t2"))
    c = _store_run(_ppl_data(["f16"], {"f16": _nll(3, n=128)}, ctx=64))
    with Store(db) as s:
        with pytest.raises(CompareError, match="the text differs"):
            compare(s, [str(a), str(b)])
        rep = compare(s, [str(a), str(b)], force=True)
        assert rep["pairs"][0]["delta_nll"] == pytest.approx(0.1)
        assert any(n.startswith("FORCED: the text differs") for n in rep["notes"])
        with pytest.raises(CompareError, match=r"the window \(--ctx\) differs"):
            compare(s, [str(a), str(c)])
        with pytest.raises(CompareError, match="cannot be paired"):  # even forced: 256 vs 128 tokens
            compare(s, [str(a), str(c)], force=True)
    assert main(["results", "compare", str(a), str(b)]) == 2
    assert "the text differs" in capsys.readouterr().err


def test_explicit_series_and_the_command_line_table(db, capsys):
    base = _nll(4)
    a = _store_run(_ppl_data(["f16"], {"f16": base}))
    b = _store_run(_ppl_data(["q8_0"], {"q8_0": base + 0.05}))
    with Store(db) as s:
        with pytest.raises(CompareError, match="no series in common"):
            compare(s, [str(a), str(b)])
    assert main(["results", "compare", f"{a}:f16", f"{b}:q8_0"]) == 0
    out = capsys.readouterr().out
    assert "ΔPPL (B-A) [95% CI]" in out and f"{a}:f16" in out and "higher" in out


def test_speed_runs_compare_by_ratio_of_medians(db):
    def decode(tps):
        return {"params": {"tokens": 8}, "llama_bench_tg": {"median": float(np.median(tps)), "samples": tps}}

    a = _store_run(decode([50.0, 51.0, 49.0]), "bench decode")
    b = _store_run(decode([40.0, 41.0, 39.0]), "bench decode")
    one = _store_run(decode([40.0]), "bench decode")
    with Store(db) as s:
        [p] = compare(s, [str(a), str(b)])["pairs"]
        assert p["kind"] == "speed" and p["ratio"] == pytest.approx(0.8) and p["ci"][1] < 1
        assert p["verdict"] == "lower"
        [p] = compare(s, [str(a), str(one)])["pairs"]
        assert p["ci"] is None and p["verdict"] == "no interval (one round)"
        with pytest.raises(CompareError, match="give two ids"):
            compare(s, [str(a)])
        with pytest.raises(CompareError, match="`bench decode`"):
            compare(s, [str(a), str(_store_run(_ppl_data(["f16"], {"f16": _nll(5)})))])


def test_noise_floor_is_used_when_recorded(db):
    base = _nll(6)
    rid = _store_run(_ppl_data(["f16", "q8_0"], {"f16": base, "q8_0": base + 0.01}))
    with Store(db) as s:
        [p] = compare(s, [str(rid)])["pairs"]
        assert p["verdict"] == "higher" and p["noise_floor_rel"] is None
        s.set_noise_floor(s.run(rid)["model_sha"], "mainline", "ppl_rel", 0.02, source="test")
        [p] = compare(s, [str(rid)])["pairs"]
        assert p["noise_floor_rel"] == 0.02 and p["verdict"] == "within noise (below the noise floor)"


def test_list_show_export_plot(db, tmp_path, capsys):
    import json

    base = _nll(7)
    rid = _store_run(_ppl_data(["f16", "q4_0"], {"f16": base, "q4_0": base + 0.2}))
    assert main(["results", "list", "--command", "ppl"]) == 0
    listed = capsys.readouterr().out
    assert re.search(rf"^\|\s+{rid} \|.*\| ppl\s+\| complete", listed, re.M) and "1 run(s)" in listed
    assert main(["results", "list", "--command", "bench"]) == 0
    assert "0 run(s)" in capsys.readouterr().out
    assert main(["results", "show", str(rid)]) == 0
    assert "token_nll x256" in capsys.readouterr().out
    out = tmp_path / "e.json"
    assert main(["results", "export", str(rid), "--out", str(out)]) == 0
    exp = json.loads(out.read_text())
    assert exp["samples"]["q4_0"]["token_nll"] == pytest.approx(list(base + 0.2))
    png = tmp_path / "p.png"
    assert main(["results", "plot", str(rid), "--measure", "ppl", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from clickpaca.results.cli import plot_series

    speed = _store_run({"params": {}, "rows": [{"seqs": n, "tps": {"median": 2.0 * n, "samples": [n, 2.0 * n, 3.0 * n]}}
                                               for n in (1, 8)]}, "bench batch")
    with Store(db) as s:
        [(xs, ys, cis)] = plot_series(s, [speed], "tps").values()
        assert xs == ["rows/seqs=1/tps", "rows/seqs=8/tps"] and ys == [2.0, 16.0] and cis == [[1.0, 3.0], [8.0, 24.0]]
        [(xs, ys, cis)] = plot_series(s, [rid], "kl").values()
        assert xs == ["q4_0"] and cis[0][0] <= ys[0] <= cis[0][1]
    assert main(["results", "plot", str(speed), "--measure", "tps", "--out", str(png)]) == 0
    assert main(["results", "plot", str(speed), "--measure", "nothing", "--out", str(png)]) == 2


def test_compare_without_targets_takes_the_newest_run(db, capsys):
    base = _nll(8)
    assert main(["results", "compare"]) == 2
    assert "no complete run" in capsys.readouterr().err
    rid = _store_run(_ppl_data(["f16", "q8_0"], {"f16": base, "q8_0": base + 0.02}))
    assert main(["results", "compare"]) == 0
    out = capsys.readouterr().out
    assert f"comparing {rid} " in out and f"| {rid}:f16 | {rid}:q8_0 |" in out

    def decode(tps):
        return {"params": {"tokens": 8}, "llama_bench_tg": {"median": float(np.median(tps)), "samples": tps}}

    a = _store_run(decode([50.0, 51.0]), "bench decode")
    assert main(["results", "compare"]) == 2
    assert "only one of its command" in capsys.readouterr().err
    b = _store_run(decode([52.0, 53.0]), "bench decode")
    assert main(["results", "compare"]) == 0
    out = capsys.readouterr().out
    assert f"comparing {a} {b}" in out and f"| {a}:llama_bench_tg | {b}:llama_bench_tg |" in out


def test_a_retrieval_run_is_drawn_again_from_the_store(db, tmp_path, capsys):
    from clickpaca.measure.retrieval.command import plan, summarize

    setups = plan([("f16", "f16"), ("q4_0", "q4_0")], "f16", False)
    recs = [{"setup": name, "length": L, "needle": i, "exact": lp > -4.5, "answer_logp": lp, "kl_f16": 0.05}
            for L in (1024, 2048) for name, shift in (("f16", 0.0), ("f16, needles removed", -19.0), ("q4_0", -1.0))
            for i, lp in enumerate(np.array([-4.0, -5.0, -3.5]) + shift)]
    rows, noise = summarize(recs, setups, [1024, 2048])
    rid = _store_run({"params": {"cache": ["f16", "q4_0"], "lengths": [1024, 2048]}, "rows": rows, "noise": noise},
                     "kv-retrieval")
    png = tmp_path / "logp.png"
    for measure in ("answer_logp", "accuracy", "dlogp"):
        png.unlink(missing_ok=True)
        assert main(["results", "plot", str(rid), "--measure", measure, "--out", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert main(["results", "plot", str(rid), "--out", str(png)]) == 0  # answer_logp by default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["results", "plot", str(rid), "--measure", "ppl", "--out", str(png)]) == 2  # a ppl run's measure
    assert "not 'ppl'" in capsys.readouterr().err
    assert main(["results", "plot", str(rid), "--measure", "kl", "--out", str(png)]) == 2
    assert "--measure: a retrieval run plots accuracy, answer_logp, dlogp, not 'kl'" in capsys.readouterr().err
    assert main(["results", "plot", str(rid), str(rid), "--measure", "accuracy", "--out", str(png)]) == 2
    assert "is plotted alone" in capsys.readouterr().err


def test_a_run_measured_against_f32_names_that_reference_for_its_kl(db):
    base = _nll(9)
    data = _ppl_data(["f16", "q4_0"], {"f16": base, "q4_0": base + 0.2})
    data["params"]["ref"] = "f32"  # token_kl / token_top1 are then against the f32 reference row
    data["rows"].append({"cache": "f32 ref", "cache_k": "f32", "cache_v": "f32", "build": "mainline"})
    rid = _store_run(data)
    with Store(db) as s:
        [q4] = compare(s, [str(rid)])["pairs"]
    assert q4["a"] == f"{rid}:f16" and q4["kl"]["mean"] == pytest.approx(0.02)
    assert "against the run's reference (f32 ref), not against A" in q4["kl_note"]
