"""clickpaca.grammar.gbnf: GBNF -> Lark text (no model: what the converter writes and refuses).
How the converted grammars behave on the real vocabulary is tested in test_grammars.py
and against llama.cpp's own tests in test_grammars_vendored.py."""

from __future__ import annotations

import pytest

from clickpaca.grammar.gbnf import MAX_REPETITION, GbnfError, gbnf_to_lark


def body(gbnf: str, **kw) -> str:
    out = gbnf_to_lark(gbnf, **kw)
    assert out.startswith("%llguidance {}\n")
    return out.removeprefix("%llguidance {}\n").strip()


@pytest.mark.parametrize("gbnf, lark", [
    ("root ::= ( [x]* )*", "start: (/[x]/*)*"),
    ('root ::= ("a"?)+', 'start: ("a"?)+'),
    ('root ::= ("a"+)?', 'start: ("a"+)?'),
    ('root ::= ("a"{2}){3}', 'start: ("a"{2,2}){3,3}'),
    ('root ::= ([ab]+)+ "c"', 'start: (/[ab]/+)+ "c"'),
    ('root ::= "a"*', 'start: "a"*'),  # a single repetition stays unbracketed
])
def test_nested_quantifiers_keep_their_group(gbnf, lark):
    assert body(gbnf) == lark


def test_token_references():
    assert body("root ::= <[10]> content <[11]>\ncontent ::= (!<[11]>)*") == (
        "start: <[10]> content <[11]>\n\ncontent: <[^11]>*")
    assert body("root ::= <[1000]> !<[1001]> <[1001]>") == "start: <[1000]> <[^1001]> <[1001]>"


def test_token_reference_by_text_uses_the_tokenizer():
    seen = []

    def tokenize(text):
        seen.append(text)
        return {"<think>": [42]}.get(text, [1, 2])

    assert body("root ::= <think> !<think>", tokenize=tokenize) == "start: <[42]> <[^42]>"
    assert seen == ["<think>", "<think>"]
    with pytest.raises(GbnfError, match="2 tokens, not one"):
        gbnf_to_lark("root ::= <two>", tokenize)
    with pytest.raises(GbnfError, match="no vocabulary"):
        gbnf_to_lark("root ::= <think>")


def test_token_reference_inside_literals_and_classes_is_text():
    assert body('root ::= "<[10]>" [<!]') == 'start: "<[10]>" /[<!]/'


@pytest.mark.parametrize("gbnf, needle", [
    ("root ::= <[1x]>", "decimal id"),
    ("root ::= <[10]", "Expected '>'"),
    ("root ::= !x", "Expected '<' after '!'"),
    ('<[1]> ::= "a"\nroot ::= "b"', "cannot name a rule"),
    (f'root ::= "a"{{{MAX_REPETITION + 1}}}', "limit is 2000"),
    (f'root ::= "a"{{{MAX_REPETITION + 1},}}', "limit is 2000"),
    ('root ::= "a"{,}', "Expected integer"),
])
def test_refused(gbnf, needle):
    with pytest.raises(Exception, match=needle):
        gbnf_to_lark(gbnf)


def test_repetition_bounds_as_llama_cpp():
    """A maximum above 2000 is no maximum (llama.cpp's parser), a minimum up to 2000 stays."""
    assert body('root ::= "a"{0,5000}') == 'start: "a"*'
    assert body('root ::= "a"{3,5000}') == 'start: "a"{3,}'
    assert body(f'root ::= "a"{{{MAX_REPETITION}}}') == f'start: "a"{{{MAX_REPETITION},{MAX_REPETITION}}}'


def test_rule_limit():
    text = "\n".join(f'r{i} ::= "x"' for i in range(5)) + "\nroot ::= r0"
    assert gbnf_to_lark(text, max_rules=6)
    with pytest.raises(GbnfError, match="6 rules, the limit is 5"):
        gbnf_to_lark(text, max_rules=5)


def test_trailing_optional_whitespace_is_its_own_rule():
    """`num ::= [0-9]+ ws`: the digits become a lexeme of their own, ws stays a parser rule."""
    out = body('root ::= (num "\\n")+\nnum ::= [0-9]+ ws\nws ::= [ \\t\\n]*')
    assert "num: NUM_LEXEME_0 ws" in out and "ws: /[ \\t\\n]/*" in out, out
