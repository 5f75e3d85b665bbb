"""Typed results and sweep pairing: pure functions over event dicts, no model."""

from __future__ import annotations

import math

import pytest

from clickpaca.workbench.progress import Progress
from clickpaca.workbench.results import Generation, Results, Score
from clickpaca.workbench.sweep import config_label, normalise_configs, pair

REQ = {"type": "infer", "prompt": "The capital of France is", "maxTokens": 3, "temperature": 0}


def tok(t, piece, lp=None, top=None, at=None):
    ev = {"type": "token", "seq_id": 3, "token": t, "piece": piece}
    if lp is not None:
        ev.update(logprob=lp, top=top or [], steered_logprob=0.0, steered_top=[])
    if at is not None:
        ev["_t"] = at
    return ev


DONE = {"type": "done", "seq_id": 3, "tokens_prompt": 6, "tokens_reused": 0, "tokens_predicted": 2,
        "prompt_ms": 10.0, "eval_ms": 40.0, "prompt_tps": 600.0, "eval_tps": 50.0, "stop_reason": "max_tokens"}


def test_generation_from_events_copies_every_field():
    events = [tok(506, " the", -0.5, [{"token": 506, "piece": " the", "logprob": -0.5}], at=1.25),
              tok(5279, " capital", -1.0, at=1.5), {**DONE, "_t": 1.75}]
    g = Generation.from_events(7, REQ, events, t_sent=1.0, label="greedy")
    assert (g.index, g.label, g.ok) == (7, "greedy", True)
    assert g.text == " the capital" and g.tokens == [506, 5279] and g.pieces == [" the", " capital"]
    assert g.logprobs == [-0.5, -1.0] and g.top[0] == [{"token": 506, "piece": " the", "logprob": -0.5}]
    assert g.steered_logprobs == [0.0, 0.0]
    for k in ("tokens_prompt", "tokens_reused", "tokens_predicted", "prompt_ms", "eval_ms", "prompt_tps",
              "eval_tps", "stop_reason"):
        assert getattr(g, k) == DONE[k], k
    assert g.ttft_ms == pytest.approx(250.0) and g.wall_ms == pytest.approx(750.0)


def test_generation_without_nprobs_has_no_logprobs():
    g = Generation.from_events(0, REQ, [tok(506, " the"), DONE])
    assert g.logprobs is None and g.top is None and g.ttft_ms is None


def test_generation_error_keeps_the_message_and_no_stats():
    ev = {"type": "error", "seq_id": 3, "request": "infer", "message": "temperature: must be a number"}
    g = Generation.from_events(1, REQ, [ev])
    assert not g.ok and g.error == "temperature: must be a number"
    assert g.stop_reason is None and g.tokens == [] and g.text == ""


def test_generation_of_a_closed_stream_is_an_error():
    g = Generation.from_events(0, REQ, [tok(506, " the"), {"type": "closed"}])
    assert not g.ok and "closed" in g.error and g.tokens == [506]


def test_record_is_flat_and_names_the_steering():
    g = Generation.from_events(0, REQ, [tok(506, " the", -0.5), DONE])
    row = g.record()
    assert row["prompt"] == REQ["prompt"] and row["text"] == " the"
    assert row["steering"] == "maxTokens=3 temperature=0"
    assert row["mean_logprob"] == -0.5 and row["stop_reason"] == "max_tokens"
    assert all(not isinstance(v, (list, dict)) for v in row.values())
    msg = Generation.from_events(0, {"type": "infer", "messages": [{"role": "user", "content": "Hi"}]}, [DONE])
    assert msg.record()["prompt"] == "user: Hi"
    assert Generation.from_events(0, REQ, [DONE], label="mine").record()["steering"] == "mine"


def test_score_from_events():
    ev = {"type": "scored", "seq_id": 0, "tokens": 3, "nll": 2.0, "ppl": math.exp(2.0), "windows": 1,
          "token_nll": [1.0, 2.0, 3.0]}
    s = Score.from_events(4, "abc", [ev])
    assert (s.index, s.tokens, s.nll, s.windows, s.token_nll, s.ok) == (4, 3, 2.0, 1, [1.0, 2.0, 3.0], True)
    assert "token_nll" not in s.record()
    bad = Score.from_events(0, "a", [{"type": "error", "seq_id": 0, "message": "text: too short"}])
    assert bad.error == "text: too short" and bad.nll is None


