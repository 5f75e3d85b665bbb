"""`clickpaca bench peer`: a short real run against a real llama-server (built by `make
peer`), the real clickpaca server and the default model. One round, small loads, no
timing assertions: it checks that both sides answered every request, that the outputs
were validated and the bans enforced, and that the JSON holds what the docs show."""

from __future__ import annotations

import json

import pytest

from clickpaca.measure.bench import peer
from clickpaca.measure.bench.llama_server import REQUEST_FIELDS, LlamaServer, free_port, server_command
from clickpaca.measure.bench.peer_check import validity
from clickpaca.measure.bench.peer_loads import SCHEMAS, loads
from clickpaca.measure.bench.peer_sides import Req, llama_body
from clickpaca.cli import build_parser


def test_schemas_are_valid_and_varied():
    import jsonschema

    kinds = set()
    for _prompt, schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
        text = json.dumps(schema)
        kinds |= {k for k in ("enum", "minimum", "maxItems", "maxLength", '"properties": {"')
                  if k in text}
    assert kinds == {"enum", "minimum", "maxItems", "maxLength", '"properties": {"'}
    assert len(SCHEMAS) == 8


def test_validity():
    schema = SCHEMAS["review"][1]
    assert validity('{"rating": 5, "title": "Good", "pros": ["fast"], "recommend": true}', schema) == "valid"
    assert validity('{"rating": 9, "title": "Good", "pros": [], "recommend": true}', schema) == "invalid"
    assert validity('{"rating": 5, "title": "Go', schema) == "unparsed"


def test_llama_body_fields_are_the_checked_ones():
    for load in loads():
        body = llama_body(load, Req("x", "order" if load.schemas else None,
                                    17 if load.ban else None, 1000))
        assert set(body) <= REQUEST_FIELDS
        assert body["ignore_eos"] is load.greedy
        assert body["cache_prompt"] is False and body["return_tokens"] is True
        assert ("logit_bias" in body) is load.ban


def _args(tmp_path, **kw):
    argv = ["bench", "peer", "--repeats", "1", "--loads", "greedy1,schema8_ban,mixed",
            "--tokens-greedy1", "8", "--tokens-schema", "96", "--mixed", "2",
            "--out", str(tmp_path), "--plot"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return build_parser().parse_args(argv)


@pytest.mark.model
@pytest.mark.slow
def test_llama_server_starts_and_stops(model_path):
    port = free_port()
    cmd = server_command(str(model_path), "mainline", 2, 2, 1024, 512, True, port)
    with LlamaServer(cmd, port) as ls:
        ids = ls.tokenize('{"')
        assert len(ids) == 1 and ls.detokenize(ids) == '{"'
        proc = ls.proc
    assert proc.poll() is not None  # stopped by the bench, not left running


@pytest.mark.model
@pytest.mark.slow
def test_bench_peer_short_real_run(tmp_path):
    out = peer.run(_args(tmp_path))
    data = json.loads((tmp_path / "peer.json").read_text())
    assert [r["load"] for r in data["rows"]] == ["greedy1", "schema8_ban", "mixed"]
    for r in data["rows"]:
        sides = r["sides"]
        assert set(sides) >= {peer.LS_SPLIT, peer.LS_UNIFIED, peer.CP}
        assert (peer.CP_PER_REQ in sides) is r["schemas"] and (peer.CP_JUMP in sides) is r["schemas"]
        for name, s in sides.items():
            c = s["checks"]
            assert c["outputs"] == r["requests"], (r["load"], name)
            assert c["errors"] == 0, (r["load"], name, c["examples_bad"])
            assert c["banned_seen"] == 0, (r["load"], name)
            assert c["count_mismatches"] == 0, (r["load"], name, c["examples_bad"])
            assert s["tps"]["median"] > 0
        # the same prompt tokens on both sides (BOS + the same text)
        assert sides[peer.CP]["prompt_tokens"] == sides[peer.LS_UNIFIED]["prompt_tokens"]
        if not r["schemas"]:
            for name, s in sides.items():  # greedy loads run to the limit on both sides
                assert s["tokens_per_request"]["min"] == r["max_tokens"], name
            continue
        for name, s in sides.items():
            assert s["checks"]["valid"] >= 1, (r["load"], name)
        # the grammar forces tokens (keys, quotes, braces): jump-forward fed some as chunks
        assert sides[peer.CP]["forced_share"] == 0 and 0 < sides[peer.CP_JUMP]["forced_share"] < 1
        assert r["ratio_jump_vs_off"] > 0 and r["ratio_jump_vs_unified"] > 0
        for name in (peer.CP, peer.CP_JUMP):  # a round lasts at least its longest request's ticks
            s = sides[name]
            assert 0 < s["longest_request_ticks"]["max"] <= s["ticks"]["min"], (name, s["ticks"])
        for name in (peer.CP, peer.CP_PER_REQ, peer.CP_JUMP):
            c = sides[name]["checks"]
            # clickpaca: every output that ended is valid; only outputs cut at the limit may not parse
            assert c["invalid"] == 0, (r["load"], name, c["examples_bad"])
            assert c["unparsed"] <= c["cut_at_limit"], (r["load"], name, c["examples_bad"])
            assert c["pretty_printed"] == 0
        if r["banned"]:
            assert len(r["banned_ids"]) == 8
        assert r["registration_ms"]["median"] > 0
    assert data["server_problems"] == []  # every server stopped cleanly
    assert set(data["llama_server_commands"]) == {peer.LS_SPLIT, peer.LS_UNIFIED}
    cmd = data["llama_server_commands"][peer.LS_UNIFIED]["mixed"]
    assert "--kv-unified" in cmd and "-np 2" in cmd and "-c 1024" in cmd
    assert "--no-kv-unified" in data["llama_server_commands"][peer.LS_SPLIT]["mixed"]
    assert "| load" in data["table_markdown"] and out["not_expressible"]
    jump = peer.jump_table(out).splitlines()
    assert len(jump) == 2 + 2 and "jump-forward / off" in jump[0]  # schema8_ban and mixed
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_a_failed_load_is_a_row_of_its_own_and_fails_the_run():
    """A load whose servers failed keeps its place in the tables, the loads measured beside
    it keep theirs, and the run is recorded as failed (measure/checks.py failures)."""
    from clickpaca.measure.bench.peer import headline_table, registration_lines, table
    from clickpaca.measure.checks import failures

    out = {"rows": [{"load": "greedy1", "title": "1 request", "error": "PeerError: llama-server exited",
                     "problems": []}], "server_problems": []}
    [row] = [line.split("|")[1:-1] for line in table(out).splitlines()[2:]]
    assert [c.strip() for c in row[:2]] == ["1 request", "failed: PeerError: llama-server exited"]
    [row] = [line.split("|")[1:-1] for line in headline_table(out).splitlines()[2:]]
    assert [c.strip() for c in row] == ["1 request", "failed", "failed", "-"]
    assert registration_lines(out) == []
    assert failures(out) == ["greedy1: PeerError: llama-server exited"]
