"""clickpaca.grammar.grammars against the real default model's vocabulary (no forward pass needed:
sequences are driven by picking random tokens the mask allows)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from clickpaca.llama.native import vendored_source
from clickpaca.grammar.grammars import (
    JSON_OVERRIDES,
    GrammarEngine,
    GrammarError,
    allowed_ids,
    detect_format,
    fill_masks,
    is_allowed,
)

pytestmark = pytest.mark.model

LLAMA_SRC = vendored_source()
GRAMMARS_DIR = LLAMA_SRC / "grammars"
GBNF_FILES = sorted(GRAMMARS_DIR.glob("*.gbnf"))

# llama.cpp's grammars that llguidance cannot handle: name -> exact reason (none so far).
GBNF_XFAIL: dict[str, str] = {}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def started(model):
    """The engine, and whether its tokenizer was already built when start returned."""
    engine = GrammarEngine.start(model)
    return engine, engine.ready


@pytest.fixture(scope="module")
def engine(started):
    eng, _ = started
    eng.wait()
    return eng


@pytest.fixture(scope="module")
def pieces(model):
    return [model.token_to_piece(t) for t in range(model.n_vocab)]


@pytest.fixture(scope="module")
def eog(model):
    return set(int(t) for t in model.eog_tokens)


def bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class Walker:
    """Drives a matcher with random allowed tokens (numpy RNG), like a sampler would.

    Prefers visible (non-whitespace) tokens; after `finish_after` tokens it takes an
    end-of-generation token when allowed and prefers JSON closers (" ] } , :) so that
    free strings end.
    """

    CLOSERS = set('"]},:')

    def __init__(self, model, pieces, eog, seed: int = 0) -> None:
        self.model, self.pieces, self.eog = model, pieces, eog
        self.rng = np.random.default_rng(seed)
        self.flags = token_flags(model, pieces, eog)

    def run(self, matcher, max_tokens: int = 120, finish_after: int = 40,
            prefer_whitespace: bool = False) -> tuple[bytes, bool]:
        """Returns (output bytes, ended by EOG); every chosen token was allowed by the mask."""
        is_eog, visible, space, closer = self.flags
        out: list[int] = []
        for step in range(max_tokens):
            row = matcher.mask()
            ids = allowed_ids(row, self.model.n_vocab)
            assert ids.size, "the mask allows nothing"
            ends = ids[is_eog[ids]]
            if ends.size and (step >= finish_after or self.rng.random() < 0.3
                              or ends.size == ids.size):
                t = int(self.rng.choice(ends))
                assert matcher.consume(t), matcher.error()
                assert matcher.is_stopped()
                return b"".join(self.pieces[t] for t in out), True
            cand = ids[visible[ids]]
            if prefer_whitespace and space[ids].any():
                cand = ids[space[ids]]
            if step >= finish_after and closer[cand].any():
                cand = cand[closer[cand]]
            if not cand.size:
                cand = ids[~is_eog[ids]] if (~is_eog[ids]).any() else ids
            t = int(self.rng.choice(cand))
            assert bit(row, t)
            assert matcher.consume(t), matcher.error()
            out.append(t)
        return b"".join(self.pieces[t] for t in out), False


_FLAGS: dict[int, tuple] = {}


def token_flags(model, pieces, eog):
    """Per-token bool arrays: is EOG, visible (not blank), whitespace only, JSON closer."""
    if id(model) not in _FLAGS:
        n = model.n_vocab
        is_eog = np.zeros(n, dtype=bool)
        is_eog[sorted(eog)] = True
        visible = np.array([bool(p.strip()) for p in pieces]) & ~is_eog
        space = np.array([bool(p) and not p.strip() for p in pieces]) & ~is_eog
        closer = np.array([bool(p) and set(p.decode("utf-8", "replace")) <= Walker.CLOSERS
                           for p in pieces]) & ~is_eog
        _FLAGS[id(model)] = (is_eog, visible, space, closer)
    return _FLAGS[id(model)]


def free_whitespace(text: str) -> list[int]:
    """Offsets of whitespace outside JSON strings other than one space after ',' or ':'."""
    bad, in_str, esc = [], False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in " \t\r\n" and not (c == " " and i > 0 and text[i - 1] in ",:"):
            bad.append(i)
    return bad


# ----------------------------------------------------------------------------- engine


def test_start_returns_immediately_and_compile_waits(started, model):
    eng, built_at_return = started
    # start returned before the build ended (a Python loop over the 262,144-token
    # vocabulary, seconds long): a bound on start's own wall time would also measure
    # the machine's load
    assert not built_at_return, "GrammarEngine.start waited for the tokenizer build"
    g = eng.compile('root ::= "ok"')  # waits for the background build
    assert eng.ready and eng.build_seconds is not None
    assert eng.tokenizer.vocab_size == model.n_vocab
    assert g.format == "gbnf"


def test_tokenizer_matches_llama_tokenize(engine, model):
    text = '{"name": "Ada", "n": [1, 2]} été 東京'
    assert engine.tokenizer.tokenize_str(text) == model.tokenize(text, False, False).tolist()
    assert set(engine.tokenizer.eos_tokens) == set(model.eog_tokens.tolist())


def test_compile_is_cached(engine):
    text = '%json_schema {"type": "boolean"}'
    assert engine.compile(text) is engine.compile(text)


# ----------------------------------------------------------------------------- llama.cpp's GBNF


def test_llama_cpp_grammars_folder_found():
    assert GBNF_FILES, f"no .gbnf files in {GRAMMARS_DIR}"


@pytest.mark.parametrize("path", GBNF_FILES, ids=[p.name for p in GBNF_FILES])
def test_llama_cpp_gbnf_compiles(engine, model, pieces, eog, path, request):
    if path.name in GBNF_XFAIL:
        request.applymarker(pytest.mark.xfail(reason=GBNF_XFAIL[path.name], strict=True))
    g = engine.compile(path.read_text())
    assert g.format == "gbnf"
    m = g.new_matcher()
    out, _ = Walker(model, pieces, eog, seed=1).run(m, max_tokens=12, finish_after=12)
    assert m.error() is None and len(out) > 0


# Strings llama.cpp's own grammar engine accepts as complete (and prefixes that are not).
GBNF_SAMPLES = {
    "arithmetic.gbnf": (["1+2= 3\n", "(x1 *2)= y\n10/5= 2\n"], ["1+2= 3"]),
    "c.gbnf": (["int main(){return 0;}", "int f(int x){int y = x+1;return y;}float g(){}"],
               ["int main(){"]),
    "chess.gbnf": (["1. e4 e5\n2. Nf3 Nc6\n", "1. e4 e5\n2. O-O Qxd8+\n"], ["1. e4 e5\n"]),
    "english.gbnf": (["Hello, world!", "two\tlines\nhere"], []),
    "japanese.gbnf": (["こんにちは", "カタカナ 漢字"], []),
    "json.gbnf": (['{"a": [1, 2.5, "x"], "b": null}', "{}", '{\n  "k": true}'], ['{"a": ']),
    "json_arr.gbnf": (['[\n{"a": 1},\n2]', "[\n]"], ["[\n1"]),
    "list.gbnf": (["- milk\n- eggs\n"], ["- milk"]),
}


@pytest.mark.parametrize("name", sorted(GBNF_SAMPLES))
def test_llama_cpp_gbnf_language(engine, model, name):
    """The converted grammar accepts what llama.cpp accepts (token by token, as sampled)."""
    g = engine.compile((GRAMMARS_DIR / name).read_text())
    complete, partial = GBNF_SAMPLES[name]
    for text in complete + partial:
        m = g.new_matcher()
        assert m.consume_many(model.tokenize(text, False, False)), (text, m.error())
        assert m.is_accepting() == (text in complete), text


def test_gbnf_trailing_optional_ws_is_not_swallowed(engine, model):
    """Regression: `num ::= [0-9]+ ws` folded into one greedy lexeme ate the "\n" after it."""
    g = engine.compile(r'root ::= (num "\n")+' "\n" r"num ::= [0-9]+ ws" "\n" r"ws ::= [ \t\n]*")
    m = g.new_matcher()
    assert m.consume_many(model.tokenize("12 \n3\n", False, False)), m.error()
    assert m.is_accepting()


# ----------------------------------------------------------------------------- formats and errors


@pytest.mark.parametrize("text, fmt", [
    ('root ::= "a"', "gbnf"),
    ('  \n%llguidance {}\nstart: "a"', "lark"),
    ('%llguidance\nstart: "a"', "lark"),
    ('%json_schema {"type": "integer"}', "json_schema"),
    ('%json_schema\n{"type": "integer"}', "json_schema"),
    ('start: "a"', "gbnf"),  # Lark without the header is read as GBNF (and fails)
])
def test_detect_format(text, fmt):
    assert detect_format(text) == fmt


@pytest.mark.parametrize("text, fmt, good, bad", [
    ('root ::= "yes" | "no"', "gbnf", "yes", "maybe"),
    ('%llguidance {}\nstart: "yes" | "no"', "lark", "no", "maybe"),
    ('%llguidance\nstart: "yes" | "no"', "lark", "no", "maybe"),
    ('%json_schema {"type": "integer"}', "json_schema", "-42", "4.5"),
    ('%json_schema true', "json_schema", '{"a": [1, null]}', "{'a': 1}"),
])
def test_compile_formats(engine, model, text, fmt, good, bad):
    g = engine.compile(text)
    assert g.format == fmt
    m = g.new_matcher()
    assert m.consume_many(model.tokenize(good, False, False)), m.error()
    assert m.is_accepting()
    m = g.new_matcher()
    assert not m.consume_many(model.tokenize(bad, False, False))


@pytest.mark.parametrize("text, fmt, needle", [
    ('root ::= "a', "gbnf", "Unexpected end of input"),
    ('root ::= foo', "gbnf", "Rule 'foo' not found"),
    ('rot ::= "a"', "gbnf", "No 'root' rule"),
    ('root ::= [0-9', "gbnf", "GBNF"),
    ('start: "a"', "gbnf", "%llguidance {}"),
    ('', "gbnf", "empty"),
    ('%llguidance {}\nstart: foo', "lark", 'unknown name: "foo"'),
    ('%llguidance {}\nstart: /[a-/', "lark", "lark grammar"),
    ('%llguidance {]\nstart: "a"', "lark", "lark grammar"),
    ('%json_schema {bad', "json_schema", "invalid JSON"),
    ('%json_schema', "json_schema", "invalid JSON"),
    ('%json_schema [1, 2]', "json_schema", "JSON object"),
    ('%json_schema {"type": "objec"}', "json_schema", "objec"),
    ('%json_schema {"$ref": "#/$defs/missing"}', "json_schema", "missing"),
    ('%json_schema {"type": "integer", "minimum": 5, "maximum": 1}', "json_schema", "JSON schema"),
    ('%json_schema {"type": "array", "uniqueItems": true}', "json_schema", "uniqueItems"),
    ('%json_schema {"type": "string", "pattern": "(?=a)"}', "json_schema", "look-around"),
])
def test_invalid_grammars_raise(engine, text, fmt, needle):
    with pytest.raises(GrammarError) as ei:
        engine.compile(text)
    msg = str(ei.value)
    assert msg and needle in msg, msg
    assert ei.value.format == fmt


def test_not_a_string(engine):
    with pytest.raises(GrammarError):
        engine.compile(b'root ::= "a"')  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- matchers


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_json_tokens_accept_and_mask_forbids(engine, model, pieces):
    g = engine.compile("%json_schema " + json.dumps(PERSON))
    value = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}
    tokens = model.tokenize(json.dumps(value), False, False).tolist()
    m = g.new_matcher()
    x = int(model.tokenize("x", False, False)[0])
    space = int(model.tokenize(" ", False, False)[0])
    forbade = 0
    for i, t in enumerate(tokens):
        row = m.mask()
        assert bit(row, t), f"token {i} {pieces[t]!r} not allowed"
        if i == 0:
            assert not bit(row, x) and not bit(row, space)  # an object must start with '{'
            forbade += 1
        assert not m.is_accepting()
        assert m.consume(t), m.error()
    assert m.is_accepting() and m.error() is None
    assert m.n_consumed == len(tokens)
    row = m.mask()
    assert not bit(row, x)
    assert forbade


def test_rejected_token_sets_error(engine, model):
    m = engine.compile('%json_schema {"type": "integer"}').new_matcher()
    assert not m.consume(int(model.tokenize("x", False, False)[0]))
    err = m.error()
    assert err and "doesn't satisfy the grammar" in err and "<state>" not in err
    assert "<state>" in m.error(verbose=True)
    assert m.is_stopped()


def test_eog_bits_when_complete(engine, model, eog):
    g = engine.compile('%llguidance {}\nstart: "yes" | "no" | "yes!"')
    m = g.new_matcher()
    row = m.mask()
    assert not any(bit(row, t) for t in eog)
    assert m.consume(int(model.tokenize("yes", False, False)[0]))
    assert m.is_accepting() and not m.is_stopped()  # "yes!" may still follow
    row = m.mask()
    assert all(bit(row, t) for t in eog)
    bm = engine.allocate_bitmask(3)
    fill_masks([m, g.new_matcher()], bm, rows=[2, 0])
    assert all(bit(bm[2], t) for t in eog) and not any(bit(bm[0], t) for t in eog)
    assert not bm[1].any()
    for t in sorted(eog):  # every end-of-generation token ends the grammar
        mm = m.fork()
        assert mm.consume(t) and mm.is_stopped() and mm.error() is None


def test_eog_before_complete_is_rejected(engine, eog):
    m = engine.compile('root ::= "abc"').new_matcher()
    assert not m.consume(min(eog))
    assert m.error()


def test_stopped_matcher_allows_only_eog(engine, model, eog):
    m = engine.compile('root ::= "yes" | "no"').new_matcher()
    assert m.consume_many(model.tokenize("no", False, False))
    assert m.is_stopped() and m.is_accepting()
    assert set(allowed_ids(m.mask()).tolist()) == eog


def test_matchers_are_independent(engine, model):
    g = engine.compile('%json_schema {"type": "array", "items": {"type": "integer"}}')
    a, b = g.new_matcher(), g.new_matcher()
    ta = model.tokenize("[1, 2]", False, False).tolist()
    assert a.consume_many(ta) and a.is_accepting()
    assert not b.is_accepting() and b.n_consumed == 0
    open_bracket = ta[0]
    assert bit(b.mask(), open_bracket) and not bit(a.mask(), open_bracket)
    c = g.new_matcher()  # the template is untouched by a and b
    assert bit(c.mask(), open_bracket)
    assert not b.consume(int(model.tokenize("x", False, False)[0]))
    assert b.error() and a.error() is None and c.error() is None
    d = a.fork()
    assert d.rollback(1) and not d.is_accepting() and a.is_accepting()


def test_forced_tokens(engine, model):
    m = engine.compile('%json_schema ' + json.dumps(PERSON)).new_matcher()
    assert m.forced_bytes().startswith(b'{"name": "')
    ff = m.forced_tokens()
    assert ff and m.consume_many(ff)


# ----------------------------------------------------------------------------- batch masks


def test_fill_masks_serial_equals_parallel_and_single(engine, model, pieces, eog):
    grammars = [engine.compile("%json_schema " + json.dumps(PERSON)),
                engine.compile((GRAMMARS_DIR / "json.gbnf").read_text()),
                engine.compile('%llguidance {}\nstart: /[a-z]+/ ("," /[a-z]+/)*')]
    ms = [grammars[i % 3].new_matcher() for i in range(9)]
    rng = np.random.default_rng(3)
    for i, m in enumerate(ms):  # put them at different states
        for _ in range(i):
            ids = [t for t in allowed_ids(m.mask()).tolist() if t not in eog]
            if ids:
                m.consume(int(rng.choice(ids)))
    ser, par = engine.allocate_bitmask(9), engine.allocate_bitmask(9)
    engine.fill_masks(ms, ser, parallel=False)
    engine.fill_masks(ms, par, parallel=True)
    assert np.array_equal(ser, par)
    for i, m in enumerate(ms):
        assert np.array_equal(ser[i], m.mask())
    skip = engine.allocate_bitmask(9)
    skip[4] = 7
    fill_masks([m if i != 4 else None for i, m in enumerate(ms)], skip)
    assert (skip[4] == 7).all() and np.array_equal(skip[5], ser[5])


def test_fill_masks_checks_arguments(engine):
    m = engine.compile('root ::= "a"').new_matcher()
    with pytest.raises(ValueError):
        engine.fill_masks([m], np.zeros((1, engine.n_words), dtype=np.int64))
    with pytest.raises(ValueError):
        engine.fill_masks([m], np.zeros((1, engine.n_words - 1), dtype=np.int32))
    with pytest.raises(IndexError):
        engine.fill_masks([m], engine.allocate_bitmask(1), rows=[1])
    with pytest.raises(ValueError):
        m.fill_mask(np.zeros(engine.n_words, dtype=np.uint32))


def test_allowed_ids():
    row = np.zeros(4, dtype=np.int32)
    row[0] = 1 | (1 << 5)
    row[3] = np.int32(-2**31)  # bit 31 of word 3
    assert allowed_ids(row).tolist() == [0, 5, 127]
    assert allowed_ids(row, 100).tolist() == [0, 5]
    assert is_allowed(row, [0, 1, 5, 127, 126]).tolist() == [True, False, True, True, False]
    dense = np.full(4, -1, dtype=np.int32)
    dense[1] = 0
    assert allowed_ids(dense).tolist() == list(range(32)) + list(range(64, 128))


# ----------------------------------------------------------------------------- generation


SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                    "name": {"type": "string", "maxLength": 8}},
                     "required": ["id", "ok", "name"], "additionalProperties": False},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["user", "note"], "additionalProperties": False,
    },
    "enum": {"type": "object",
             "properties": {"color": {"enum": ["red", "green", "blue", 7, None]}},
             "required": ["color"], "additionalProperties": False},
    "array_min_max": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 2, "maxItems": 4},
    "integer_range": {"type": "integer", "minimum": -20, "maximum": 300},
    "string_pattern": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2,4}$"},
    # enforced through exact rewrites (clickpaca/grammar/schema_rewrite.py)
    "dependent_required": {"type": "object", "additionalProperties": False,
                           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "b": {"type": "boolean"}},
                           "dependentRequired": {"a": ["b"]}},
    "if_then_else": {"type": "object", "additionalProperties": False, "required": ["kind"],
                     "properties": {"kind": {"enum": ["x", "y"]},
                                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                    "s": {"type": "string", "maxLength": 4}},
                     "if": {"properties": {"kind": {"const": "x"}}}, "then": {"required": ["n"]},
                     "else": {"required": ["s"], "not": {"required": ["n"]}}},
}
REWRITTEN = ("dependent_required", "if_then_else")


@pytest.mark.parametrize("name", REWRITTEN)
def test_rewritten_schemas_compile_and_are_enforced(engine, name):
    g = engine.compile("%json_schema " + json.dumps(SCHEMAS[name]), strict=True)
    assert g.enforced and g.coverage_fields() == {"enforced": True, "ignored": []}
    assert not g.checks_outputs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_random_generation_validates(engine, model, pieces, eog, name):
    schema = SCHEMAS[name]
    g = engine.compile("%json_schema " + json.dumps(schema))
    for seed in range(4):
        out, ended = Walker(model, pieces, eog, seed).run(g.new_matcher(), max_tokens=150,
                                                          finish_after=30)
        assert ended, f"{name} seed {seed}: no end after 150 tokens: {out!r}"
        text = out.decode("utf-8")
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert not free_whitespace(text), text


def test_json_whitespace_cannot_loop(engine, model, pieces, eog):
    """Even a schema asking for flexible whitespace, sampled preferring whitespace tokens."""
    schema = {"type": "object",
              "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                             "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ \\n]+"}}
    g = engine.compile("%json_schema " + json.dumps(schema))
    options = json.loads(g.grammar)["grammars"][0]["json_schema"]["x-guidance"]
    assert options["whitespace_flexible"] is False and options["whitespace_pattern"] is None
    assert all(options[k] == v for k, v in JSON_OVERRIDES.items())
    for seed in range(3):
        out, ended = Walker(model, pieces, eog, seed).run(g.new_matcher(), max_tokens=60,
                                                          finish_after=25, prefer_whitespace=True)
        assert ended, out
        text = out.decode()
        jsonschema.validate(json.loads(text), schema)
        assert not free_whitespace(text), text


LARK_CASES = {
    "greeting": ('%llguidance {}\n'
                 'start: GREETING " " NAME "!"\n'
                 'GREETING: "hello" | "hi"\n'
                 'NAME: /[A-Z][a-z]{1,8}/\n',
                 r"(hello|hi) [A-Z][a-z]{1,8}!"),
    "kv_lines": ('%llguidance {}\n'
                 'start: line{1,3}\n'
                 'line: KEY "=" VALUE "\\n"\n'
                 'KEY: /[a-z_]{1,6}/\n'
                 'VALUE: /[0-9]{1,4}/ | "true" | "false"\n',
                 r"([a-z_]{1,6}=([0-9]{1,4}|true|false)\n){1,3}"),
    "sum": ('%llguidance {}\n'
            'start: expr\n'
            'expr: term (("+" | "-") term){0,3}\n'
            'term: NUM | "(" expr ")"\n'
            'NUM: /[1-9][0-9]{0,2}/\n',
            None),
}


@pytest.mark.parametrize("name", list(LARK_CASES))
def test_lark_random_generation_matches(engine, model, pieces, eog, name):
    text, pattern = LARK_CASES[name]
    g = engine.compile(text)
    assert g.format == "lark"
    for seed in range(4):
        out, ended = Walker(model, pieces, eog, seed).run(g.new_matcher(), max_tokens=80,
                                                          finish_after=20)
        s = out.decode("utf-8")
        if not ended:  # the walk ran out: at least a prefix of the language
            continue
        if pattern is not None:
            assert re.fullmatch(pattern, s), s
        else:
            assert re.fullmatch(r"[0-9+\-()]+", s) and s.count("(") == s.count(")"), s
            assert eval(s) is not None  # noqa: S307 - digits, + - and parentheses only


def test_gbnf_list_generation_matches(engine, model, pieces, eog):
    g = engine.compile((GRAMMARS_DIR / "list.gbnf").read_text())
    item = "- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n"
    for seed in range(3):
        out, ended = Walker(model, pieces, eog, seed).run(g.new_matcher(), max_tokens=40,
                                                          finish_after=10)
        s = out.decode("utf-8", "replace")
        if ended:
            assert re.fullmatch(f"({item})+", s), s
        else:
            assert s.startswith("- ") and "\n\n" not in s, s


# ----------------------------------------------------------------------------- measurements


# The same language written twice: words as separate lexemes joined by a parser rule,
# and each line as one lexeme. llguidance walks the token trie per lexeme; a token that
# crosses a lexeme boundary (" quick" = " " then WORD) sends the walk through the Earley
# parser, so the first spelling costs far more per mask (docs/GRAMMARS.md, "Costs").
WORD_LINES = {
    "words as lexemes": '%llguidance {}\nstart: line+\nline: WORD (" " WORD)* ".\\n"\n'
                        'WORD: /[A-Za-z]+/\n',
    "line as a lexeme": '%llguidance {}\nstart: LINE+\nLINE: /[A-Za-z]+( [A-Za-z]+)*\\.\\n/\n',
}
WORD_LINES_TEXT = ("The quick brown fox jumps over the lazy dog.\nAnd then there were many more "
                   "words in this line.\nAnother sentence follows here with extraordinary words.\n")


def test_lexeme_and_rule_spellings_of_word_lines_agree_and_report_mask_cost(engine, model, capsys):
    """Both spellings accept the same tokens, with the same masks at every step; prints
    the median mask time of each (no threshold: the machine is shared)."""
    toks = model.tokenize(WORD_LINES_TEXT, add_special=False, parse_special=False)
    matchers = {k: engine.compile(g).new_matcher() for k, g in WORD_LINES.items()}
    times: dict[str, list[float]] = {k: [] for k in WORD_LINES}
    bm = engine.allocate_bitmask(1)
    for tok in toks:
        masks = {}
        for k, m in matchers.items():
            t0 = time.perf_counter()
            engine.fill_masks([m], bm)
            times[k].append(time.perf_counter() - t0)
            masks[k] = bm[0].copy()
            assert m.consume(int(tok)), (k, tok)
        a, b = masks.values()
        assert np.array_equal(a, b)
    assert all(m.is_accepting() for m in matchers.values())
    with capsys.disabled():
        print("\nmask time per token, median us over the tokens of a 3-line text: " + ", ".join(
            f"{k} {np.median(v) * 1e6:.0f}" for k, v in times.items()))


def test_widen_forced_adds_the_shorter_spellings_the_matcher_accepts(engine, model):
    """`{"a": ` is forced: the mask allows only `{"`; widening adds `{` (accepted by the
    matcher, a prefix of the forced bytes) and nothing that spells anything else."""
    m = engine.compile('%json_schema {"type": "object", "properties": {"a": {"type": "integer"}}, '
                       '"required": ["a"]}').new_matcher()
    assert m.forced_bytes() == b'{"a": '
    row = m.mask()
    before = allowed_ids(row, model.n_vocab).tolist()
    wider = m.widen_forced(row)
    added = sorted(set(allowed_ids(wider, model.n_vocab).tolist()) - set(before))
    assert [model.token_to_piece(t) for t in before] == [b'{"']
    assert added and all(b'{"a": '.startswith(model.token_to_piece(t)) for t in added), added
    assert int(model.tokenize(b"{", add_special=False, parse_special=False)[0]) in added
    assert allowed_ids(row, model.n_vocab).tolist() == before  # the job's row is not touched
    for t in added:
        assert m.fork().consume(t)
    one = engine.compile('root ::= "7"').new_matcher()
    assert one.widen_forced(one.mask()) is None  # one byte: no shorter spelling


# ----------------------------------------------------------------------------- GBNF as llama.cpp


def accepts(model, compiled, text: str, tokens: tuple = ()) -> bool:
    m = compiled.new_matcher()
    ids = list(tokens) + model.tokenize(text, False, False).tolist() if text else list(tokens)
    return m.consume_many(ids) and m.is_accepting()


@pytest.mark.parametrize("gbnf, good, bad", [
    ("root ::= ( [x]* )*", ["", "x", "xx"], ["y", "xy"]),
    ('root ::= ("a"?)+', ["", "a", "aaaa"], ["b", "ab"]),
    ('root ::= ("a"+)?', ["", "a", "aaaa"], ["b"]),
    ('root ::= ("a"{2}){3}', ["aaaaaa"], ["aaaaa", "aaaaaaa", ""]),
    ('root ::= ([ab]+)+ "c"', ["ac", "abbac"], ["c", "ab", "abca"]),
    ('root ::= "a"{0,5000}', ["", "a" * 5001], ["b"]),  # llama.cpp: above 2000 = no maximum
])
def test_nested_quantifiers_behave_as_in_llama_cpp(engine, model, gbnf, good, bad):
    g = engine.compile(gbnf)
    assert all(accepts(model, g, s) for s in good)
    assert not any(accepts(model, g, s) for s in bad)


def test_token_references(engine, model):
    """<[id]>, !<[id]> and <text> (one token, special tokens parsed) as llama.cpp reads them."""
    sot, eot = (int(model.tokenize(t, False, True)[0]) for t in ("<start_of_turn>", "<end_of_turn>"))
    g = engine.compile(f"root ::= <start_of_turn> body <[{eot}]>\nbody ::= (!<[{eot}]>)*")
    m = g.new_matcher()
    assert m.consume_many([sot] + model.tokenize("user says hi", False, False).tolist() + [eot])
    assert m.is_stopped()
    m = g.new_matcher()
    assert not m.consume(eot)  # the first token must be <start_of_turn>
    with pytest.raises(GrammarError, match="not one"):
        engine.compile("root ::= <hello world>")


def test_gbnf_repetition_limit(engine):
    with pytest.raises(GrammarError, match="limit is 2000"):
        engine.compile('root ::= "a"{2001}')


def test_left_recursion_compiles(engine, model):
    """llama.cpp refuses left recursion; llguidance's Earley parser takes it (documented)."""
    g = engine.compile('root ::= expr\nexpr ::= expr "+" num | num\nnum ::= [0-9]')
    assert accepts(model, g, "1+2+3") and not accepts(model, g, "1+")


# ----------------------------------------------------------------------------- schema options


@pytest.mark.parametrize("schema, digits, good, bad", [
    ({"type": "integer"}, 16, ["0", "-7", "9" * 16, "1" + "0" * 16], ["1" * 17, "-" + "1" * 17]),
    ({"type": "integer"}, 3, ["999", "-999"], ["1000", "-1000"]),
    ({"type": "integer"}, None, ["9" * 40], ["1.5"]),
    ({"type": "number"}, 16, ["1.5", "9" * 16 + ".5", "0." + "3" * 10], ["1" * 17, "0." + "3" * 11, "1e5"]),
    ({"type": "number"}, None, ["0." + "3" * 30, "1e5"], []),
    ({"type": "integer", "minimum": 2}, 16, ["1234567890000000"], ["12345678900000000"]),
])
def test_json_numbers_bounded_by_default(engine, model, schema, digits, good, bad):
    g = engine.compile("%json_schema " + json.dumps(schema), number_digits=digits)
    assert all(accepts(model, g, s) for s in good), [s for s in good if not accepts(model, g, s)]
    assert not any(accepts(model, g, s) for s in bad), [s for s in bad if accepts(model, g, s)]


def test_bounded_and_unbounded_compilations_are_cached_apart(engine):
    text = '%json_schema {"type": "integer"}'
    assert engine.compile(text) is engine.compile(text, number_digits=16)
    assert engine.compile(text, number_digits=None) is not engine.compile(text)


def test_lenient_ignores_and_reports_unimplemented_keywords(engine, model):
    schema = {"type": "array", "uniqueItems": True, "maxItems": 3,
              "items": {"type": "integer", "minimum": 0, "maximum": 9, "if": {"minimum": 5},
                        "then": {"multipleOf": 2}}}
    text = "%json_schema " + json.dumps(schema)
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        engine.compile(text)
    g = engine.compile(text, lenient=True)
    assert [(i.path, i.keyword) for i in g.ignored] == [("#", "uniqueItems"), ("#/items", "if"),
                                                        ("#/items", "then")]
    assert not g.enforced and g.checks_outputs
    assert g.coverage_fields()["ignored"][0] == {"path": "#", "keyword": "uniqueItems",
                                                 "reason": "not implemented by llguidance"}
    assert accepts(model, g, "[7, 7]")  # uniqueItems and if/then are not enforced
    for lenient in (False, True):
        whole = engine.compile('%json_schema {"type": "integer"}', lenient=lenient)
        assert whole.ignored == [] and whole.enforced and not whole.checks_outputs
    assert engine.compile('%json_schema {"type": "integer"}', validate=True).checks_outputs
    assert engine.compile('root ::= "a"').coverage_fields() == {}


def test_unknown_formats_are_annotations_unless_strict(engine, model):
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "url", "maxLength": 8}},
              "required": ["u"], "additionalProperties": False}
    text = "%json_schema " + json.dumps(schema)
    g = engine.compile(text)
    assert [(i.path, i.keyword) for i in g.ignored] == [("#/properties/u", "format")]
    assert not g.enforced and g.checks_outputs
    assert accepts(model, g, '{"u": "no url"}') and not accepts(model, g, '{"u": "too long a text"}')
    with pytest.raises(GrammarError, match="^invalid JSON schema: Unknown format: url$"):
        engine.compile(text, strict=True)


