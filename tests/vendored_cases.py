"""llama.cpp's grammar test cases, read from the vendored C++ test sources at test time.

tests/test_grammars_vendored.py runs the cases of test-grammar-integration.cpp,
test-grammar-llguidance.cpp and test-grammar-parser.cpp (in the pinned source tree,
`clickpaca.llama.native.vendored_source()`) through our GrammarEngine; their text is read here,
never copied. A small C++ lexer (string literals, raw strings, char literals, comments)
and a reader for the few expression forms the files use: concatenations of string
literals and `token(N)` calls, brace lists, integers and identifiers. Anything else
raises, so a changed test file fails loudly instead of losing cases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

# A test string: its parts in order, text (str) or a token id (int, from `token(N)`).
Parts = tuple  # tuple[str | int, ...]


@dataclass
class Tok:
    kind: str   # "str" | "char" | "ident" | "int" | "punct"
    value: Any
    line: int


_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'",
                   "a": "\a", "b": "\b", "f": "\f", "v": "\v", "?": "?"}


def _unescape(body: str, line: int) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1]
        if e == "x":
            m = re.match(r"[0-9a-fA-F]+", body[i + 2:])
            out.append(chr(int(m.group(), 16)))
            i += 2 + len(m.group())
        elif e in "uU":
            n = 4 if e == "u" else 8
            out.append(chr(int(body[i + 2:i + 2 + n], 16)))
            i += 2 + n
        elif e in "01234567" and body[i + 1:i + 3].isdigit():
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            out.append(chr(int(m.group(), 8)))
            i += 1 + len(m.group())
        elif e in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[e])
            i += 2
        else:
            raise ValueError(f"line {line}: unknown escape \\{e}")
    return "".join(out)


_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*.*?\*/)
  | (?P<raw>R"(?P<delim>[^(\s]*)\()
  | (?P<str>"(?:\\.|[^"\\\n])*")
  | (?P<char>'(?:\\.|[^'\\\n])+')
  | (?P<ident>[A-Za-z_][A-Za-z_0-9]*(?:::[A-Za-z_][A-Za-z_0-9]*)*)
  | (?P<int>[0-9]+[uUlL]*)
  | (?P<punct>[{}()\[\],;+=<>&*:.!\-/|?#~%^])
""", re.S | re.X)


def lex(text: str) -> list[Tok]:
    """C++ source -> tokens (comments and whitespace dropped; preprocessor lines too)."""
    out: list[Tok] = []
    pos, line = 0, 1
    while pos < len(text):
        if text.startswith("#", pos) and (pos == 0 or text[pos - 1] == "\n"):
            end = text.find("\n", pos)  # a preprocessor line
            pos = len(text) if end < 0 else end
            continue
        m = _TOKEN_RE.match(text, pos)
        if not m:
            raise ValueError(f"line {line}: cannot read {text[pos:pos + 20]!r}")
        kind = m.lastgroup if m.lastgroup != "delim" else "raw"
        if m.group("raw") is not None:
            close = ")" + m.group("delim") + '"'
            end = text.index(close, m.end())
            out.append(Tok("str", text[m.end():end], line))
            line += text.count("\n", pos, end + len(close))
            pos = end + len(close)
            continue
        s = m.group()
        if kind == "str":
            out.append(Tok("str", _unescape(s[1:-1], line), line))
        elif kind == "char":
            out.append(Tok("char", _unescape(s[1:-1], line), line))
        elif kind == "ident":
            out.append(Tok("ident", s, line))
        elif kind == "int":
            out.append(Tok("int", int(s.rstrip("uUlL")), line))
        elif kind == "punct":
            out.append(Tok("punct", s, line))
        line += s.count("\n")
        pos = m.end()
    return out


