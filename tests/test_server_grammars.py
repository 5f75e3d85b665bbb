"""Grammar-constrained generation through the real server and the real default model.

JSON schemas, Lark and GBNF grammars (docs/GRAMMARS.md, whose examples are run here),
their interplay with logit bias, penalties and batching, stop_reason "grammar", and
invalid grammars. Sampled outputs (temperature > 0, fixed seeds) are checked with
tools independent of llguidance: `json.loads` + `jsonschema.validate`, Python regexes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from clickpaca.llama.native import vendored_source

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "GRAMMARS.md"
GRAMMARS_DIR = vendored_source() / "grammars"

SEEDS = (0, 1, 2)
TEMP = 0.8

# Gemma 3 token ids (`clickpaca tok --no-bos ...`): digits are always single tokens.
DIGIT = {str(d): t for d, t in zip("0123456789", (236771, 236770, 236778, 236800, 236812,
                                                    236810, 236825, 236832, 236828, 236819))}
TOK_NAME = 1201     # "name" (as in {"name": ...})
TOK_PARIS = 9079    # " Paris"
BAN, FORCE = -1e9, 1e9


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def run_jobs(server, jobs: list[dict]) -> list[tuple[str, list[int], dict]]:
    """Send every infer first (one batch), then collect: [(text, token ids, final event)].

    jobs[i] is the infer request of seq_id i (without seq_id).
    """
    assert len(jobs) <= server.ready["nSeqMax"]
    for sid, job in enumerate(jobs):
        server.infer(sid, **job)
    out = []
    for sid in range(len(jobs)):
        toks, final = server.collect(sid)
        out.append(("".join(t["piece"] for t in toks), [t["token"] for t in toks], final))
    return out


def assert_done(final: dict, reason: str | None = "grammar", what: object = "") -> None:
    assert final["type"] == "done", (what, final)
    if reason is not None:
        assert final["stop_reason"] == reason, (what, final)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def outside_strings(text: str) -> str:
    """The JSON text with every string literal replaced by ""."""
    return _JSON_STRING.sub('""', text)


def assert_json_layout(text: str, item_sep: str = ", ", key_sep: str = ": ") -> None:
    """json.dumps layout: the separators given, no other whitespace outside strings."""
    rest = outside_strings(text)
    for sep in (item_sep, key_sep):
        if sep.strip() != sep:
            assert not re.search(re.escape(sep.strip()) + r"(?! )", rest), text
    rest = rest.replace(item_sep, ",").replace(key_sep, ":")
    assert not re.search(r"\s", rest), f"free whitespace in {text!r}"


def check_json(text: str, schema: dict, **layout) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert_json_layout(text, **layout)
    return value


WHOLE = {"enforced": True, "ignored": []}  # grammar_ready's account of a schema enforced whole


def register(server, gid: str, text: str) -> str:
    ev = server.grammar(gid, text)
    assert ev == {"type": "grammar_ready", "id": gid, **(WHOLE if text.lstrip().startswith("%json_schema") else {})}
    return gid


def schema_text(schema: dict) -> str:
    return "%json_schema " + json.dumps(schema)


# ============================================================================ JSON schemas

SCHEMAS: dict[str, tuple[dict, str]] = {
    "person": ({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age"], "additionalProperties": False,
    }, "Describe a person as JSON."),
    "nested": ({
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                    "role": {"enum": ["admin", "user", "guest"]},
                                    "active": {"type": "boolean"}},
                     "required": ["id", "role", "active"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                     "minItems": 1, "maxItems": 3},
        },
        "required": ["user", "tags"], "additionalProperties": False,
    }, "Give a user account as JSON, with tags."),
    "numbers": ({
        "type": "object",
        "properties": {
            "celsius": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.5},
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1,
                      "multipleOf": 0.25},
            "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        },
        "required": ["celsius", "count", "ratio", "delta"], "additionalProperties": False,
    }, "Give a weather measurement as JSON."),
    "order": ({
        "type": "array",
        "items": {"type": "object",
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                  "required": ["sku", "qty"], "additionalProperties": False},
        "minItems": 2, "maxItems": 3,
    }, "List the items of a shop order as a JSON array."),
    "optional": ({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "done": {"type": "boolean"},
            "priority": {"enum": ["low", "high"]},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["title"], "additionalProperties": False,
    }, "Give a todo item as JSON."),
    "anyof_refs": ({
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "end": {"$ref": "#/$defs/point"},
            "label": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                {"type": "string", "maxLength": 5}]},
            "kind": {"const": "segment"},
        },
        "required": ["start", "end", "label", "kind"], "additionalProperties": False,
    }, "Describe a line segment as JSON."),
    "phone": ({"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3}-[0-9]{4}$"},
              "Give a phone number as a JSON string."),
    "enum": ({"enum": ["red", "green", "blue", 7, None, True]},
             "Pick a colour; answer in JSON."),
}


@pytest.fixture(scope="module")
def schema_runs(server):
    """Every schema x every seed, at temperature TEMP, in batches of up to 16 sequences."""
    for name, (schema, _) in SCHEMAS.items():
        register(server, f"schema-{name}", schema_text(schema))
    jobs = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    results: dict[tuple[str, int], tuple] = {}
    step = server.ready["nSeqMax"]
    for i in range(0, len(jobs), step):
        chunk = jobs[i:i + step]
        outs = run_jobs(server, [dict(prompt=chat(SCHEMAS[n][1]), grammar_id=f"schema-{n}",
                                      maxTokens=80, temperature=TEMP, seed=seed)
                                 for n, seed in chunk])
        results.update(zip(chunk, outs))
    return results


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_outputs_validate(schema_runs, name):
    schema = SCHEMAS[name][0]
    values = []
    for seed in SEEDS:
        text, tokens, final = schema_runs[(name, seed)]
        assert_done(final, "grammar", (name, seed, text))
        assert final["tokens_predicted"] == len(tokens) < 80
        values.append(check_json(text, schema))
    if name == "numbers":
        for v in values:
            assert all(isinstance(v[k], int) for k in ("count", "delta"))


def test_schema_runs_are_seeded(server):
    """Same seed, same grammar, same computation: the same output. Each run is alone on the
    idle server (the cells restart from the first one), so the logits are bit-identical;
    two copies in one batch sit in different cells, which the CPU kernels round differently
    (a sampled draw near a boundary can then part), so in a batch both must only be valid:
    the grammar state is per sequence."""
    gid = register(server, "schema-person", schema_text(SCHEMAS["person"][0]))
    job = dict(prompt=chat(SCHEMAS["person"][1]), grammar_id=gid, maxTokens=60,
               temperature=TEMP, seed=41)
    (a,), (b,) = run_jobs(server, [job]), run_jobs(server, [job])
    assert_done(a[2])
    assert_done(b[2])
    assert a[1] == b[1]
    check_json(a[0], SCHEMAS["person"][0])
    for text, _, final in run_jobs(server, [job, job]):
        assert_done(final)
        check_json(text, SCHEMAS["person"][0])


# ============================================================================ Lark

LARK: dict[str, tuple[str, str, str]] = {
    # name: (grammar, prompt, regex the whole output must match)
    "greeting": ('%llguidance {}\n'
                 'start: GREETING " " NAME "!"\n'
                 'GREETING: "hello" | "hi"\n'
                 'NAME: /[A-Z][a-z]{1,8}/\n',
                 "Greet someone by name.", r"(hello|hi) [A-Z][a-z]{1,8}!"),
    "kv_lines": ('%llguidance {}\n'
                 'start: line{1,3}\n'
                 'line: KEY "=" VALUE "\\n"\n'
                 'KEY: /[a-z_]{1,6}/\n'
                 'VALUE: /[0-9]{1,4}/ | "true" | "false"\n',
                 "Write a small config file.", r"([a-z_]{1,6}=([0-9]{1,4}|true|false)\n){1,3}"),
    "sum": ('%llguidance {}\n'
            'start: expr " = " NUM\n'
            'expr: term (OP term){1,3}\n'
            'term: NUM | "(" expr ")"\n'
            'OP: "+" | "-" | "*"\n'
            'NUM: /[1-9][0-9]{0,2}/\n',
            "Write a sum and its result.",
            r"[0-9+\-*()]+ = [1-9][0-9]{0,2}"),
    "yes_no_reason": ('%llguidance\n'
                      'start: ANSWER ", because " REASON "."\n'
                      'ANSWER: "Yes" | "No"\n'
                      'REASON: /[a-z ]{1,30}/\n',
                      "Is water wet?", r"(Yes|No), because [a-z ]{1,30}\."),
    # multi-byte characters: pieces of a character split across tokens are held back
    "unicode": ('%llguidance {}\n'
                'start: "h\u00e9llo w\u00f6rld \u2713 " KANA "\u3002"\n'
                'KANA: /[\u3041-\u3093]{1,3}/\n',
                "Say hello in Japanese.", "h\u00e9llo w\u00f6rld \u2713 [\u3041-\u3093]{1,3}\u3002"),
}


@pytest.mark.parametrize("name", list(LARK))
def test_lark_outputs_match(server, name):
    grammar, prompt, pattern = LARK[name]
    gid = register(server, f"lark-{name}", grammar)
    outs = run_jobs(server, [dict(prompt=chat(prompt), grammar_id=gid, maxTokens=60,
                                  temperature=TEMP, seed=seed) for seed in SEEDS])
    for seed, (text, _, final) in zip(SEEDS, outs):
        assert_done(final, "grammar", (name, seed, text))
        assert re.fullmatch(pattern, text), (name, seed, text)
        if name == "sum":  # the parentheses nest properly
            expr = text.split(" = ")[0]
            assert expr.count("(") == expr.count(")")
            compile(expr, "<sum>", "eval")


# ============================================================================ GBNF (llama.cpp)

LIST_ITEM = "- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n"


def test_gbnf_list_from_llama_cpp(server):
    """llama.cpp's list.gbnf (`item+`, may end after any item): every line is an item."""
    gid = register(server, "gbnf-list", (GRAMMARS_DIR / "list.gbnf").read_text())
    outs = run_jobs(server, [dict(prompt=chat("List three fruits, one per line."), grammar_id=gid,
                                  maxTokens=48, temperature=TEMP, seed=seed) for seed in SEEDS])
    for seed, (text, tokens, final) in zip(SEEDS, outs):
        assert_done(final, None)
        if final["stop_reason"] == "grammar":  # the model ended after a complete item
            assert re.fullmatch(f"({LIST_ITEM})+", text), (seed, text)
        else:  # cut by maxTokens: complete items, then a started one
            assert final["stop_reason"] == "max_tokens" and len(tokens) == 48
            assert re.fullmatch(f"({LIST_ITEM})*(- ?[^\r\n]*)?", text), (seed, text)


