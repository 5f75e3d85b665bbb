"""clickpaca.grammar.schema_rewrite: each rewrite accepts exactly what the original does.

Pure: jsonschema is the reference (hypothesis over schemas and instances); llguidance
compiles the rewritten schemas with a byte-level tokenizer (no model), and its outputs are
checked against the original schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from clickpaca.grammar.grammars import JSON_DEFAULTS, JSON_OVERRIDES, schema_for_llguidance
from clickpaca.grammar.schema_coverage import DRAFTS
from clickpaca.grammar.schema_rewrite import complement, rewrite

DRAFT_URI = {v: k for k, v in DRAFTS.items()}
KEYS = ("a", "b", "c")
#: scalars that exercise the complements: regex metacharacters, lengths 0-3, 1 vs 1.0 vs true
SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from([0, 1, -1, 1.0, 2.5, 5, 1e3]),
                    st.text(alphabet='ab]^-\\.[$\n\t\x01é"', max_size=3))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=2), st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)),
    max_leaves=6)
INSTANCES = st.one_of(VALUES, st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3))
REQUIRED = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)
TYPES = st.lists(st.sampled_from(["null", "boolean", "number", "integer", "string", "array", "object"]),
                 min_size=1, max_size=3, unique=True)
LEAF_CONDITIONS = st.one_of(st.builds(lambda r: {"required": r}, REQUIRED),
                            st.builds(lambda v: {"const": v}, SCALARS),
                            st.builds(lambda v: {"enum": v}, st.lists(SCALARS, min_size=1, max_size=3)),
                            st.builds(lambda t: {"type": t}, TYPES))
#: conjunctions: several keywords, `properties` of conditions (the discriminator of an `if`)
CONDITIONS = st.recursive(LEAF_CONDITIONS, lambda inner: st.one_of(
    st.builds(lambda p: {"properties": p}, st.dictionaries(st.sampled_from(KEYS), st.one_of(inner, st.booleans()),
                                                          min_size=1, max_size=2)),
    st.builds(lambda a, b: {**a, **b}, inner, inner)), max_leaves=4)
SUBSCHEMAS = st.one_of(st.just({"type": "object"}), st.just({"required": ["c"]}),
                       st.builds(lambda v: {"properties": {"c": {"const": v}}}, SCALARS),
                       st.just({"type": "string", "maxLength": 1}), st.booleans())


def valid(schema, instance) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def same_verdicts(original: dict, instance) -> None:
    out = rewrite(original)
    assert out.keywords, original  # the rewrite happened
    assert valid(original, instance) == valid(out.schema, instance), (original, out.schema, instance)


def draft(d: int, schema: dict) -> dict:
    return {"$schema": DRAFT_URI[d], **schema}


# ------------------------------------------------ each rewrite against jsonschema

@settings(max_examples=300, deadline=None)
@given(deps=st.dictionaries(st.sampled_from(KEYS), st.lists(st.sampled_from(KEYS), max_size=3),
                            min_size=1, max_size=3), instance=INSTANCES)
def test_dependent_required(deps, instance):
    same_verdicts({"dependentRequired": deps}, instance)
    same_verdicts(draft(7, {"dependencies": deps}), instance)
    same_verdicts(draft(4, {"dependencies": deps}), instance)


@settings(max_examples=300, deadline=None)
@given(deps=st.dictionaries(st.sampled_from(KEYS), SUBSCHEMAS, min_size=1, max_size=2),
       instance=INSTANCES)
def test_dependent_schemas(deps, instance):
    same_verdicts({"dependentSchemas": deps}, instance)
    same_verdicts(draft(7, {"dependencies": deps}), instance)


@settings(max_examples=400, deadline=None)
@given(cond=CONDITIONS, instance=INSTANCES, d=st.sampled_from([6, 7, 2019, 2020]))
def test_not(cond, instance, d):
    assume(complement(cond, d) is not None)
    same_verdicts(draft(d, {"not": cond}), instance)


@settings(max_examples=400, deadline=None)
@given(cond=CONDITIONS, then=st.one_of(st.none(), SUBSCHEMAS), other=st.one_of(st.none(), SUBSCHEMAS),
       instance=INSTANCES, d=st.sampled_from([7, 2020]))
def test_if_then_else(cond, then, other, instance, d):
    assume(complement(cond, 7) is not None)
    schema = draft(d, {"if": cond})
    if then is not None:
        schema["then"] = then
    if other is not None:
        schema["else"] = other
    same_verdicts(schema, instance)


@settings(max_examples=200, deadline=None)
@given(instance=INSTANCES)
def test_nested_rewrites_inside_moved_subschemas(instance):
    """A rewrite inside `then` (moved) and beside other keywords of the same node."""
    schema = {"type": ["object", "string"], "properties": {"a": {"not": {"const": "x"}}},
              "if": {"required": ["a"]},
              "then": {"dependentRequired": {"a": ["b"]}, "not": {"required": ["c"]}},
              "else": {"if": {"const": "ab"}, "then": {"maxLength": 0}},
              "dependentSchemas": {"b": {"required": ["c"]}}}
    same_verdicts(schema, instance)
    assert not any(k in json.dumps(rewrite(schema).schema) for k in
                   ('"not"', '"if"', '"then"', '"else"', '"dependent'))


# ------------------------------------------------ what is not rewritten

@pytest.mark.parametrize("schema", [
    {"not": {"minLength": 2}},                          # no exact complement
    {"not": {"const": [1]}},                            # arrays and objects: none either
    {"not": {"required": []}},                          # always true: its complement is false
    {"not": {"const": "a\\b"}},                        # llguidance's [^\\] lets an escaped \ through
    {"not": {"enum": ["a", "\""]}},
    {"if": {"properties": {"a": {"minimum": 1}}}, "then": {"required": ["b"]}},
    {"not": {"type": "integer"}},                        # "a number not an integer": no form
    {"not": {"properties": {"a": {"const": 1}, "b": {"title": "any"}}}},  # b always holds
    draft(4, {"not": {"const": 1}}),                    # draft 4: const unknown, bounds boolean
    draft(6, {"if": {"required": ["a"]}, "then": {"required": ["b"]}}),  # draft 6: no if
    draft(7, {"$ref": "#/definitions/x", "dependencies": {"a": ["b"]}, "definitions": {"x": {}}}),
    {"if": {"required": ["a"]}, "then": {"required": ["b"]}, "$defs": {"y": {"$ref": "#/then"}}},
])
def test_not_rewritten(schema):
    out = rewrite(schema)
    assert out.keywords == [] and out.schema == schema


def test_input_not_changed_and_paths_map_back():
    schema = {"properties": {"p": {"if": {"required": ["a"]},
                                   "then": {"properties": {"t": {"uniqueItems": True}}},
                                   "else": {"contains": {}}}}}
    before = json.loads(json.dumps(schema))
    given_schema, ignored = schema_for_llguidance(schema, lenient=True, number_digits=None)
    assert schema == before
    assert {(i.path, i.keyword) for i in ignored} == {
        ("#/properties/p/then/properties/t", "uniqueItems"), ("#/properties/p/else", "contains")}
    assert "uniqueItems" not in json.dumps(given_schema) and "contains" not in json.dumps(given_schema)


# ------------------------------------------------ llguidance enforces the rewrites

class _Bytes:
    """A byte-level tokenizer for llguidance: token i is byte i, 256 is EOS."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


