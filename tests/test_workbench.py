"""Workbench through the real server with the real default model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from clickpaca import ServerError, Workbench
from clickpaca.results.compare import compare
from clickpaca.results.store import Store

from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

pytestmark = pytest.mark.model

INIT = {"nCtx": 4096, "build": TEST_BUILD, "cacheTypeK": TEST_CACHE_K, "cacheTypeV": TEST_CACHE_V}


@pytest.fixture(scope="module")
def wb():
    w = Workbench.spawn(nSeqMax=6, **INIT)
    yield w
    w.close()


def segments(events: list[dict]) -> dict[int, list[list[dict]]]:
    """The raw events of every request, per seq_id, in the order they ran."""
    out: dict[int, list[list[dict]]] = {}
    cur: dict[int, list[dict]] = {}
    for ev in events:
        sid = ev.get("seq_id", -1)
        if not isinstance(sid, int) or sid < 0 or ev["type"] not in ("token", "done", "error"):
            continue
        cur.setdefault(sid, []).append(ev)
        if ev["type"] != "token":
            out.setdefault(sid, []).append(cur.pop(sid))
    return out


def test_generations_match_the_raw_events(wb):
    n0 = len(wb.client.all_events)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "My favourite colour is"]
    gens = wb.generate(prompts, maxTokens=6, temperature=0, nProbs=3)
    segs = segments(wb.client.all_events[n0:])
    assert sorted(segs) == list(range(len(prompts)))  # fewer prompts than slots: one seq_id each
    by_text = {}
    for sid, (evs,) in segs.items():
        toks = [e for e in evs if e["type"] == "token"]
        by_text[(evs[-1]["tokens_prompt"], tuple(e["token"] for e in toks))] = (toks, evs[-1])
    for i, g in enumerate(gens):
        assert g.ok and g.index == i and g.request["prompt"] == prompts[i]
        toks, done = by_text[(g.tokens_prompt, tuple(g.tokens))]
        assert g.pieces == [e["piece"] for e in toks] and g.text == "".join(e["piece"] for e in toks)
        assert g.logprobs == [e["logprob"] for e in toks] and g.top == [e["top"] for e in toks]
        assert len(g.top[0]) == 3
        assert g.steered_logprobs == [e["steered_logprob"] for e in toks]
        for k in ("stop_reason", "tokens_predicted", "prompt_ms", "eval_ms", "eval_tps"):
            assert getattr(g, k) == done[k], k
        assert 0 < g.ttft_ms <= g.wall_ms


def test_many_requests_over_few_slots_keep_input_order(wb):
    """40 prompts of 40 different lengths over 6 slots: each result's prompt token count
    tells which prompt it answered."""
    n0 = len(wb.client.all_events)
    prompts = [" ".join(["word"] * (i + 1)) for i in range(40)]
    gens = wb.generate(prompts, maxTokens=2, temperature=0)
    assert [g.ok for g in gens] == [True] * 40
    counts = [g.tokens_prompt for g in gens]
    assert counts == sorted(counts) and len(set(counts)) == 40
    assert {ev["seq_id"] for ev in wb.client.all_events[n0:] if ev["type"] == "done"} == set(range(6))
    assert len(wb.slots) == 6  # every slot back in the pool


def test_one_bad_request_fails_alone(wb):
    items = ["The sun is", {"prompt": "The sea is", "temperature": "hot"}, "The moon is",
             {"prompt": "x", "tmperature": 0}]
    gens = wb.generate(items, maxTokens=3, temperature=0)
    assert [g.ok for g in gens] == [True, False, True, False]
    assert "temperature" in gens[1].error and "tmperature" in gens[3].error
    assert gens[0].tokens_predicted == 3 and gens[2].tokens_predicted == 3
    assert gens[1].record()["error"] == gens[1].error
    unencodable = wb.generate([{"prompt": "a", "seed": object()}, "b"], maxTokens=1)
    assert not unencodable[0].ok and "not encodable" in unencodable[0].error and unencodable[1].ok


def test_per_item_steering_labels_and_grammar(wb):
    items = [{"prompt": "Is the sun a star? Answer:", "label": "yes/no", "grammar": 'root ::= (" yes" | " no")'},
             {"prompt": "A person as JSON:", "label": "schema", "json_schema": {
                 "type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["age"], "additionalProperties": False}},
             {"prompt": "The capital of France is", "label": "plain"}]
    gens = wb.generate(items, maxTokens=12, temperature=0)
    assert [g.ok for g in gens] == [True] * 3, [g.error for g in gens]
    assert gens[0].text in (" yes", " no") and gens[0].stop_reason == "grammar"
    import json
    assert isinstance(json.loads(gens[1].text)["age"], int)
    assert [r["steering"] for r in gens.to_records()] == ["yes/no", "schema", "plain"]
    assert "grammar_id" in gens[0].request and "grammar" not in gens[0].request



def test_messages_items(wb):
    turn = [{"role": "user", "content": "Name a colour."}]
    gens = wb.generate([turn, turn], chatTemplate="gemma", maxTokens=3, temperature=0)
    mixed = wb.generate(["Name a colour:", {"messages": turn, "chatTemplate": "gemma"}], maxTokens=3, temperature=0)
    assert all(g.ok for g in gens + mixed), [g.error for g in gens + mixed]
    assert gens[0].request["messages"] == turn and gens[0].tokens_prompt == 13  # as in docs/PROTOCOL.md
    assert mixed[1].tokens_prompt == 13 and mixed[1].record()["prompt"] == "user: Name a colour."


def test_document_forks_answer_each_question(wb):
    doc_text = ("The lighthouse on the north pier is white with a single red band. The harbour holds "
                "eleven fishing boats and a lifeboat painted bright orange.\n\n")
    qs = [f"Question {i}: What colour is the lifeboat?\nAnswer:" for i in range(8)]
    with wb.prefill(doc_text) as doc:
        assert len(wb.slots) == 5
        answers = doc.generate(qs, temperature=0, maxTokens=4, stop=["\n"])
        assert doc.tokens > 20
    assert len(wb.slots) == 6
    assert [a.ok for a in answers] == [True] * 8, [a.error for a in answers]
    for a in answers:  # only the question was computed: the document's cells came from the fork
        assert a.tokens_prompt < doc.tokens <= a.tokens_reused + 1 and a.ttft_ms is not None
        assert a.tokens_predicted >= 1


def test_score_matches_the_client(wb):
    text = "The quick brown fox jumps over the lazy dog. It was a sunny day."
    (s,) = wb.score([text])
    raw = wb.client.score(0, text, perToken=True)
    assert s.ok and s.token_nll == raw["token_nll"] and s.nll == raw["nll"] and s.tokens == raw["tokens"]
    many = wb.score([text, "Hello world, this is a test.", ""])
    assert many[0].tokens == s.tokens and many[1].ok
    assert not many[2].ok and many[2].error == "text: must not be empty"


def test_agenerate_calls_share_the_slots(wb):
    async def both():
        return await asyncio.gather(wb.agenerate([f"Number {i}:" for i in range(9)], maxTokens=2, temperature=0),
                                    wb.agenerate([f"Colour {i}:" for i in range(9)], maxTokens=2, temperature=0))

    a, b = asyncio.run(both())
    assert [g.request["prompt"] for g in a] == [f"Number {i}:" for i in range(9)]
    assert [g.request["prompt"] for g in b] == [f"Colour {i}:" for i in range(9)]
    assert all(g.ok and g.tokens_predicted == 2 for g in a + b)
    assert len(wb.slots) == 6


def test_a_dead_server_raises():
    w = Workbench.spawn(nSeqMax=2, **INIT)
    try:
        killer = threading.Timer(1.5, w.client.proc.kill)
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(ServerError):
            w.generate(["Once upon a time"] * 6, maxTokens=2000, temperature=0.8,
                       logit_bias=[{"token": t, "bias": -1e9} for t in (1, 106, 212)])
        assert time.perf_counter() - t0 < 30
    finally:
        w.client.close()


def test_sweep_pairs_and_records(results_store):
    prompts = ["The capital of France is", "Once upon a time, a fox", "Water boils at"]
    # cache types: examples/cache_divergence.py (tests/test_examples.py); here a mode
    res = Workbench.sweep({"f16": "f16", "det": {"deterministic": True}}, prompts,
                          init={"nCtx": 2048, "nSeqMax": 4}, temperature=0, maxTokens=12)
    assert res.labels == ["f16", "det"]
    assert res.ready["det"]["deterministic"] is True and res.ready["f16"]["deterministic"] is False
    assert res.ready["det"]["kernels"]["kvLayout"] == "per-sequence"
    assert [(p["config"], p["index"]) for p in res.pairs] == [("det", i) for i in range(3)]
    for p in res.pairs:
        a, b = res.generations["f16"][p["index"]], res.generations[p["config"]][p["index"]]
        div = p["first_divergence"]
        if div is None:
            assert a.tokens == b.tokens
        else:
            assert a.tokens[:div] == b.tokens[:div] and (div == len(a.tokens) or div == len(b.tokens)
                                                          or a.tokens[div] != b.tokens[div])
    # every config scored the same texts (the baseline's), token by token
    for sa, sb in zip(res.scores["f16"], res.scores["det"]):
        assert sa.ok and sb.ok and sa.text == sb.text and sa.tokens == sb.tokens
    with Store() as store:
        run = store.run(res.run_id)
        assert run["command"] == "sweep" and run["status"] == "complete"
        assert run["model_sha"] and run["provenance"]["git"]["commit"] and "mainline" in run["builds"]
        rep = compare(store, [str(res.run_id)])
    (pr,) = rep["pairs"]
    assert (pr["a"], pr["b"], pr["kind"]) == (f"{res.run_id}:f16", f"{res.run_id}:det", "quality")
    ppl = {r["cache"]: r["ppl"] for r in res.summary()}
    assert pr["delta_ppl"] == pytest.approx(ppl["det"] - ppl["f16"], rel=1e-4)


def test_the_readme_snippet_runs():
    """The README's Python snippet, as written there."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (code,) = re.findall(r"or from Python:\n\n```python\n(.*?)```", readme, flags=re.S)
    assert "Workbench" in code
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(r"'.+' (max_tokens|eos) first token after \d+ ms", line)
                                   for line in lines), lines


def test_two_workbenches_on_one_socket_with_a_user_step(tmp_path):
    """Workbench.connect: each client schedules over the slots it may use, on one shared
    server that loaded a user step."""
    from pathlib import Path

    from test_socket import start_server, stop_server

    path = tmp_path / "s.sock"
    steps = Path(__file__).resolve().parent / "steps" / "user_steps.py"
    proc = start_server(path, "--steps", str(steps), "--max-seqs-per-client", "3", nSeqMax=6)
    try:
        benches = [Workbench.connect(path, slots=3) for _ in range(2)]
        out: dict[int, list] = {}

        def run(k: int) -> None:
            out[k] = benches[k].generate([f"Item {k}.{i}:" for i in range(7)], maxTokens=3, temperature=0,
                                         samplers=["boost", "temperature"], boostToken=9079, boostBy=100)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for k in range(2):
            assert [g.request["prompt"] for g in out[k]] == [f"Item {k}.{i}:" for i in range(7)]
            assert all(g.ok and g.tokens == [9079] * 3 and g.steps_ms["boost"] > 0 for g in out[k])
        for b in benches:
            b.close()
    finally:
        stop_server(proc, path)