def test_results_to_records_and_pandas():
    import pandas as pd  # the optional `pandas` extra; `dev` has it, so `make test` does
    rs = Results([Generation.from_events(i, REQ, [tok(506, " the"), DONE]) for i in range(3)])
    recs = rs.to_records()
    assert [r["index"] for r in recs] == [0, 1, 2]
    df = rs.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == 3 and list(df["text"]) == [" the"] * 3
    assert rs.errors == []


def gen(tokens, logprobs=None, top=None):
    g = Generation(index=0, request=REQ, tokens=list(tokens))
    g.logprobs, g.top = logprobs, top
    return g


def test_pair_same_tokens():
    p = pair(gen([1, 2, 3], [-1.0, -2.0, -3.0]), gen([1, 2, 3], [-1.0, -2.5, -3.0]))
    assert p["first_divergence"] is None and p["common_prefix"] == 3 and p["agreement"] == 1.0
    assert p["dlogprob_mean"] == pytest.approx(0.5 / 3) and p["dlogprob_max"] == pytest.approx(0.5)


def test_pair_divergence_and_margin():
    top = [[], [{"token": 2, "logprob": -0.1}, {"token": 9, "logprob": -0.4}], []]
    p = pair(gen([1, 2, 3], [-1.0, -0.1, -2.0], top), gen([1, 9, 3], [-1.0, -0.3, -2.0]))
    assert p["first_divergence"] == 1 and p["common_prefix"] == 1
    assert p["agreement"] == pytest.approx(2 / 3)
    assert p["margin"] == pytest.approx(0.3)
    assert p["dlogprob_mean"] == 0.0


def test_pair_one_stops_early_and_margin_unknown():
    p = pair(gen([1, 2]), gen([1, 2, 3, 4]))
    assert p["first_divergence"] == 2 and p["agreement"] == 0.5 and p["margin"] is None
    q = pair(gen([1, 2], [-1.0, -1.0], [[], [{"token": 2, "logprob": -1.0}]]), gen([1, 5], [-1.0, -3.0]))
    assert q["first_divergence"] == 1 and q["margin"] is None  # 5 is not among the baseline's top


def test_configs_normalised_and_labelled():
    assert normalise_configs(["f16", "q8_0/q4_0"]) == {
        "f16": {"cacheTypeK": "f16", "cacheTypeV": "f16"}, "q8_0/q4_0": {"cacheTypeK": "q8_0", "cacheTypeV": "q4_0"}}
    assert list(normalise_configs([{}, {"deterministic": True}])) == ["default", "deterministic"]
    assert normalise_configs({"a": "q8_0", "b": {"build": "turboquant"}})["b"] == {"build": "turboquant"}
    assert list(normalise_configs({"cacheTypeK": "q8_0"})) == ["q8_0"]
    assert config_label({"cacheTypeK": "q8_0", "cacheTypeV": "turbo3", "build": "turboquant"}) == "q8_0/turbo3 turboquant"
    with pytest.raises(ValueError, match="both"):
        normalise_configs(["f16", {"cacheTypeK": "f16", "cacheTypeV": "f16"}])
    with pytest.raises(TypeError):
        normalise_configs([3])


def test_progress_bar_on_stderr(capsys):
    with Progress(3, "generate", show=True) as bar:
        for r in (Generation(0, REQ), Generation(1, REQ, error="x"), Generation(2, REQ)):
            bar.update(r)
    err = capsys.readouterr().err
    assert "generate:" in err and "/3 [" in err  # drawn on stderr (redraws are throttled)
    assert (bar.bar.n, bar.errors, bar.bar.postfix) == (3, 1, "errors=1")
    with Progress(100, "quiet", show=False) as bar:
        bar.update(Generation(0, REQ))
    assert capsys.readouterr().err == ""
