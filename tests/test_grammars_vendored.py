"""llama.cpp's own grammar tests, run through our GrammarEngine.

The cases of test-grammar-integration.cpp (GBNF grammars and JSON schemas through
llama.cpp's grammar engine and schema converter), test-grammar-llguidance.cpp (Lark
grammars and `%json` schemas through llama.cpp's llguidance sampler) and
test-grammar-parser.cpp (grammars llama.cpp's parser refuses, and the rules it parses
others into) are read from the pinned source tree at test time (tests/vendored_cases.py)
and run against the real default model's vocabulary: a string matches when its tokens
(text tokenized by the model, `token(N)` parts as token N) are consumed and the grammar
may end there, as llama.cpp's tests decide it.

Every difference from llama.cpp's expectation is either a JSON layout our fixed separators
refuse (counted, checked to be only that) or a row of the table in docs/GRAMMARS.md,
"Against llama.cpp's own tests", with its reason; the test fails on any other difference
and on a documented one that no longer happens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from clickpaca.grammar.grammars import GrammarEngine, GrammarError
from clickpaca.llama.native import vendored_source
from vendored_cases import (
    ParserCase, StringCase, alphabet, count_calls, derive, elements_to_gbnf, iter_strings,
    parser_cases, string_cases, string_constants, suite_dir,
)

pytestmark = pytest.mark.model

SRC = vendored_source()
INTEGRATION = string_cases(SRC, "integration")
LLGUIDANCE = string_cases(SRC, "llguidance")
PARSER = parser_cases(SRC)
DOC = Path(__file__).resolve().parent.parent / "docs" / "GRAMMARS.md"


@pytest.fixture(scope="module")
def engine(model):
    eng = GrammarEngine.start(model)
    eng.wait()
    return eng


def show(parts: tuple) -> str:
    """A test string as the docs table writes it: text, with token(N) as <[N]>."""
    return "".join(p if isinstance(p, str) else f"<[{p}]>" for p in parts)


def tokens(model, parts: tuple) -> list[int]:
    out: list[int] = []
    for p in parts:
        if isinstance(p, int):
            out.append(p)
        elif p:
            out.extend(int(t) for t in model.tokenize(p.encode(), add_special=False,
                                                      parse_special=False))
    return out


def matches(model, compiled, parts: tuple) -> bool:
    """llama.cpp's test verdict: every token accepted and the grammar may end there."""
    m = compiled.new_matcher()
    return m.consume_many(tokens(model, parts)) and m.is_accepting()


def grammar_text(case: StringCase) -> str:
    """The text our engine compiles for a case, the same grammar llama.cpp's test builds."""
    if case.source == "integration":
        return case.text if case.kind == "grammar" else "%json_schema " + case.text
    if case.kind == "grammar":  # llama_sampler_init_llg(vocab, "lark", text)
        return "%llguidance {}\n" + case.text
    return "%llguidance {}\nstart: %json " + case.text


def relayout(s: str) -> str:
    """A JSON text in our fixed layout (json.dumps: ", " and ": ", no other whitespace)."""
    out, in_str, esc = [], False, False
    for c in s:
        if in_str:
            out.append(c)
            esc = not esc and c == "\\"
            in_str = esc or c != '"'
        elif c == '"':
            in_str = True
            out.append(c)
        elif c in " \t\r\n":
            continue
        else:
            out.append(c + (" " if c in ",:" else ""))
    return "".join(out)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Difference:
    suite: str    # integration | llguidance | parser
    case: str     # the case's description, or its grammar for parser cases
    string: str   # show(parts), or "" for the grammar itself
    expected: str
    ours: str


def documented() -> dict[Difference, str]:
    """The rows of docs/GRAMMARS.md's differences table -> their reasons."""
    text = DOC.read_text()
    start = text.index("## Against llama.cpp's own tests")
    end = text.find("\n## ", start + 1)
    rows: dict[Difference, str] = {}
    for line in text[start:end if end > 0 else None].splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 6 or cells[0] not in ("integration", "llguidance", "parser"):
            continue
        suite, case, string, expected, ours, reason = (c.replace("\\|", "|") for c in cells)
        rows[Difference(suite, _unquote(case), _unquote(string), expected, ours)] = reason
    return rows


