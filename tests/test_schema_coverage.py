"""clickpaca.grammar.schema_coverage: the keywords and paths a JSON schema leaves unenforced.

Pure: llguidance compiles the schemas without a tokenizer (`validate_grammar_with_warnings`),
so its own verdict (refusal, lenient warnings) is the reference for our tables and walk.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from clickpaca.grammar.grammars import JSON_DEFAULTS, JSON_OVERRIDES, schema_for_llguidance
from clickpaca.grammar.grammars.schemas import _refusal
from clickpaca.grammar.schema_coverage import (
    ANNOTATIONS, DRAFTS, FORMATS, IMPLEMENTED, ONE_OF_REFUSED, approximated_one_ofs, coverage,
    known_keyword, pointer)

DRAFT_URI = {v: k for k, v in DRAFTS.items()}
#: every keyword some draft knows (schema_coverage's tables), plus a few no draft knows
CANDIDATES = sorted({*IMPLEMENTED, *ANNOTATIONS, "dependencies", "not", "uniqueItems", "contains",
                     "propertyNames", "if", "then", "else", "$recursiveAnchor", "$recursiveRef",
                     "dependentRequired", "dependentSchemas", "maxContains", "minContains",
                     "unevaluatedItems", "unevaluatedProperties", "$dynamicAnchor", "$dynamicRef",
                     "x-custom", "deprecated", "discriminator", "nullable"})
#: not implemented, and in these uses not rewritten either (schema_rewrite.py): `not` and `if`
#: of a type have no exact complement in what llguidance implements
UNENFORCED = ("uniqueItems", "not", "if", "contains", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems")


def llg(schema: dict, lenient: bool = False, coerce: bool = False) -> tuple[bool, list[str]]:
    """llguidance's (is_error, messages) compiling the schema with the given options."""
    grammar = LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_DEFAULTS,
        overrides={**JSON_OVERRIDES, "lenient": lenient, "coerce_one_of": coerce})
    return LLMatcher.validate_grammar_with_warnings(grammar)


def llg_keywords(messages: list[str]) -> set[str]:
    """The keywords llguidance's lenient warnings name (formats as "format")."""
    out = set()
    for m in messages:
        if m.startswith("Unimplemented keys: "):
            out |= set(json.loads(m[len("Unimplemented keys: "):].split(" (")[0]))
        elif m.startswith("Unknown format: "):
            out.add("format")
    return out


def unenforced(schema: dict) -> set[tuple[str, str]]:
    cov = coverage(schema)
    return {(i.path, i.keyword) for i in cov.unimplemented + cov.formats}


# ------------------------------------------------------------------ the tables


@pytest.mark.parametrize("draft", sorted(DRAFT_URI))
def test_keyword_table_agrees_with_llguidance_for_every_draft(draft):
    """Known, unimplemented: llguidance refuses it by name; otherwise it compiles (a keyword
    the draft does not know is ignored, as JSON Schema says)."""
    for key in CANDIDATES:
        if key in ("$schema", "$ref", "$id", "id", "$anchor", "$dynamicAnchor"):
            continue  # their values mean something to the resolver; covered below
        schema = {"$schema": DRAFT_URI[draft], "type": "string", key: {}}
        if key in IMPLEMENTED:
            continue  # their values are checked; the implemented ones are compiled below
        is_error, msgs = llg(schema)
        refused = known_keyword(draft, key) and key not in ANNOTATIONS
        assert is_error == refused, (draft, key, msgs)
        if refused:
            assert msgs == [f'Unimplemented keys: ["{key}"]'], msgs
        assert unenforced(schema) == ({("#", key)} if refused else set()), (draft, key)


def test_implemented_keywords_compile_and_are_not_listed():
    schema = {"type": ["object", "array", "string", "integer"], "properties": {"a": {"const": 1}},
              "additionalProperties": False, "required": ["a"], "patternProperties": {},
              "items": {"enum": [1, 2]}, "prefixItems": [{"type": "integer"}], "minItems": 1,
              "maxItems": 3, "minLength": 1, "maxLength": 5, "pattern": "^a+$", "format": "date",
              "minimum": 0, "maximum": 9, "exclusiveMinimum": -1, "exclusiveMaximum": 10,
              "multipleOf": 1, "anyOf": [{"type": "integer"}, {"type": "string"}],
              "allOf": [{}], "$defs": {"x": {"type": "integer"}}, "oneOf": [{"$ref": "#/$defs/x"}],
              "title": "t", "description": "d", "default": 1, "examples": [1], "$comment": "c"}
    assert llg(schema) == (False, [])
    assert unenforced(schema) == set()