class _Reader:
    """Reads the expression forms of the test files from a token list."""

    def __init__(self, toks: list[Tok], i: int) -> None:
        self.toks, self.i = toks, i

    def peek(self, k: int = 0) -> Tok:
        return self.toks[self.i + k]

    def take(self, value: str | None = None) -> Tok:
        t = self.toks[self.i]
        if value is not None and t.value != value:
            raise ValueError(f"line {t.line}: expected {value!r}, got {t.value!r}")
        self.i += 1
        return t

    def value(self) -> Any:
        """A string expression (-> Parts), a brace list (-> list), an int or an identifier."""
        t = self.peek()
        if t.kind == "punct" and t.value == "{":
            self.take("{")
            items = []
            while self.peek().value != "}":
                items.append(self.value())
                if self.peek().value == ",":
                    self.take(",")
            self.take("}")
            return items
        if t.kind in ("str", "ident") and (t.kind == "str" or t.value == "token"):
            return self._string_expr()
        if t.kind == "char":
            self.take()
            return ("char", t.value)
        if t.kind == "int":
            self.take()
            return t.value
        if t.kind == "ident":
            self.take()
            return ("ident", t.value)
        raise ValueError(f"line {t.line}: unexpected {t.value!r}")

    def _string_expr(self) -> Parts:
        parts: list = []
        while True:
            t = self.peek()
            if t.kind == "str":
                while self.peek().kind == "str":  # adjacent literals concatenate
                    s = self.take().value
                    if parts and isinstance(parts[-1], str):
                        parts[-1] += s
                    else:
                        parts.append(s)
            elif t.kind == "ident" and t.value == "token":
                self.take()
                self.take("(")
                parts.append(int(self.take().value))
                self.take(")")
            else:
                raise ValueError(f"line {t.line}: expected a string or token(N), got {t.value!r}")
            if self.peek().value != "+":
                return tuple(parts)
            self.take("+")


@dataclass
class Call:
    """One call of a test helper: its function, the enclosing function and its arguments."""

    name: str
    within: str
    args: list
    line: int


def _enclosing(toks: list[Tok]) -> list[str]:
    """For every token, the name of the top-level function whose body holds it ('' outside)."""
    names, depth, current, pending = [], 0, "", ""
    for k, t in enumerate(toks):
        if depth == 0 and t.kind == "ident" and k + 1 < len(toks) and toks[k + 1].value == "(":
            pending = t.value
        if t.value == "{" and t.kind == "punct":
            if depth == 0:
                current = pending
            depth += 1
        elif t.value == "}" and t.kind == "punct":
            depth -= 1
            if depth == 0:
                names.append(current)
                current = ""
                continue
        names.append(current)
    return names


def calls(text: str, names: set[str]) -> list[Call]:
    """Every call (not the definition) of the named functions, arguments read."""
    toks = lex(text)
    within = _enclosing(toks)
    out = []
    for k, t in enumerate(toks):
        if t.kind != "ident" or t.value not in names or toks[k + 1].value != "(":
            continue
        if k and toks[k - 1].kind == "ident":  # `static void test(...)`: a definition
            continue
        r = _Reader(toks, k + 2)
        args = []
        while r.peek().value != ")":
            args.append(r.value())
            if r.peek().value == ",":
                r.take(",")
        out.append(Call(t.value, within[k], args, t.line))
    return out


def string_constants(text: str) -> dict[str, list[tuple[str, Parts]]]:
    """`[const] std::string|auto NAME = <string expr>;` per enclosing test_* function:
    [(NAME, value)]."""
    toks = lex(text)
    within = _enclosing(toks)
    out: dict[str, list[tuple[str, Parts]]] = {}
    for k in range(len(toks) - 3):
        b, c, d = toks[k:k + 3]
        if (b.value in ("std::string", "auto") and c.kind == "ident" and d.value == "="
                and within[k].startswith("test_") and toks[k + 3].kind == "str"):
            value = _Reader(toks, k + 3).value()
            out.setdefault(within[k], []).append((c.value, value))
    return out