def _unquote(cell: str) -> str:
    """`"..."` (a JSON string in backticks) -> its text; `-` -> ""."""
    import json

    if cell == "-":
        return ""
    return json.loads(cell.strip("`"))


def one_line(grammar: str) -> str:
    """A grammar as a table cell names it: its whitespace runs as single spaces."""
    return " ".join(grammar.split())


def verdict(ok: bool) -> str:
    return "match" if ok else "no match"


def string_differences(engine, model, cases: list[StringCase]) -> tuple[set[Difference], int]:
    """(differences, how many of them are only a layout our fixed JSON separators refuse)."""
    found: set[Difference] = set()
    layout = 0
    for case in cases:
        try:
            compiled = engine.compile(grammar_text(case))
        except GrammarError as e:
            found.add(Difference(case.source, case.desc, "", "compiles", "refused"))
            print(case.id, e)
            continue
        for parts, expected in iter_strings(case):
            got = matches(model, compiled, parts)
            if got == expected:
                continue
            s = show(parts)
            if (expected and case.kind == "schema" and case.source == "integration"
                    and relayout(s) != s and matches(model, compiled, (relayout(s),))):
                layout += 1
                continue
            found.add(Difference(case.source, case.desc, s, verdict(expected), verdict(got)))
    return found, layout


# ----------------------------------------------------------------------------- reading


def test_every_case_is_read():
    """The reader found every call the files make (an independent line-by-line count)."""
    for name, cases in (("integration", INTEGRATION), ("llguidance", LLGUIDANCE)):
        n = count_calls(SRC, f"test-grammar-{name}.cpp", {"test_grammar", "test_schema"})
        assert len(cases) == n and n >= 40, (name, len(cases), n)
        assert all(c.passing or c.failing for c in cases)
    n = count_calls(SRC, "test-grammar-parser.cpp", {"verify_failure", "verify_parsing"})
    assert len(PARSER) == n and n >= 20
    assert sum(c.kind == "failure" for c in PARSER) >= 6


def test_documented_rows_are_read():
    rows = documented()
    assert rows and all(reason for reason in rows.values())


# ----------------------------------------------------------------------------- the suites


@pytest.mark.parametrize("suite", ["integration", "llguidance"])
def test_string_cases_agree_with_llama_cpp_or_are_documented(engine, model, suite, capsys):
    cases = INTEGRATION if suite == "integration" else LLGUIDANCE
    found, layout = string_differences(engine, model, cases)
    rows = {d for d in documented() if d.suite == suite and not d.case.startswith("test_")}
    n = sum(len(c.passing) + len(c.failing) for c in cases)
    with capsys.disabled():
        print(f"\n{suite}: {len(cases)} grammars, {n} strings; {len(found)} documented "
              f"differences, {layout} JSON layouts our fixed separators refuse")
    assert found - rows == set(), "undocumented differences (add them to docs/GRAMMARS.md)"
    assert rows - found == set(), "documented differences that no longer happen"
    if suite == "integration":
        assert layout > 0  # the schemas' tests do use other layouts: the check is live


