"""clickpaca.grammar.json_schema: the schema rewrite that bounds numbers
(pure functions; the bounded language on the real vocabulary is tested in test_grammars.py)."""

from __future__ import annotations

import copy

from clickpaca.grammar.json_schema import FRACTION_STEP, NUMBER_DIGITS, bound_numbers

LIMIT = 10 ** NUMBER_DIGITS - 1


def test_typed_numbers_get_both_bounds_and_numbers_a_step():
    assert bound_numbers({"type": "integer"}) == {"type": "integer", "minimum": -LIMIT,
                                                 "maximum": LIMIT}
    assert bound_numbers({"type": "number"}) == {"type": "number", "minimum": -LIMIT,
                                                "maximum": LIMIT, "multipleOf": FRACTION_STEP}
    assert bound_numbers({"type": ["number", "null"]})["maximum"] == LIMIT
    assert bound_numbers({"type": "integer"}, digits=3) == {"type": "integer", "minimum": -999,
                                                           "maximum": 999}


def test_the_schemas_own_bounds_and_step_are_kept():
    s = {"type": "number", "minimum": 0, "exclusiveMaximum": 5, "multipleOf": 0.25}
    assert bound_numbers(s) == s
    assert bound_numbers({"type": "integer", "exclusiveMinimum": 3}) == {
        "type": "integer", "exclusiveMinimum": 3, "maximum": LIMIT}


def test_a_bound_beyond_the_limit_leaves_that_side_open():
    """Never unsatisfiable: minimum 1e20 gets no maximum of 1e16 - 1."""
    assert bound_numbers({"type": "integer", "minimum": 10 ** 20}) == {
        "type": "integer", "minimum": 10 ** 20}
    assert bound_numbers({"type": "integer", "maximum": -10 ** 20}) == {
        "type": "integer", "maximum": -10 ** 20}


def test_draft4_boolean_exclusive_is_not_a_bound():
    out = bound_numbers({"type": "integer", "exclusiveMinimum": True})
    assert out["minimum"] == -LIMIT and out["maximum"] == LIMIT


def test_every_subschema_position_is_reached_and_the_input_is_untouched():
    n = {"type": "integer"}
    schema = {"type": "object",
              "properties": {"a": n, "b": {"type": "array", "items": n, "prefixItems": [n]}},
              "additionalProperties": n, "anyOf": [n], "allOf": [{"not": n}],
              "$defs": {"d": n}, "definitions": {"e": {"if": n, "then": n, "else": n}},
              "patternProperties": {"^x": n}, "dependentSchemas": {"a": n}}
    before = copy.deepcopy(schema)
    out = bound_numbers(schema)
    assert schema == before

    found = []

    def walk(v):
        if isinstance(v, dict):
            if v.get("type") == "integer":
                found.append(v)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(out)
    assert len(found) == 12 and all(f["maximum"] == LIMIT for f in found)


def test_untyped_and_other_types_are_not_changed():
    for s in ({}, {"minimum": 3}, {"type": "string"}, {"enum": [1, 2]}, {"const": 12345678901234567890}):
        assert bound_numbers(s) == s