def test_gbnf_json_from_llama_cpp(server):
    """llama.cpp's json.gbnf: the output is one JSON object (whitespace as json.gbnf allows)."""
    gid = register(server, "gbnf-json", (GRAMMARS_DIR / "json.gbnf").read_text())
    prompt = chat('Reply with a JSON object with two short keys, like {"a": 1, "b": "x"}.')
    outs = run_jobs(server, [dict(prompt=prompt, grammar_id=gid, maxTokens=60,
                                  temperature=t, seed=seed)
                             for t, seed in ((0, 0), (TEMP, 1), (TEMP, 2))])
    completed = 0
    for text, tokens, final in outs:
        assert_done(final, None)
        assert text.startswith("{"), text
        if final["stop_reason"] == "grammar":
            completed += 1
            value = json.loads(text)
            assert isinstance(value, dict), text
            # json.gbnf's whitespace: nothing, one space, or a newline and up to 20 blanks
            for ws in re.findall(r"\s+", outside_strings(text)):
                assert re.fullmatch(r" |\n[ \t]{0,20}", ws), (ws, text)
        else:
            assert final["stop_reason"] == "max_tokens", final
    assert completed >= 1, outs


# ============================================================================ doc examples


def doc_examples() -> dict[str, str]:
    """The `<!-- example: NAME -->` fenced blocks of docs/GRAMMARS.md: name -> grammar text."""
    blocks = re.findall(r"<!-- example: (\w+) -->\n```\w*\n(.*?)\n```", DOC.read_text(), re.S)
    return dict(blocks)