# ---------------------------------------------------------------------------- the cases


@dataclass
class StringCase:
    """A grammar (GBNF or Lark) or JSON schema with strings it must and must not match."""

    source: str           # "integration" | "llguidance"
    kind: str             # "grammar" | "schema"
    desc: str
    text: str
    passing: list[Parts]
    failing: list[Parts]
    line: int

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}:{self.kind}:{self.desc or '-'}"


@dataclass
class ParserCase:
    """test-grammar-parser.cpp: a grammar llama.cpp refuses, or one with its parsed rules."""

    kind: str                       # "failure" | "parsing"
    text: str
    line: int
    symbols: dict[int, str] = field(default_factory=dict)
    elements: list[tuple[str, Any]] = field(default_factory=list)


def suite_dir(src: Path) -> Path:
    return src / "tests"


def string_cases(src: Path, source: str) -> list[StringCase]:
    """The test_grammar / test_schema calls of test-grammar-<source>.cpp."""
    text = (suite_dir(src) / f"test-grammar-{source}.cpp").read_text()
    out = []
    for c in calls(text, {"test_grammar", "test_schema"}):
        desc, grammar, passing, failing = c.args
        out.append(StringCase(source, c.name.removeprefix("test_"), "".join(desc), _text(grammar),
                              list(passing), list(failing), c.line))
    return out


def _text(parts: Parts) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise ValueError(f"a grammar with token(N) parts: {parts!r}")
    return "".join(parts)


def parser_cases(src: Path) -> list[ParserCase]:
    """The verify_failure / verify_parsing calls of test-grammar-parser.cpp."""
    text = (suite_dir(src) / "test-grammar-parser.cpp").read_text()
    out = []
    for c in calls(text, {"verify_failure", "verify_parsing"}):
        if c.name == "verify_failure":
            out.append(ParserCase("failure", _text(c.args[0]), c.line))
            continue
        grammar, symbols, elements = c.args
        names = {int(num): _text(name) for name, num in symbols}
        elems = []
        for kind, value in elements:
            elems.append((kind[1], value[1] if isinstance(value, tuple) else value))
        out.append(ParserCase("parsing", _text(grammar), c.line, names, elems))
    return out


def count_calls(src: Path, file: str, names: set[str]) -> int:
    """Calls of the named functions counted line by line with a regex, independently of the
    lexer (lines commented out with //, definitions `void name(` and the fprintf lines
    that print a call as text excluded): how many
    cases `calls` must find."""
    pattern = re.compile(r"(?<![A-Za-z_0-9])(?<!void )(" + "|".join(sorted(names)) + r")\s*\(")
    return sum(len(pattern.findall(line))
               for line in (suite_dir(src) / file).read_text().splitlines()
               if not line.lstrip().startswith("//") and "fprintf" not in line)


def iter_strings(case: StringCase) -> Iterator[tuple[Parts, bool]]:
    for p in case.passing:
        yield p, True
    for f in case.failing:
        yield f, False


# ---------------------------------------------------------------------------- parsed rules


def _split_rules(case: ParserCase) -> list[list[list[tuple[str, Any]]]]:
    """The expected element list -> rules (in id order) -> alternatives -> items."""
    rules, alts, items = [], [], []
    for kind, value in case.elements:
        name = kind.removeprefix("LLAMA_GRETYPE_")
        if name == "END":
            alts.append(items)
            rules.append(alts)
            alts, items = [], []
        elif name == "ALT":
            alts.append(items)
            items = []
        else:
            items.append((name, value))
    return rules