def test_format_table_agrees_with_llguidance():
    others = ["url", "path", "topic", "positiveInteger", "idn-email", "", "uri-reference", "regex",
              "int32", "iri", "json-pointer", "idn-hostname", "uri-template", "byte"]
    for name in sorted(FORMATS):
        assert llg({"type": "string", "format": name}) == (False, []), name
        assert unenforced({"type": "string", "format": name}) == set()
    for name in others:
        schema = {"type": "string", "format": name}
        assert llg(schema) == (True, [f"Unknown format: {name}"]), name
        assert unenforced(schema) == {("#", "format")}
        # a format on a value that cannot be a string asserts nothing (JSON Schema, llguidance)
        assert llg({"type": "integer", "format": name}) == (False, [])
        assert unenforced({"type": "integer", "format": name}) == set()


def test_pointer_escapes():
    assert pointer(()) == "#"
    assert pointer(("properties", "a/b~c", "items", 0)) == "#/properties/a~1b~0c/items/0"


# ------------------------------------------------------------------ the walk, on random schemas


@st.composite
def enforced_schemas(draw, depth: int = 0):
    """(schema, [path tuples of its subschemas llguidance compiles]) with enforced keywords only."""
    leaves = st.sampled_from([
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
        {"type": "boolean"}, {"enum": ["a", "b"]}, {"const": 3}, {"type": "string", "format": "date"},
        {"type": "number", "multipleOf": 0.5}, {"type": "null"}, {"type": "string", "pattern": "^x+$"}])
    kind = draw(st.sampled_from(["leaf", "object", "array", "anyOf", "allOf"] if depth < 3 else ["leaf"]))
    if kind == "leaf":
        return copy.deepcopy(draw(leaves)), [()]
    if kind == "object":
        names = draw(st.lists(st.text("abc/~", min_size=1, max_size=3), min_size=1, max_size=3, unique=True))
        schema, paths = {"type": "object", "properties": {}, "additionalProperties": False}, [()]
        for n in names:
            sub, sub_paths = draw(enforced_schemas(depth + 1))
            schema["properties"][n] = sub
            paths += [("properties", n) + p for p in sub_paths]
        schema["required"] = names[:1]
        return schema, paths
    if kind == "array":
        sub, sub_paths = draw(enforced_schemas(depth + 1))
        return {"type": "array", "items": sub, "maxItems": 3}, [()] + [("items",) + p for p in sub_paths]
    if kind == "allOf":  # two typed branches would be unsatisfiable; an annotation is any value
        sub, sub_paths = draw(enforced_schemas(depth + 1))
        return ({"allOf": [sub, {"title": "t"}]},
                [(), ("allOf", 1)] + [("allOf", 0) + p for p in sub_paths])
    subs = [draw(enforced_schemas(depth + 1)) for _ in range(draw(st.integers(1, 3)))]
    return ({kind: [s for s, _ in subs]},
            [()] + [(kind, i) + p for i, (_, ps) in enumerate(subs) for p in ps])


def _at(schema, path):
    for p in path:
        schema = schema[p]
    return schema


@settings(max_examples=60)
@given(enforced_schemas(), st.data())
def test_one_unenforced_keyword_anywhere_is_reported_exactly_there(sp, data):
    schema, paths = sp
    assert unenforced(schema) == set()
    assert llg(schema) == (False, [])
    path = data.draw(st.sampled_from(paths))
    key = data.draw(st.sampled_from(UNENFORCED))
    changed = copy.deepcopy(schema)
    _at(changed, path)[key] = True if key == "uniqueItems" else {"type": "integer"}
    assert unenforced(changed) == {(pointer(path), key)}
    # llguidance agrees: it refuses that keyword, and its lenient mode names only it
    assert llg(changed) == (True, [f'Unimplemented keys: ["{key}"]'])
    is_error, msgs = llg(changed, lenient=True)
    assert not is_error and llg_keywords(msgs) == {key}
    # ours: refused by default (llguidance's message), compiled and listed when lenient,
    # and the schema handed to llguidance is the one without it
    given_default, ignored = schema_for_llguidance(changed, lenient=False, strict=False, number_digits=None)
    assert ignored == [] and given_default == changed
    stripped, ignored = schema_for_llguidance(changed, lenient=True, strict=False, number_digits=None)
    assert [(i.path, i.keyword) for i in ignored] == [(pointer(path), key)]
    assert stripped == schema and llg(stripped) == (False, [])