def _inner_json(text: str, schema: dict) -> None:
    m = re.fullmatch(r"Answer: (\{.*\})\n", text)
    assert m, text
    value = json.loads(m.group(1))
    jsonschema.validate(value, schema)
    assert " " not in outside_strings(m.group(1)).replace(", ", ",").replace(": ", ":"), text


DATE = r"(19[0-9][0-9]|20[0-2][0-9])-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}

# name: (prompt, check of the output text)
DOC_CHECKS = {
    "gbnf_answer": ("Is the sky blue?",
                    lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
    "gbnf_date": ("When was the first moon landing? Give the date.",
                  lambda t: re.fullmatch(DATE, t)),
    "lark_greeting": ("Greet someone by name.",
                      lambda t: re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", t)),
    "lark_settings": ("Write a small config file.",
                      lambda t: re.fullmatch(r"([a-z_]{1,6}=([0-9]{1,4}|true|false)\n){1,3}", t)),
    "lark_embedded_json": ("Is the sky green?", lambda t: _inner_json(t, VERDICT) or True),
    "schema_person": ("Describe a person as JSON.", None),
    "schema_compact": ("Give a tagged record as JSON.", None),
}


def test_doc_sessions(server):
    """The ndjson sessions of docs/GRAMMARS.md, sent line by line: the first (a grammar and
    an infer), then the lenient schema's."""
    blocks = re.findall(r"```ndjson\n(.*?)\n```", DOC.read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        expected, actual = [], []
        for line in block.splitlines():
            if line.startswith("> "):
                req = json.loads(line[2:])
                server.send(req)
                if req["type"] == "grammar":
                    actual.append(server.next_misc())
                else:
                    tokens, final = server.collect(req["seq_id"])
                    actual += tokens + [final]
            elif line.startswith("< "):
                expected.append(json.loads(line[2:].replace(", ...}", "}")))
        i = 0
        for exp in expected:
            assert i < len(actual), (exp, actual)
            if exp["type"] == "token":  # stands for every token event of the sequence
                assert actual[i]["type"] == "token", actual[i]
                while actual[i]["type"] == "token":
                    assert all(actual[i][k] == v for k, v in exp.items()), (exp, actual[i])
                    i += 1
                continue
            assert all(actual[i].get(k) == v for k, v in exp.items()), (exp, actual[i])
            i += 1
        assert i == len(actual)
        if any(ev["type"] == "token" for ev in actual):
            text = "".join(ev["piece"] for ev in actual if ev["type"] == "token")
            assert re.fullmatch(r"The answer is (yes|no)\.", text), text


def test_doc_has_the_tested_examples():
    assert set(doc_examples()) == set(DOC_CHECKS)


def test_doc_examples(server):
    examples = doc_examples()
    jobs = []
    for name, text in examples.items():
        register(server, f"doc-{name}", text)
        for seed in SEEDS[:2]:
            jobs.append((name, seed, dict(prompt=chat(DOC_CHECKS[name][0]), grammar_id=f"doc-{name}",
                                          maxTokens=60, temperature=TEMP, seed=seed)))
    outs = run_jobs(server, [j for _, _, j in jobs])
    for (name, seed, _), (text, _, final) in zip(jobs, outs):
        assert_done(final, "grammar", (name, seed, text))
        check = DOC_CHECKS[name][1]
        if check is not None:
            assert check(text), (name, seed, text)
        else:  # a JSON schema example
            schema = json.loads(examples[name].split(None, 1)[1])
            layout = schema.get("x-guidance", {})
            check_json(text, schema, item_sep=layout.get("item_separator", ", "),
                       key_sep=layout.get("key_separator", ": "))


# ============================================================================ combinations

OPTIONAL_NAMES = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "city": {"type": "string", "maxLength": 10}},
    "additionalProperties": False,
}
# Not "nickname": after `"nick` the rest of the key is forced text whose only allowed
# token is `name` (see test_banning_the_only_token_of_forced_text_is_an_error).


def test_ban_a_key_token_the_schema_would_use(server):
    """With "name" an optional key (one of several, no other containing it), banning the
    token `name` makes the model spell the key with other tokens ("n" + "ame") or skip
    it; outputs validate."""
    gid = register(server, "ban-name", schema_text(OPTIONAL_NAMES))
    ban = [{"token": TOK_NAME, "bias": BAN}]
    control = dict(prompt=chat('Give a person as JSON with the keys "name" and "age".'),
                   grammar_id=gid, maxTokens=60, temperature=0)
    asked = dict(control, prompt=chat("What is your name? Answer as JSON."))
    jobs = [control, dict(control, logit_bias=ban)]
    jobs += [dict(asked, temperature=TEMP, seed=s, logit_bias=ban) for s in range(5)]
    outs = run_jobs(server, jobs)
    assert TOK_NAME in outs[0][1], outs[0]  # unbanned, the model uses the token
    for text, tokens, final in outs:
        assert_done(final, "grammar", text)
        check_json(text, OPTIONAL_NAMES)
    banned = outs[1:]
    assert not any(TOK_NAME in tokens for _, tokens, _ in banned), banned
    # the key is still written in some outputs, necessarily spelled with other tokens
    assert any('"name": ' in text for text, _, _ in banned), banned


def test_ban_digits_the_schema_would_use(server):
    schema = {"type": "object",
              "properties": {"code": {"type": "integer", "minimum": 100, "maximum": 999},
                             "score": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["code", "score"], "additionalProperties": False}
    gid = register(server, "ban-digits", schema_text(schema))
    banned = [DIGIT["1"], DIGIT["2"]]
    outs = run_jobs(server, [dict(prompt=chat("Give a 3-digit code (like 123) and a score."),
                                  grammar_id=gid, maxTokens=40, temperature=TEMP, seed=seed,
                                  logit_bias=[{"token": t, "bias": BAN} for t in banned])
                             for seed in SEEDS])
    for text, tokens, final in outs:
        assert_done(final, "grammar", text)
        value = check_json(text, schema)
        assert not set(tokens) & set(banned), text
        assert not set(f"{value['code']}{value['score']}") & {"1", "2"}, text


def test_banning_the_token_of_forced_text_spells_it_another_way(server):
    """A required key in a fixed order is forced text: llguidance's mask allows only its
    canonical token (`name`); with that banned, the step's mask is widened with the
    shorter spellings the matcher accepts (docs/GRAMMARS.md), so the output still
    validates, still has the key, and never contains the banned token."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    gid = register(server, "forced-name", schema_text(schema))
    outs = run_jobs(server, [dict(prompt=chat("Give a name as JSON."), grammar_id=gid, maxTokens=30,
                                  temperature=t, seed=seed, logit_bias=[{"token": TOK_NAME, "bias": BAN}])
                             for t, seed in ((0, 0), (TEMP, 1), (TEMP, 2))])
    for text, tokens, final in outs:
        assert_done(final, "grammar", text)
        assert TOK_NAME not in tokens, (text, tokens)
        assert '"name"' in text
        check_json(text, schema)


def test_banning_a_forced_byte_with_no_other_spelling_is_an_error(server):
    """A one-byte forced literal has no shorter spelling: banning its token leaves
    nothing, and the request ends with the error; the server goes on."""
    gid = register(server, "forced-7", 'root ::= "7" [0-9]')
    server.infer(0, "Digits:", grammar_id=gid, maxTokens=5, temperature=0,
                 logit_bias=[{"token": DIGIT["7"], "bias": BAN}])
    tokens, final = server.collect(0)
    assert final["type"] == "error", final
    assert "logit_bias bans every token still allowed" in final["message"], final
    assert not tokens
    text, _, final = run_jobs(server, [dict(prompt="Digits:", grammar_id=gid, maxTokens=5,
                                            temperature=0)])[0]
    assert_done(final, "grammar", text)
    assert re.fullmatch(r"7[0-9]", text), text


FORCE_SCHEMA = {"type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                               "color": {"enum": ["red", "green", "blue"]}},
                "required": ["a", "color"], "additionalProperties": False}


def test_forcing_bias_loses_where_the_grammar_forbids(server):
    """+1e9 on `7` and on ` Paris`: `7` wins wherever the grammar allows it (a == 77),
    ` Paris` is never allowed and never appears; the output validates."""
    gid = register(server, "force-7", schema_text(FORCE_SCHEMA))
    bias = [{"token": DIGIT["7"], "bias": FORCE}, {"token": TOK_PARIS, "bias": FORCE}]
    outs = run_jobs(server, [dict(prompt=chat("Give a number and a colour as JSON."),
                                  grammar_id=gid, maxTokens=40, temperature=TEMP, seed=seed,
                                  logit_bias=bias) for seed in SEEDS])
    for text, tokens, final in outs:
        assert_done(final, "grammar", text)
        value = check_json(text, FORCE_SCHEMA)
        assert value["a"] == 77, text
        assert tokens.count(DIGIT["7"]) == 2 and TOK_PARIS not in tokens, (text, tokens)
        first7 = tokens.index(DIGIT["7"])
        assert tokens[first7 + 1] == DIGIT["7"]
        assert text.startswith('{"a": 77, '), text


def test_forced_token_never_allowed_never_appears(server):
    """The enum forbids every digit: forcing `7` changes nothing about validity."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    gid = register(server, "force-forbidden", schema_text(schema))
    text, tokens, final = run_jobs(server, [dict(
        prompt=chat("What colour is the sky? 7 7 7"), grammar_id=gid, maxTokens=20,
        temperature=TEMP, seed=5, logit_bias=[{"token": DIGIT["7"], "bias": FORCE}])])[0]
    assert_done(final, "grammar", text)
    check_json(text, schema)
    assert DIGIT["7"] not in tokens


def test_schema_with_repetition_penalties(server):
    """Heavy penalties push against the repeated `"`, `, `, `: ` the schema needs: the
    grammar wins, outputs validate."""
    schema = SCHEMAS["nested"][0]
    gid = register(server, "schema-nested", schema_text(schema))
    pen = dict(penaltyRepeat=1.5, penaltyFreq=1.0, penaltyPresent=1.0, penaltyLastN=-1)
    outs = run_jobs(server, [dict(prompt=chat(SCHEMAS["nested"][1]), grammar_id=gid,
                                  maxTokens=80, temperature=TEMP, seed=seed, **pen)
                             for seed in SEEDS] +
                    [dict(prompt=chat(SCHEMAS["nested"][1]), grammar_id=gid, maxTokens=80,
                          temperature=0, **pen)])
    for text, _, final in outs:
        assert_done(final, "grammar", text)
        check_json(text, schema)


def test_truncation_acts_on_allowed_tokens(server):
    """Greedy under a grammar takes the best *allowed* token: raw `top` may show forbidden
    tokens, `steered_top` only the one sampled."""
    gid = register(server, "schema-enum", schema_text(SCHEMAS["enum"][0]))
    server.infer(0, "The capital of France is", grammar_id=gid, maxTokens=10, temperature=0,
                 nProbs=3)
    tokens, final = server.collect(0)
    assert_done(final, "grammar")
    text = "".join(t["piece"] for t in tokens)
    jsonschema.validate(json.loads(text), SCHEMAS["enum"][0])
    for t in tokens:
        assert [s["token"] for s in t["steered_top"]] == [t["token"]], t
        assert t["steered_logprob"] == 0.0
    # the model's own first choice (" the") is not JSON: the grammar overrode it
    assert tokens[0]["top"][0]["token"] != tokens[0]["token"]
    assert tokens[0]["top"][0]["piece"] == " the"


# ============================================================================ batch


def test_eight_grammars_in_one_batch(server):
    """8 sequences, 8 different grammars (GBNF, Lark, JSON schemas, none), all infers sent
    before collecting: each output is valid for its own grammar."""
    g = {
        "gbnf-apples": register(server, "b-gbnf", 'root ::= [1-9] [0-9]? " apples"'),
        "gbnf-list": register(server, "b-list", (GRAMMARS_DIR / "list.gbnf").read_text()),
        "lark": register(server, "b-lark", LARK["greeting"][0]),
        "lark-kv": register(server, "b-kv", LARK["kv_lines"][0]),
        "person": register(server, "b-person", schema_text(SCHEMAS["person"][0])),
        "order": register(server, "b-order", schema_text(SCHEMAS["order"][0])),
        "numbers": register(server, "b-numbers", schema_text(SCHEMAS["numbers"][0])),
    }
    jobs = [
        dict(prompt=chat("How many apples are in the basket?"), grammar_id=g["gbnf-apples"]),
        dict(prompt=chat("List three fruits."), grammar_id=g["gbnf-list"]),
        dict(prompt=chat(LARK["greeting"][1]), grammar_id=g["lark"]),
        dict(prompt=chat(LARK["kv_lines"][1]), grammar_id=g["lark-kv"]),
        dict(prompt=chat(SCHEMAS["person"][1]), grammar_id=g["person"]),
        dict(prompt=chat(SCHEMAS["order"][1]), grammar_id=g["order"]),
        dict(prompt=chat(SCHEMAS["numbers"][1]), grammar_id=g["numbers"]),
        dict(prompt="Once upon a time", maxTokens=12),
    ]
    for i, job in enumerate(jobs):
        job.setdefault("maxTokens", 70)
        job.update(temperature=TEMP, seed=100 + i)
    outs = run_jobs(server, jobs)
    text, _, final = outs[0]
    assert_done(final, "grammar", text)
    assert re.fullmatch(r"[1-9][0-9]? apples", text), text
    text, _, final = outs[1]
    assert_done(final, None)
    assert re.fullmatch(f"({LIST_ITEM})*(- ?[^\r\n]*)?", text), text
    if final["stop_reason"] == "grammar":
        assert re.fullmatch(f"({LIST_ITEM})+", text), text
    for i, name in ((2, "greeting"), (3, "kv_lines")):
        text, _, final = outs[i]
        assert_done(final, "grammar", text)
        assert re.fullmatch(LARK[name][2], text), text
    for i, name in ((4, "person"), (5, "order"), (6, "numbers")):
        text, _, final = outs[i]
        assert_done(final, "grammar", text)
        check_json(text, SCHEMAS[name][0])
    text, tokens, final = outs[7]
    assert_done(final, None)
    assert final["stop_reason"] in ("max_tokens", "eos") and len(tokens) <= 12


# ============================================================================ stop reasons


def test_stop_reason_grammar_when_no_token_can_follow(server):
    gid = register(server, "yes-no", 'root ::= "yes" | "no"')
    text, tokens, final = run_jobs(server, [dict(prompt=chat("Is the sky blue?"),
                                                 grammar_id=gid, maxTokens=10, temperature=0)])[0]
    assert_done(final, "grammar")
    assert text in ("yes", "no") and final["tokens_predicted"] == len(tokens) <= 3


def test_stop_reason_max_tokens_before_the_grammar_completes(server):
    gid = register(server, "schema-person", schema_text(SCHEMAS["person"][0]))
    text, tokens, final = run_jobs(server, [dict(prompt=chat(SCHEMAS["person"][1]),
                                                 grammar_id=gid, maxTokens=3, temperature=0)])[0]
    assert_done(final, "max_tokens")
    assert len(tokens) == 3 and text.startswith('{"name"'), text
    with pytest.raises(ValueError):
        json.loads(text)


def test_stop_reason_grammar_wins_over_max_tokens_on_the_last_token(server):
    """The token that completes the grammar is also the maxTokens-th: "grammar"."""
    gid = register(server, "literal", 'root ::= "Hello, world."')
    job = dict(prompt="Say hello:", grammar_id=gid, temperature=0)
    text, tokens, final = run_jobs(server, [dict(job, maxTokens=20)])[0]
    assert_done(final, "grammar")
    assert text == "Hello, world." and 1 < len(tokens) < 20
    text2, tokens2, final2 = run_jobs(server, [dict(job, maxTokens=len(tokens))])[0]
    assert_done(final2, "grammar")
    assert tokens2 == tokens
    _, tokens3, final3 = run_jobs(server, [dict(job, maxTokens=len(tokens) - 1)])[0]
    assert_done(final3, "max_tokens")
    assert tokens3 == tokens[:-1]


def test_integer_grammar_id(server):
    """An integer id is the same id as its decimal string."""
    server.send({"type": "grammar", "id": 7, "grammar": 'root ::= "seven"'})
    ev = server.next_misc()
    assert ev == {"type": "grammar_ready", "id": "7"}, ev  # ids are strings (docs/GRAMMARS.md)
    for gid in (7, "7"):
        text, _, final = run_jobs(server, [dict(prompt="Say it:", grammar_id=gid, maxTokens=8)])[0]
        assert_done(final, "grammar")
        assert text == "seven"


def test_stop_reason_grammar_when_the_model_ends_where_the_grammar_may(server):
    """`item` may repeat or end; the model ends (an EOG token, not emitted) after one item."""
    gid = register(server, "one-or-more", 'root ::= ("- " [a-z]+ "\\n")+')
    text, tokens, final = run_jobs(server, [dict(prompt=chat("Name one fruit, in lowercase."),
                                                 grammar_id=gid, maxTokens=30, temperature=0)])[0]
    assert_done(final, None)
    assert re.fullmatch(r"(- [a-z]+\n)+", text) or final["stop_reason"] == "max_tokens", text
    if final["stop_reason"] == "grammar":
        assert not any(t in (1, 106, 212) for t in tokens)


# ============================================================================ invalid grammars

INVALID = [
    # (grammar, a substring of llguidance's (or the JSON parser's) message)
    ('%llguidance {}\nstart: foo', 'unknown name: "foo"'),
    ('%llguidance {}\nstart: /[a-/', 'invalid regex "[a-"'),
    ('%llguidance {]\nstart: "a"', 'failed to parse "%llguidance"'),
    ('%json_schema {"type": "objec"}', "Invalid type: objec"),
    ('%json_schema {"type": "array", "uniqueItems": true}', 'Unimplemented keys: ["uniqueItems"]'),
    ('%json_schema {"type": "integer", "minimum": 5, "maximum": 1}',
     "minimum (5) is greater than maximum (1)"),
    ('%json_schema {"type": "string", "minLength": 5, "maxLength": 2}',
     "minLength (5) is greater than maxLength (2)"),
    ('%json_schema {"$ref": "#/$defs/missing"}', "Pointer '/$defs/missing' does not exist"),
    ('%json_schema {bad', "Expecting property name enclosed in double quotes"),
    ('%json_schema {"type": "object",}', "invalid JSON after %json_schema"),
    ('%json_schema [1, 2]', "must be a JSON object"),
    ('root ::= foo', "Rule 'foo' not found"),
    ('start: "a"', "must start with '%llguidance {}'"),  # Lark without its header
]


@pytest.mark.parametrize("text, needle", INVALID)
def test_invalid_grammar_is_an_error_and_registers_nothing(server, text, needle):
    gid = f"bad-{INVALID.index((text, needle))}"
    server.send({"type": "grammar", "id": gid, "grammar": text})
    ev = server.next_misc()
    assert ev["type"] == "error" and ev["request"] == "grammar" and ev["seq_id"] == -1, ev
    assert ev["message"].startswith("grammar: "), ev
    assert needle in ev["message"], ev
    # nothing registered: an infer naming it fails, and the server goes on
    server.infer(3, "Hello", grammar_id=gid, maxTokens=2)
    _, final = server.collect(3)
    assert final["type"] == "error" and final["message"] == \
        f'grammar_id: unknown grammar "{gid}" (send a grammar request first)', final  # the id as JSON
    assert register(server, "after-bad", 'root ::= "ok"') == "after-bad"


def doc_error_table() -> list[tuple[str, list[str]]]:
    """The rows of the error table in docs/GRAMMARS.md: (grammar text, message fragments)."""
    section = DOC.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    rows = []
    for cells in re.findall(r"^\| `(.+?)`(?: \(.*?\))? \| `(.+)` \|$", section, re.M):
        grammar = cells[0].replace("` + `", "\n")
        fragments = [f.strip() for f in cells[1].split("...") if f.strip()]
        rows.append((grammar, fragments))
    return rows


def test_doc_error_table(server):
    rows = doc_error_table()
    assert len(rows) >= 8 and all(any(g == t for t, _ in INVALID) for g, _ in rows), rows
    for i, (grammar, fragments) in enumerate(rows):
        server.send({"type": "grammar", "id": f"doc-bad-{i}", "grammar": grammar})
        ev = server.next_misc()
        assert ev["type"] == "error", (grammar, ev)
        assert ev["message"].startswith(fragments[0]), (fragments, ev)
        assert all(f in ev["message"] for f in fragments), (fragments, ev)


def test_invalid_grammar_keeps_the_previous_one_of_its_id(server):
    register(server, "kept", 'root ::= "kept"')
    server.send({"type": "grammar", "id": "kept", "grammar": '%json_schema {"type": "objec"}'})
    ev = server.next_misc()
    assert ev["type"] == "error" and "Invalid type: objec" in ev["message"], ev
    text, _, final = run_jobs(server, [dict(prompt="Say it:", grammar_id="kept", maxTokens=5,
                                            temperature=TEMP, seed=1)])[0]
    assert_done(final, "grammar")
    assert text == "kept"


# ============================================================================ schema options


INT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}


def test_json_numbers_are_bounded_unless_lifted(server):
    """With the digit 7 forced, the model writes 7s as long as the grammar allows: 16 by
    default, 3 with numberDigits 3, and until maxTokens with numberDigits null."""
    text = schema_text(INT_SCHEMA)
    register(server, "n-default", text)
    assert server.grammar("n-3", text, numberDigits=3) == {"type": "grammar_ready", "id": "n-3", **WHOLE}
    assert server.grammar("n-free", text, numberDigits=None) == {"type": "grammar_ready",
                                                                  "id": "n-free", **WHOLE}
    force = [{"token": DIGIT["7"], "bias": FORCE}]
    outs = run_jobs(server, [dict(prompt=chat("A number as JSON."), grammar_id=g, maxTokens=40,
                                  temperature=0, logit_bias=force)
                             for g in ("n-default", "n-3", "n-free")])
    (t16, _, f16), (t3, _, f3), (tfree, toks, ffree) = outs
    assert_done(f16, "grammar", t16)
    assert t16 == '{"n": ' + "7" * 16 + "}"
    assert_done(f3, "grammar", t3)
    assert t3 == '{"n": 777}'
    assert_done(ffree, "max_tokens", tfree)
    assert re.fullmatch(r'\{"n": 7{20,}', tfree), tfree


def test_number_options_are_refused_outside_json_schemas(server):
    for field, value in (("numberDigits", 8), ("lenient", True)):
        server.send({"type": "grammar", "id": "opt", "grammar": 'root ::= "a"', field: value})
        ev = server.next_misc()
        assert ev["type"] == "error" and ev["request"] == "grammar", ev
        assert ev["message"] == f"{field}: applies to JSON schemas (%json_schema) only", ev
    server.send({"type": "grammar", "id": "opt", "grammar": '%json_schema {}', "numberDigits": 0})
    ev = server.next_misc()
    assert ev["type"] == "error" and ev["message"].startswith("numberDigits: must be >= 1"), ev
    assert server.grammar("opt", 'root ::= "a"', lenient=False) == {"type": "grammar_ready",
                                                                    "id": "opt"}


UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "uniqueItems": True, "minItems": 1, "maxItems": 3}


