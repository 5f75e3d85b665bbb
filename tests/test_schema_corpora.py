"""Real-world JSON schemas from installed packages (measure/schemas.py): a fixed subset of
check-jsonschema's vendored schemas and of the SchemaStore catalog cached in schemastore.

Each schema compiles or is refused by name; what is not enforced is exact (the listed
places hold the keyword, and llguidance's own lenient mode warns about the same keywords
as often); and through the real server every finished output's `schemaValid` agrees with
an independent jsonschema call (a cut one says null), and no output repeats a key.
"""

from __future__ import annotations

import collections
import json
import re

import jsonschema
import pytest
from llguidance import LLMatcher

from clickpaca.grammar.grammars import JSON_DEFAULTS, JSON_OVERRIDES, _schema_overrides, schema_for_llguidance
from clickpaca.grammar.json_keys import repeated_keys
from clickpaca.grammar.schema_rewrite import rewrite
from clickpaca.measure.schemas import load, pick

IF_THEN = [("#/properties/python/properties/install/allOf/0", "if"),
           ("#/properties/python/properties/install/allOf/0", "then"),
           ("#/properties/python/properties/install/items/anyOf/2/allOf/0", "if"),
           ("#/properties/python/properties/install/items/anyOf/2/allOf/0", "then"),
           ("#/properties/python/properties/install/items/anyOf/2/allOf/1", "if"),
           ("#/properties/python/properties/install/items/anyOf/2/allOf/1", "then")]
URL = [("#/definitions/eventHorizonConfiguration/properties/url", "format")]
#: (corpus, name) -> (by default: the ignored places or the refusal, with lenient: the same)
SUBSET = {
    ("check-jsonschema", "github-discussion.json"): ([], []),
    ("check-jsonschema", "github-issue-config.json"): ([], []),
    ("check-jsonschema", "codecov.json"): ([], []),
    # two of its three if/then are rewritten exactly (schema_rewrite.py); the one testing
    # `contains` is not
    ("check-jsonschema", "readthedocs.json"): ('Unimplemented keys: ["if", "then"]', IF_THEN[:2]),
    ("schemastore", ".clasp.json"): ([], []),
    ("schemastore", "Dolittle Event Horizons Configuration"): (URL, URL),
    ("schemastore", "JSON-e templates"): ([("#/$defs/jsone-value", "oneOf")],) * 2,
    ("schemastore", "JSONPatch"): ([("#/items", "oneOf")],) * 2,
    ("schemastore", ".commitlintrc"): ('Unimplemented keys: ["propertyNames"]',
                                       [("#/properties/rules", "propertyNames")]),
    ("schemastore", "Cheatsheets"): ('Unimplemented keys: ["uniqueItems"]',
                                     [("#/properties/cheatpaths/items/properties/tags", "uniqueItems")]),
    ("schemastore", "*.resjson"): ("circular references with sibling keys are not supported",) * 2,
    ("schemastore", "browser.i18n.json"): ("regex parse error",) * 2,  # a lookahead
    ("schemastore", "Web App Manifest"): ("is not present in a registry",) * 2,  # a remote $ref
}


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for corpus in sorted({c for c, _ in SUBSET}):
        by_name = {s.name: s.schema for s in load(corpus)}
        for c, name in SUBSET:
            if c == corpus:
                out[(c, name)] = by_name[name]
    return out


def refusal(schema: dict, strict: bool = False) -> str | None:
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS, overrides=_schema_overrides(strict))
    is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar)
    return msgs[0] if is_error else None


def outcome(schema: dict, lenient: bool) -> list | str:
    given, ignored = schema_for_llguidance(schema, lenient)
    err = refusal(given)
    return err if err is not None else [(i.path, i.keyword) for i in ignored]


def llguidance_lenient_counts(schema: dict) -> collections.Counter | None:
    """How often llguidance's own lenient mode warns about each keyword (None: refused)."""
    grammar = LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_DEFAULTS, overrides={**JSON_OVERRIDES, "lenient": True})
    is_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return None
    counts: collections.Counter = collections.Counter()
    for m in msgs:
        times = re.search(r" \((\d+) times\)$", m)
        n = int(times.group(1)) if times else 1
        if m.startswith("Unimplemented keys: "):
            for k in json.loads(m[len("Unimplemented keys: "):].split(" (")[0]):
                counts[k] += n
        elif m.startswith("Unknown format: "):
            counts["format"] += n
    return counts


def at(schema, pointer: str):
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def test_the_corpora_load_sorted_and_pick_is_fixed():
    for corpus in ("check-jsonschema", "schemastore"):
        c = load(corpus)
        assert len(c) >= 20 and [s.name for s in c] == sorted(s.name for s in c)
        assert pick(c, 5) == pick(c, 5) and len(pick(c, 5)) == 5
        assert all(s.size <= 3000 for s in pick(c, None, 3000))


@pytest.mark.parametrize("key", sorted(SUBSET), ids=lambda k: f"{k[0]}:{k[1]}")
def test_each_compiles_or_is_refused_by_name_and_ignored_is_exact(schemas, key):
    schema = schemas[key]
    for lenient, expected in zip((False, True), SUBSET[key]):
        got = outcome(schema, lenient)
        if isinstance(expected, str):
            assert isinstance(got, str) and expected in got, (lenient, got)
            continue
        assert got == expected, (lenient, got)
        for pointer, keyword in got:
            assert keyword in at(schema, pointer), (pointer, keyword)
    # llguidance's own lenient mode, independent of our walk, warns about the same keywords
    # of the rewritten schema, as many times (a oneOf compiled as anyOf is not a keyword it
    # warns about by name)
    theirs = llguidance_lenient_counts(rewrite(schema).schema)
    lenient = SUBSET[key][1]
    if theirs is not None and not isinstance(lenient, str):
        ours = collections.Counter(k for _, k in lenient if k != "oneOf")
        assert ours == theirs, (ours, theirs)
    # strict refuses whatever the default leaves unenforced
    if SUBSET[key][0] and not isinstance(SUBSET[key][0], str):
        assert refusal(schema, strict=True) is not None


