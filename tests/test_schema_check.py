"""clickpaca.grammar.schema_check: an output against its whole schema (jsonschema, draft
from $schema), the first violation as the `done` event reports it."""

from __future__ import annotations

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.grammar.schema_check import SchemaCheck

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                                  "uniqueItems": True}},
        "required": ["tags"]}


def test_valid_invalid_and_the_first_violation():
    c = SchemaCheck(TAGS).prepare()
    assert c.check('{"tags": [1, 2]}') == {"schemaValid": True}
    out = c.check('{"tags": [1, 1]}')
    assert out["schemaValid"] is False
    v = out["schemaViolation"]
    assert (v["path"], v["keyword"], v["schemaPath"]) == ("$.tags", "uniqueItems",
                                                          "#/properties/tags/uniqueItems")
    v = c.check('{"tags": [1, "x"]}')["schemaViolation"]
    assert (v["path"], v["keyword"]) == ("$.tags[1]", "type")
    v = c.check('{"a b": 1}')["schemaViolation"]
    assert (v["path"], v["keyword"]) == ("$", "required")
    assert c.check("{not json")["schemaViolation"]["keyword"] == "json"


def test_draft_from_schema_and_formats_it_knows():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
              "maximum": 3, "exclusiveMaximum": True}
    assert SchemaCheck(draft4).check("3")["schemaValid"] is False  # draft 4's boolean form
    assert SchemaCheck({"type": "number", "exclusiveMaximum": 3}).check("2")["schemaValid"] is True
    assert SchemaCheck({"type": "string", "format": "ipv4"}).check('"1.2.3.999"')["schemaValid"] is False
    assert SchemaCheck({"type": "string", "format": "url"}).check('"no url"')["schemaValid"] is True


def test_a_validator_failure_is_reported_not_raised():
    out = SchemaCheck({"$ref": "https://example.invalid/x.json"}).prepare().check("1")
    assert out["schemaValid"] is None and out["schemaError"]


@settings(max_examples=50)
@given(st.lists(st.integers(-3, 3), max_size=5))
def test_agrees_with_jsonschema(items):
    import json

    text = json.dumps({"tags": items})
    assert SchemaCheck(TAGS).check(text)["schemaValid"] is jsonschema.Draft202012Validator(TAGS).is_valid(
        {"tags": items})