def test_one_of_compiles_as_any_of_and_says_so_unless_strict(engine, model):
    overlapping = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                             {"type": "integer", "minimum": 5, "maximum": 20}]}
    disjoint = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}
    g = engine.compile("%json_schema " + json.dumps(overlapping))
    assert [(i.path, i.keyword) for i in g.ignored] == [("#", "oneOf")]
    assert accepts(model, g, "7")  # in both branches: oneOf says invalid, anyOf accepts it
    with pytest.raises(GrammarError, match="oneOf constraints are not supported"):
        engine.compile("%json_schema " + json.dumps(overlapping), strict=True)
    for strict in (False, True):  # proven disjoint: enforced exactly, even when strict
        assert engine.compile("%json_schema " + json.dumps(disjoint), strict=strict).enforced


# ----------------------------------------------------------------------------- repeated keys


def test_random_walks_never_repeat_a_key_and_batch_masks_carry_the_ban(engine, model, pieces, eog):
    """Keys a, b, c only (patternProperties): random walks either finish with distinct keys
    or stop where only repeated keys are left (the tracker says so); fill_masks over a
    batch bans exactly what each matcher's own mask bans."""
    schema = {"type": "object", "patternProperties": {"^[abc]$": {"type": "integer", "minimum": 0, "maximum": 9}},
              "additionalProperties": False}
    g = engine.compile("%json_schema " + json.dumps(schema))
    ended = stuck = acted = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        m, other, out = g.new_matcher(), None, b""
        for step in range(80):
            row = m.mask()
            if step == 6:  # a fork, and the batch path, mask alike
                other = m.fork()
                batch = engine.allocate_bitmask(2)
                engine.fill_masks([other, m], batch)
                assert np.array_equal(batch[0], row) and np.array_equal(batch[1], row)
            ids = allowed_ids(row, model.n_vocab)
            if not ids.size:
                assert m.keys.exhausted
                stuck += 1
                break
            ends = ids[np.isin(ids, list(eog))]
            if ends.size and (step > 30 or ends.size == ids.size):
                value = []
                json.loads(out, object_pairs_hook=lambda kv: value.append([k for k, _ in kv]) or dict(kv))
                assert all(len(set(k)) == len(k) for k in value), out
                ended += 1
                break
            t = int(rng.choice(ids[~np.isin(ids, list(eog))]))
            assert m.consume(t)
            out += pieces[t]
        acted += m.keys.acted
        assert m.keys.repeats == 0, out
    assert ended + stuck == 12 and acted >= 1
