"""JSON schemas through the real server: what `grammar_ready` says is enforced, and the
`done` event's check of each finished output against the whole schema (docs/GRAMMARS.md).

Outputs are made deterministic where a verdict is asserted (greedy, or a digit forced by
logit_bias), and every `schemaValid` is compared with an independent jsonschema call.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.model

FORCE = 1e9
SEVEN = 236832  # Gemma 3's token for the digit 7 (tests/test_server_grammars.py DIGIT)


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def text_of(schema: dict) -> str:
    return "%json_schema " + json.dumps(schema)


def independent(schema: dict, text: str) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(json.loads(text))


def run(server, sid: int, **infer) -> tuple[str, dict]:
    server.infer(sid, **infer)
    toks, final = server.collect(sid)
    return "".join(t["piece"] for t in toks), final


def error_of(server, req: dict) -> dict:
    server.send(req)
    ev = server.next_misc() if req["type"] == "grammar" else server.collect(req["seq_id"])[1]
    assert ev["type"] == "error", ev
    return ev


UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "uniqueItems": True, "minItems": 3, "maxItems": 3}
OVERLAP = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                     {"type": "integer", "minimum": 5, "maximum": 20}]}
URL = {"type": "object", "properties": {"site": {"type": "string", "format": "url", "maxLength": 12}},
       "required": ["site"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["age"], "additionalProperties": False}


def test_a_broken_keyword_is_caught_with_its_path_and_keyword(server):
    ev = server.grammar("unique", text_of(UNIQUE), lenient=True)
    assert ev["enforced"] is False and [(i["path"], i["keyword"]) for i in ev["ignored"]] == [("#", "uniqueItems")]
    out, final = run(server, 0, prompt=chat("Three digits."), grammar_id="unique", maxTokens=20,
                     temperature=0, logit_bias=[{"token": SEVEN, "bias": FORCE}])
    assert out == "[7, 7, 7]" and final["stop_reason"] == "grammar", (out, final)
    assert final["schemaValid"] is False and not independent(UNIQUE, out)
    v = final["schemaViolation"]
    assert (v["path"], v["keyword"], v["schemaPath"]) == ("$", "uniqueItems", "#/uniqueItems"), v
    assert final["schema_ms"] >= 0


def test_one_of_approximated_is_stated_and_checked(server):
    ev = server.grammar("overlap", text_of(OVERLAP))
    assert ev["enforced"] is False and [(i["path"], i["keyword"]) for i in ev["ignored"]] == [("#", "oneOf")]
    out, final = run(server, 1, prompt=chat("A digit."), grammar_id="overlap", maxTokens=4,
                     temperature=0, logit_bias=[{"token": SEVEN, "bias": FORCE}])
    assert out == "7" and final["schemaValid"] is False and not independent(OVERLAP, out), (out, final)
    assert final["schemaViolation"]["keyword"] == "oneOf"
    error = error_of(server, {"type": "grammar", "id": "o2", "grammar": text_of(OVERLAP), "strict": True})
    assert "oneOf constraints are not supported" in error["message"]


def test_unknown_format_is_an_annotation_and_outputs_are_checked(server):
    ev = server.grammar("url", text_of(URL))
    assert ev == {"type": "grammar_ready", "id": "url", "enforced": False, "ignored": [
        {"path": "#/properties/site", "keyword": "format", "reason": "unknown format 'url': an annotation"}]}
    for seed in (0, 1):
        out, final = run(server, 2, prompt=chat("A web site as JSON."), grammar_id="url",
                         maxTokens=24, temperature=0.8, seed=seed)
        if final["stop_reason"] == "grammar":
            assert final["schemaValid"] is independent(URL, out), (out, final)
        else:
            assert final["schemaValid"] is None, final
    error = error_of(server, {"type": "grammar", "id": "u2", "grammar": text_of(URL), "strict": True})
    assert error["message"] == "grammar: invalid JSON schema: Unknown format: url"


def test_enforced_schema_is_checked_only_when_asked_and_a_cut_output_is_null(server):
    assert server.grammar("person", text_of(PERSON)) == {"type": "grammar_ready", "id": "person",
                                                         "enforced": True, "ignored": []}
    out, final = run(server, 3, prompt=chat("An age as JSON."), grammar_id="person", maxTokens=16, temperature=0)
    assert final["stop_reason"] == "grammar" and "schemaValid" not in final, final
    out, final = run(server, 3, prompt=chat("An age as JSON."), grammar_id="person", maxTokens=16,
                     temperature=0, validate=True)
    assert final["schemaValid"] is True and independent(PERSON, out), (out, final)
    server.grammar("person-v", text_of(PERSON), validate=True)
    out, final = run(server, 3, prompt=chat("An age as JSON."), grammar_id="person-v", maxTokens=16, temperature=0)
    assert final["schemaValid"] is True, final
    out, final = run(server, 3, prompt=chat("An age as JSON."), grammar_id="person-v", maxTokens=2, temperature=0)
    assert final["stop_reason"] == "max_tokens" and final["schemaValid"] is None, final
    assert "schemaViolation" not in final


def test_bad_uses_are_named(server):
    server.grammar("gbnf", 'root ::= "a"')
    e = error_of(server, {"type": "infer", "seq_id": 4, "prompt": "x", "grammar_id": "gbnf", "validate": True})
    assert e["message"] == 'validate: grammar "gbnf" is not a JSON schema', e
    e = error_of(server, {"type": "infer", "seq_id": 4, "prompt": "x", "validate": True})
    assert e["message"].startswith("validate: checks the output against a JSON schema grammar"), e
    e = error_of(server, {"type": "grammar", "id": "x", "grammar": text_of(UNIQUE), "strict": True, "lenient": True})
    assert e["message"].startswith("strict: refuses what lenient ignores"), e
    # the default refuses what the standard does not let it ignore, with llguidance's message
    e = error_of(server, {"type": "grammar", "id": "x", "grammar": text_of(UNIQUE)})
    assert e["message"] == 'grammar: invalid JSON schema: Unimplemented keys: ["uniqueItems"]', e
    out, final = run(server, 4, prompt="x", maxTokens=1, temperature=0)  # the server goes on
    assert final["type"] == "done"
