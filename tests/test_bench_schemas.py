"""`clickpaca bench schemas`: the command line, the request llama-server is sent, and a
short real run on three schemas of check-jsonschema against a real llama-server (built by
`make peer`) and the real clickpaca server. No timing assertions: both sides answered
every request, every finished output was checked by the same validator, clickpaca's own
`schemaValid` agreed with it, and none of clickpaca's outputs repeats a key."""

from __future__ import annotations

import json

import pytest

from clickpaca.cli import build_parser
from clickpaca.measure.bench import schemas as bench
from clickpaca.measure.bench.llama_server import REQUEST_FIELDS


def _args(tmp_path, *extra):
    return build_parser().parse_args(["bench", "schemas", "check-jsonschema", "--limit", "3", "--seqs", "3",
                                      "--tokens", "12", "--repeats", "1", "--threads", "2",
                                      "--out", str(tmp_path), *extra])


def test_cli_parses_a_corpus_and_its_subset(tmp_path):
    a = _args(tmp_path, "--max-bytes", "20000")
    assert (a.what, a.corpus, a.limit, a.max_bytes, a.seqs) == ("schemas", "check-jsonschema", 3, 20000, "3")
    assert build_parser().parse_args(["bench", "batch"]).corpus is None
    assert not a.no_peer and _args(tmp_path, "--no-peer").no_peer


def test_llama_body_fields_are_the_checked_ones():
    body = bench.llama_body({"type": "integer"}, "p", 1000, 8)
    assert set(body) <= REQUEST_FIELDS and body["json_schema"] == {"type": "integer"}


def test_a_corpus_is_required():
    a = build_parser().parse_args(["bench", "schemas"])
    with pytest.raises(ValueError, match="needs a corpus"):
        bench.run(a)


@pytest.mark.model
@pytest.mark.slow
def test_bench_schemas_short_real_run(tmp_path):
    bench.run(_args(tmp_path))
    data = json.loads((tmp_path / "schemas.json").read_text())
    c = data["compile"]
    assert c["schemas"] == 3 and len(data["schemas"]) == 3
    assert c["default"] <= c["lenient"] <= 3 and c["enforced"] <= c["default"]
    for s in data["schemas"]:
        assert s["registered"] in ("default", "lenient", None)
        assert s["default"]["ok"] or s["default"]["error"]
        assert isinstance(s["llama_server_accepts"], bool)
    assert c["mask_us"]["n"] >= 1 and c["mask_us"]["median"] > 0
    assert c["ban_us"]["n"] == c["mask_us"]["n"] and c["ban_us"]["median"] > 0
    (row,) = data["rows"]
    assert row["seqs"] == 3 and set(row["sides"]) == {bench.CP, bench.CP_JUMP, bench.LS}
    for name, s in row["sides"].items():
        assert s["outputs"] == 3 and s["errors"] == 0, (name, s)
        assert s["finished"] + s["cut"] + s["repeated_key_stops"] == 3, (name, s)
        assert s["valid"] + s["invalid"] == s["finished"], (name, s)
        assert s["tps"]["median"] > 0
    for name in (bench.CP, bench.CP_JUMP):
        assert row["sides"][name]["disagreements"] == 0
        assert row["sides"][name]["repeating"] == 0  # no output repeats a key
        # a round takes at least as many decode ticks as its longest request needs
        t, longest = row["sides"][name]["ticks"], row["sides"][name]["longest_request_ticks"]
        assert 0 < longest["max"] <= t["min"], (name, t, longest)
    assert "ticks" not in row["sides"][bench.LS]
    # schemas force keys, quotes and braces: jump-forward fed some of them as chunks
    assert row["sides"][bench.CP]["forced_share"] == 0 and row["sides"][bench.CP_JUMP]["forced_share"] > 0
    assert data["results_run"]
