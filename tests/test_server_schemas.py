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


# ------------------------------------------------ no object repeats a key (grammar/json_keys.py)

FREE_KEYS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}
TWO_KEYS = {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer", "minimum": 0, "maximum": 9}},
            "additionalProperties": False}
NESTED = {"type": "object", "properties": {"inner": FREE_KEYS}, "required": ["inner"],
          "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}
REPEAT = chat('Copy exactly: {"a": 1, "a": 2, "a": 3, "a": 4}')


def keys_of(text: str) -> list[list[str]]:
    """Each object's keys, in order, of a JSON text that may be cut short: the objects'
    `"key": ` at their own level (values here are digits and objects)."""
    out, stack, i = [], [], 0
    while i < len(text):
        c = text[i]
        if c == "{":
            stack.append([])
            out.append(stack[-1])
        elif c == "}":
            stack.pop()
        elif c == '"':
            j = text.index('"', i + 1) if '"' in text[i + 1:] else len(text)
            if text[j + 1:j + 2] == ":" and stack:
                stack[-1].append(json.loads(text[i:j + 1]))
            i = j
        i += 1
    return out


def test_no_object_repeats_a_key_where_any_key_is_allowed(server):
    """The model is asked to repeat `a`; every key it writes is new, and `done` says the
    ban acted."""
    for gid, schema in (("free-keys", FREE_KEYS), ("nested-keys", NESTED)):
        assert server.grammar(gid, text_of(schema))["enforced"] is True
        out, final = run(server, 5, prompt=REPEAT, grammar_id=gid, maxTokens=40, temperature=0)
        assert final["type"] == "done" and final["repeatKeyBans"] >= 1, (out, final)
        objects = keys_of(out)
        assert objects and all(len(set(k)) == len(k) for k in objects), (out, objects)
        assert sum(len(k) for k in objects) >= 3, out
        if final["stop_reason"] == "grammar":
            pairs = []
            json.loads(out, object_pairs_hook=lambda kv: pairs.append([k for k, _ in kv]) or dict(kv))
            assert all(len(set(k)) == len(k) for k in pairs), out


def test_when_only_repeated_keys_are_left_the_request_ends_saying_so(server):
    """Keys a and b only: asked for four a's, the model writes `{"a": 1, "a` and nothing
    the grammar allows is left but closing that key (stop_reason repeated_key, never an
    invalid output). Where the grammar itself allows no repeat, the ban never acts."""
    server.grammar("two-keys", text_of(TWO_KEYS))
    out, final = run(server, 6, prompt=REPEAT, grammar_id="two-keys", maxTokens=40, temperature=0, validate=True)
    assert final["stop_reason"] == "repeated_key" and final["repeatKeyBans"] >= 1, (out, final)
    assert final["schemaValid"] is None and all(len(set(k)) == len(k) for k in keys_of(out)), (out, final)
    server.grammar("person-keys", text_of(PERSON))  # its one key is the grammar's: nothing to ban
    out, final = run(server, 6, prompt=REPEAT, grammar_id="person-keys", maxTokens=16, temperature=0)
    assert final["stop_reason"] == "grammar" and "repeatKeyBans" not in final, (out, final)