def _groups(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Items with character ranges gathered: ("class", (negated, [(lo, hi), ...])) for a
    CHAR/CHAR_NOT followed by CHAR_ALT / CHAR_RNG_UPPER, ("lit", c) for a lone CHAR."""
    out: list[tuple[str, Any]] = []
    for name, value in items:
        if name in ("CHAR", "CHAR_NOT"):
            out.append(("class", (name == "CHAR_NOT", [(value, value)])))
        elif name == "CHAR_ALT":
            out[-1][1][1].append((value, value))
        elif name == "CHAR_RNG_UPPER":
            ranges = out[-1][1][1]
            ranges[-1] = (ranges[-1][0], value)
        else:
            out.append((name, value))
    return [("lit", v[1][0][0]) if k == "class" and not v[0] and v[1] == [(v[1][0][0],) * 2]
            else (k, v) for k, v in out]


def _esc(c: str) -> str:
    return c if c.isalnum() else f"\\x{ord(c):02x}"


def elements_to_gbnf(case: ParserCase) -> str:
    """llama.cpp's parsed rules (the expected elements of a verify_parsing case) as GBNF
    text: the grammar llama.cpp understood, to compare languages with ours."""
    lines = []
    for rid, alts in enumerate(_split_rules(case)):
        rendered = []
        for items in alts:
            out = []
            for kind, value in _groups(items):
                if kind == "lit":
                    out.append(f'"{_esc(value)}"')
                elif kind == "class":
                    neg, ranges = value
                    body = "".join(_esc(a) if a == b else f"{_esc(a)}-{_esc(b)}" for a, b in ranges)
                    out.append(f"[{'^' if neg else ''}{body}]")
                elif kind == "CHAR_ANY":
                    out.append(".")
                elif kind == "RULE_REF":
                    out.append(case.symbols[value])
                elif kind == "TOKEN":
                    out.append(f"<[{value}]>")
                elif kind == "TOKEN_NOT":
                    out.append(f"!<[{value}]>")
                else:
                    raise ValueError(f"element {kind} not handled")
            rendered.append(" ".join(out) if out else '""')
        lines.append(f"{case.symbols[rid]} ::= " + " | ".join(rendered))
    return "\n".join(lines) + "\n"


def alphabet(case: ParserCase) -> list[str | int]:
    """The characters (range ends) and tokens the parsed rules name, plus one they do not."""
    chars: set = set()
    for kind, value in case.elements:
        if kind.endswith(("CHAR", "CHAR_NOT", "CHAR_ALT", "CHAR_RNG_UPPER")):
            chars.add(value)
        elif kind.endswith(("TOKEN", "TOKEN_NOT")):
            chars.add(int(value))
    outsider: list = ["~"] if not any(isinstance(c, int) for c in chars) else [5]
    return sorted(chars, key=str) + outsider


def derive(case: ParserCase, rng, max_depth: int = 10) -> Parts:
    """A random sentence of llama.cpp's parsed rules (short alternatives once deep)."""
    rules = _split_rules(case)
    out: list = []

    def emit(x) -> None:
        if isinstance(x, str) and out and isinstance(out[-1], str):
            out[-1] += x
        else:
            out.append(x)

    def walk(rid: int, depth: int) -> None:
        alts = rules[rid]
        if depth > max_depth:
            alts = [min(alts, key=lambda a: sum(k == "RULE_REF" for k, _ in a))]
        for kind, value in _groups(alts[int(rng.integers(len(alts)))]):
            if kind == "lit":
                emit(value)
            elif kind == "class":
                neg, ranges = value
                if neg:
                    pool = [chr(c) for c in range(0x21, 0x7f)
                            if not any(a <= chr(c) <= b for a, b in ranges)]
                else:
                    pool = [chr(c) for a, b in ranges for c in range(ord(a), ord(b) + 1)]
                emit(pool[int(rng.integers(len(pool)))])
            elif kind == "CHAR_ANY":
                emit("z")
            elif kind == "RULE_REF":
                walk(value, depth + 1)
            elif kind == "TOKEN":
                emit(int(value))
            elif kind == "TOKEN_NOT":
                emit(int(value) + 1)

    walk(0, 0)
    return tuple(out)