TOKENIZER = LLTokenizer(TokenizerWrapper(_Bytes()))


def matcher(schema: dict) -> LLMatcher:
    grammar = LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_DEFAULTS, overrides={**JSON_OVERRIDES, "lenient": False})
    m = LLMatcher(TOKENIZER, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(schema: dict, text: str) -> bool:
    m = matcher(schema)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def allowed(m: LLMatcher) -> list[int]:
    bits = int.from_bytes(m.compute_bitmask(), "little")
    return [t for t in range(257) if bits >> t & 1]


SMALL_OBJECTS = [
    {"type": "object", "properties": {k: {"enum": [0, "x"]} for k in KEYS},
     "additionalProperties": False, "dependentRequired": {"a": ["b"], "b": ["c"]}},
    {"type": "object", "properties": {k: {"enum": [0, "x"]} for k in KEYS},
     "additionalProperties": False, "if": {"required": ["a"]}, "then": {"required": ["c"]},
     "else": {"required": ["b"]}},
    {"type": "object", "properties": {k: {"enum": [0, "ab", None]} for k in KEYS},
     "additionalProperties": False,
     "dependentSchemas": {"a": {"properties": {"b": {"not": {"const": "ab"}}}}}},
    {"$schema": DRAFT_URI[7], "type": "object", "properties": {k: {"enum": [0, 1]} for k in KEYS},
     "additionalProperties": False, "not": {"required": ["a", "b"]},
     "dependencies": {"c": ["a"]}},
]


@pytest.mark.parametrize("schema", SMALL_OBJECTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_llguidance_outputs_of_rewritten_object_schemas_are_valid(schema, data):
    """Compiled with nothing listed (enforced), every output llguidance lets through
    (a random walk over its masks) is valid against the schema as written."""
    given_schema, ignored = schema_for_llguidance(schema, number_digits=None)
    assert ignored == []
    m, out = matcher(given_schema), b""
    while True:
        choice = data.draw(st.sampled_from(allowed(m)))
        if choice == 256:
            break
        assert m.consume_token(choice)
        out += bytes([choice])
        assume(len(out) < 200)
    assert valid(schema, json.loads(out)), out


@settings(max_examples=300, deadline=None)
@given(cond=LEAF_CONDITIONS.filter(lambda c: "required" not in c), instance=SCALARS)
def test_llguidance_accepts_exactly_the_complement_of_scalars(cond, instance):
    """For a scalar (no key order to narrow), llguidance accepts the value under the
    rewritten `not` exactly when jsonschema accepts it under the original."""
    schema = {"not": cond}
    assume(complement(cond, 2020) is not None)
    given_schema, ignored = schema_for_llguidance(schema, number_digits=None)
    assert ignored == []
    assert accepts(given_schema, json.dumps(instance, ensure_ascii=False)) == valid(schema, instance), (cond, instance)