@settings(max_examples=40)
@given(enforced_schemas(), st.data(), st.sampled_from(["url", "path", "", "idn-email", "int64"]))
def test_an_unknown_format_anywhere_is_an_annotation_listed_there(sp, data, name):
    schema, paths = sp
    strings = [p for p in paths if "string" in json.dumps(_at(schema, p).get("type", "string"))
               and not any(k in _at(schema, p) for k in ("anyOf", "allOf", "properties", "items"))]
    if not strings:
        return
    path = data.draw(st.sampled_from(strings))
    changed = copy.deepcopy(schema)
    _at(changed, path)["format"] = name
    assert unenforced(changed) == {(pointer(path), "format")}
    assert llg(changed) == (True, [f"Unknown format: {name}"])
    for lenient in (False, True):
        given_schema, ignored = schema_for_llguidance(changed, lenient=lenient, strict=False, number_digits=None)
        assert [(i.path, i.keyword) for i in ignored] == [(pointer(path), "format")]
        assert llg(given_schema) == (False, [])
    assert schema_for_llguidance(changed, lenient=False, strict=True, number_digits=None) == (changed, [])


def test_walk_follows_refs_and_skips_what_llguidance_never_compiles():
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/x"},
                       "c": {"type": "string", "properties": {"q": {"uniqueItems": True}}},
                       "d": {"description": "only annotations", "uniqueItems": False,
                             "x-unknown": {"not": {}}}},
        "$defs": {"x": {"type": "array", "uniqueItems": True, "items": {"$ref": "#/$defs/y"}},
                  "y": {"not": {"uniqueItems": True}},
                  "unused": {"if": {}, "then": {}}},
    }
    # "c" is a string: its properties are never compiled; "d" has a known keyword, so it
    # is compiled and its uniqueItems is listed; under `not` nothing is entered
    assert unenforced(schema) == {("#/$defs/x", "uniqueItems"), ("#/$defs/y", "not"),
                                  ("#/properties/d", "uniqueItems")}
    is_error, msgs = llg(schema, lenient=True)
    assert not is_error and llg_keywords(msgs) == {"uniqueItems", "not"}


def test_draft7_array_items_and_anchor_refs():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"$ref": "#named"}], "additionalItems": {"type": "string", "format": "url"},
              "definitions": {"n": {"$id": "#named", "type": "object", "propertyNames": {}}}}
    assert unenforced(schema) == {("#/definitions/n", "propertyNames"), ("#/additionalItems", "format")}
    is_error, msgs = llg(schema, lenient=True)
    assert not is_error and llg_keywords(msgs) == {"propertyNames", "format"}


# ------------------------------------------------------------------ oneOf


def test_one_of_listed_only_where_llguidance_does_not_prove_it_disjoint():
    disjoint = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    overlapping = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}
    schema = {"type": "object", "properties": {"d": disjoint, "o": overlapping,
                                               "e": {"type": "array", "items": overlapping}}}
    found = approximated_one_ofs(schema, coverage(schema).one_ofs, _refusal)
    assert [(i.path, i.keyword) for i in found] == [("#/properties/e/items", "oneOf"), ("#/properties/o", "oneOf")]
    assert approximated_one_ofs(disjoint, coverage(disjoint).one_ofs, _refusal) == []
    assert [i.path for i in approximated_one_ofs(overlapping, coverage(overlapping).one_ofs, _refusal)] == ["#"]
    is_error, msgs = llg(schema)
    assert is_error and ONE_OF_REFUSED in msgs[0]  # strict: llguidance's own refusal
    assert llg(schema, coerce=True)[0] is False


def test_one_of_beside_an_any_of_is_probed_without_losing_the_any_of():
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "string"}, {"type": "integer"}],
              "oneOf": [{"type": "string"}, {"type": "integer", "maximum": 3}]},
        "b": {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]}}}
    found = approximated_one_ofs(schema, coverage(schema).one_ofs, _refusal)
    assert [i.path for i in found] == ["#/properties/b"]