@pytest.mark.model
def test_every_output_is_checked_and_agrees_with_jsonschema(schemas):
    from conftest import spawn_server

    runnable = [(k, v) for k, v in sorted(SUBSET.items()) if any(not isinstance(x, str) for x in v)]
    server = spawn_server(nSeqMax=len(runnable), nCtx=len(runnable) * 256)
    try:
        for i, (key, (default, lenient)) in enumerate(runnable):
            use_lenient = isinstance(default, str)
            ev = server.grammar(f"g{i}", "%json_schema " + json.dumps(schemas[key]), lenient=use_lenient)
            expected = lenient if use_lenient else default
            assert ev["enforced"] is (not expected), (key, ev)
            assert [(x["path"], x["keyword"]) for x in ev["ignored"]] == expected, (key, ev)
        for i, (key, _) in enumerate(runnable):
            kind = key[1].removesuffix(".json")
            server.infer(i, f"<start_of_turn>user\nA short {kind} file as JSON.<end_of_turn>\n<start_of_turn>model\n",
                         grammar_id=f"g{i}", maxTokens=48, temperature=0.6, seed=i, validate=True)
        finished = 0
        for i, (key, _) in enumerate(runnable):
            toks, final = server.collect(i)
            assert final["type"] == "done", (key, final)
            text = "".join(t["piece"] for t in toks)
            assert repeated_keys(text) == 0, (key, text)  # finished or cut, no object repeats a key
            if final["stop_reason"] != "grammar":
                assert final["schemaValid"] is None, (key, final)
                continue
            finished += 1
            schema = schemas[key]
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            objects: list = []
            value = json.loads(text, object_pairs_hook=lambda kv: objects.append([k for k, _ in kv]) or dict(kv))
            assert all(len(set(k)) == len(k) for k in objects), (key, text)
            valid = cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)
            assert final["schemaValid"] is valid, (key, text, final)
        assert finished >= 1  # at least one output is complete within 48 tokens
    finally:
        server.close()


def _pairs(messages: list[str]) -> collections.Counter:
    """llguidance's lenient warnings as keyword counts, min/maxProperties as one name."""
    out: collections.Counter = collections.Counter()
    for m in messages:
        times = re.search(r" \((\d+) times\)$", m)
        n = int(times.group(1)) if times else 1
        if m.startswith("Unimplemented keys: "):
            for k in json.loads(m[len("Unimplemented keys: "):].split(" (")[0]):
                out[k] += n
        elif m.startswith("Unknown format: "):
            out["format"] += n
        elif m.startswith("min/maxProperties"):
            out["min/maxProperties"] += n
    return out


@pytest.mark.slow
def test_lenient_account_agrees_with_llguidance_across_the_corpora():
    """Over a spread of both corpora (every schema of check-jsonschema, 120 of SchemaStore's,
    within the protocol's 128 KiB): wherever llguidance's own lenient mode compiles a
    schema, ours names the same keywords, each at least once per place llguidance warns
    about (llguidance warns once per compilation of a node and compiles some nodes more
    than once); and we never compile what it refuses. Ours may refuse where it compiles
    only when the keyword sits in a document our walk cannot see (the JSON Schema
    meta-schemas llguidance bundles, reached by remote $ref)."""
    seen = collections.Counter()
    for corpus, limit in (("check-jsonschema", None), ("schemastore", 120)):
        for s in pick(load(corpus), limit):
            if len(json.dumps(s.schema)) > 128 << 10:
                continue
            # on what is left after the rewrites, or, where llguidance refuses the rewritten
            # schema ("schema too large": each if/then doubles the branches), as written
            for base in (rewrite(s.schema).schema, s.schema):
                grammar = LLMatcher.grammar_from_json_schema(
                    base, defaults=JSON_DEFAULTS, overrides={**JSON_OVERRIDES, "lenient": True})
                their_error, msgs = LLMatcher.validate_grammar_with_warnings(grammar)
                if not their_error:
                    break
            given, ignored = schema_for_llguidance(s.schema, True)
            ours = refusal(given)
            if their_error:
                assert ours is not None, s.name  # never compiles what llguidance refuses
                seen["both refuse"] += 1
                continue
            if ours is not None:
                assert "Unimplemented keys" in ours and "$schema" in json.dumps(s.schema), (s.name, ours)
                seen["ours refuses"] += 1
                continue
            counts = collections.Counter(i.keyword for i in ignored if i.keyword not in
                                         ("oneOf", "minProperties", "maxProperties"))
            places = {i.path for i in ignored if i.keyword in ("minProperties", "maxProperties")}
            if places:
                counts["min/maxProperties"] = len(places)
            theirs = _pairs(msgs)
            assert set(counts) == set(theirs), (s.name, counts, theirs)
            assert all(counts[k] <= theirs[k] for k in counts), (s.name, counts, theirs)
            seen["same" if counts == theirs else "same keywords"] += 1
    assert seen["same"] >= 100 and seen["ours refuses"] <= 2, seen