def test_lenient_schema_registers_and_reports_what_it_ignored(server):
    text = schema_text(UNIQUE)
    server.send({"type": "grammar", "id": "strict", "grammar": text})
    ev = server.next_misc()
    assert ev["type"] == "error" and 'Unimplemented keys: ["uniqueItems"]' in ev["message"], ev
    ev = server.grammar("lenient", text, lenient=True)
    assert ev == {"type": "grammar_ready", "id": "lenient", "enforced": False, "ignored": [
        {"path": "#", "keyword": "uniqueItems", "reason": "not implemented by llguidance"}]}
    clean = {k: v for k, v in UNIQUE.items() if k != "uniqueItems"}
    outs = run_jobs(server, [dict(prompt=chat("Three digits as a JSON array."),
                                  grammar_id="lenient", maxTokens=30, temperature=TEMP, seed=seed)
                             for seed in SEEDS])
    for seed, (out, _, final) in zip(SEEDS, outs):
        assert_done(final, "grammar", (seed, out))
        check_json(out, clean)
        # the whole schema is checked: duplicates break uniqueItems, and say so
        valid = jsonschema.Draft202012Validator(UNIQUE).is_valid(json.loads(out))
        assert final["schemaValid"] is valid, (out, final)
        if not valid:
            assert final["schemaViolation"]["keyword"] == "uniqueItems" and final["schemaViolation"]["path"] == "$"
    # a schema with nothing to ignore reports an empty list
    assert server.grammar("lenient-int", schema_text({"type": "integer"}), lenient=True) == {
        "type": "grammar_ready", "id": "lenient-int", **WHOLE}