def test_integration_failure_functions(engine, model):
    """The grammars test-grammar-integration.cpp builds outside test_grammar/test_schema."""
    consts = string_constants((suite_dir(SRC) / "test-grammar-integration.cpp").read_text())
    text = {fn: ["".join(v) for _, v in items] for fn, items in consts.items()}
    for g in text["test_failure_missing_root"] + text["test_failure_missing_reference"]:
        with pytest.raises(GrammarError):
            engine.compile(g)
    # llama.cpp refuses left recursion; llguidance's Earley parser takes it (documented).
    left = text["test_failure_left_recursion"]
    assert len(left) == 4
    assert Difference("integration", "test_failure_left_recursion", "", "refused",
                      "compiles") in documented()
    for g in left:
        engine.compile(g)
    simple = engine.compile(left[0])  # root ::= "a" | root "a"
    assert matches(model, simple, ("aaa",)) and not matches(model, simple, ("",))
    # A root named other than "root": we have no such option; "root" is required.
    (foobar,) = text["test_custom_root_symbol_check"]
    with pytest.raises(GrammarError):
        engine.compile(foobar)
    (root,) = text["test_failure_missing_root_symbol"]
    assert matches(model, engine.compile(root), ("foobar",))


def test_documented_parser_rows_name_refused_cases():
    refused = {one_line(c.text) for c in PARSER if c.kind == "failure"}
    rows = [d for d in documented() if d.suite == "parser"]
    assert all(d.case in refused and d.expected == "refused" for d in rows), rows


def test_llguidance_sampler_chain_case(engine, model):
    """test_sampler_chain: the grammar allows each token of its input, then the end."""
    consts = dict(string_constants((suite_dir(SRC) / "test-grammar-llguidance.cpp").read_text())
                  ["test_sampler_chain"])
    g = engine.compile("".join(consts["grammar_data"]))
    assert g.format == "lark"
    assert matches(model, g, consts["input"])
    assert not matches(model, g, consts["input"] + ("x",))


@pytest.mark.parametrize("case", [c for c in PARSER if c.kind == "failure"],
                         ids=lambda c: repr(c.text.strip()))
def test_parser_refusals(engine, case: ParserCase):
    row = Difference("parser", one_line(case.text), "", "refused", "compiles")
    if row in documented():
        engine.compile(case.text)  # documented: we accept it
        return
    with pytest.raises(GrammarError):
        engine.compile(case.text)


def _strings(alpha: list, n: int) -> list[tuple]:
    out = [()]
    frontier = [()]
    for _ in range(n):
        frontier = [f + (a,) for f in frontier for a in alpha]
        out += frontier
    return [tuple(_merge(s)) for s in out]


def _merge(s: tuple) -> list:
    out: list = []
    for x in s:
        if isinstance(x, str) and out and isinstance(out[-1], str):
            out[-1] += x
        else:
            out.append(x)
    return out


@pytest.mark.parametrize("case", [c for c in PARSER if c.kind == "parsing"],
                         ids=lambda c: repr(c.text.strip()))
def test_parser_rules_mean_the_same(engine, model, case: ParserCase):
    """Our grammar and the rules llama.cpp parsed it into (the case's expected elements,
    written back as GBNF) accept the same strings: every string of up to 3 symbols over
    the characters and tokens they name, and 40 random sentences of llama.cpp's rules."""
    ours = engine.compile(case.text)
    theirs = engine.compile(elements_to_gbnf(case))
    alpha = alphabet(case)
    probe = _strings(alpha, 3 if len(alpha) <= 10 else 2)
    rng = np.random.default_rng(0)
    sentences = [derive(case, rng) for _ in range(40)]
    for parts in probe + sentences:
        assert matches(model, ours, parts) == matches(model, theirs, parts), show(parts)
    assert all(matches(model, ours, s) for s in sentences)


def test_schemas_refused_for_unimplemented_keywords_agree_when_lenient(engine, model):
    """A schema we refuse by default (llguidance does not implement a keyword it uses)
    compiles with lenient, and then every string agrees (our JSON layout aside)."""
    refused = [c for c in INTEGRATION if c.kind == "schema" and Difference(
        "integration", c.desc, "", "compiles", "refused") in documented()]
    assert refused
    for case in refused:
        g = engine.compile(grammar_text(case), lenient=True)
        assert g.ignored, case.desc
        for parts, expected in iter_strings(case):
            s = show(parts)
            got = matches(model, g, parts)
            assert got == expected or (expected and matches(model, g, (relayout(s),))), s
