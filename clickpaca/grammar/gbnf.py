"""GBNF (llama.cpp's grammar syntax) -> llguidance's Lark dialect, meaning what llama.cpp means.

We use llguidance's GBNF parser and AST (`llguidance.gbnf_to_lark`) and correct what it gets
wrong against llama.cpp's own grammar engine (tests/test_grammars_vendored.py runs llama.cpp's
test-grammar-*.cpp through ours): nested quantifiers print as groups (`(/[x]/*)*`); token
references `<[10]>`, `!<[11]>` and `<text>` are parsed here; repetition bounds follow
llama.cpp's MAX_REPETITION_THRESHOLD (a minimum above 2000 is refused, a maximum above 2000
means none); a token rule ending in optional whitespace is not folded into one greedy lexeme
with it (which would swallow a newline literal after it). Left recursion compiles (llguidance's
Earley parser), where llama.cpp refuses it: deliberate (docs/GRAMMARS.md, "GBNF").
"""

from __future__ import annotations

from typing import Any, Callable

from llguidance import gbnf_to_lark as g2l

__all__ = ["GbnfError", "gbnf_to_lark", "MAX_REPETITION"]

#: llama.cpp's MAX_REPETITION_THRESHOLD (src/llama-grammar.cpp): larger minimums are refused,
#: larger maximums mean "no maximum".
MAX_REPETITION = 2000


class GbnfError(ValueError):
    """Bad GBNF, with the position where that shows (llguidance's converter raises plain
    Exceptions for the rest; grammars/grammar_engine.py reports both the same way)."""


# ---------------------------------------------------------------------------- AST nodes


class _Repetition(g2l.RepetitionNode):
    """A repetition that is bracketed when quantified again (`(x*)*`, not `x**`)."""

    def is_atomic(self) -> bool:
        return False


class _TokenRef(g2l.ASTNode):
    """One token by id (`<[10]>`), or any one token but that id (`<[^10]>`)."""

    def __init__(self, token: int, negated: bool) -> None:
        self.token, self.negated = token, negated

    def __str__(self) -> str:
        return f"<[{'^' if self.negated else ''}{self.token}]>"

    def is_terminal(self) -> bool:
        return False  # a token is matched by id, never inside a lexeme's bytes

    def __repr__(self) -> str:
        return f"_TokenRef({self.token}, negated={self.negated})"


class _BoundaryRef(g2l.RuleRefNode):
    """A rule reference that is never folded into the lexeme before it."""

    def is_terminal(self) -> bool:
        return False


class _CharLevelAlternatives(g2l.AlternativeNode):
    """A rule body kept at the parser level (one lexeme per character class or literal)."""

    def is_terminal(self) -> bool:
        return False

    def simplify(self) -> "_CharLevelAlternatives":
        self.alternatives = [a.simplify() for a in self.alternatives]
        return self


# ---------------------------------------------------------------------------- parser

# Token references reach the AST as rule references under names no GBNF rule can have.
_TOKEN_MARK = "<"


class _Parser(g2l.GrammarParser):
    """llguidance's GBNF parser, which also reads token references where an item may stand."""

    @staticmethod
    def _is_word_char(c: str) -> bool:
        return g2l.GrammarParser._is_word_char(c) or (c != "" and c in "<!")

    @staticmethod
    def _parse_name(pos: g2l.Position) -> tuple[str, g2l.Position]:
        if pos.current() not in ("<", "!"):
            return g2l.GrammarParser._parse_name(pos)
        start = pos
        if pos.current() == "!":
            pos = pos.advance()
            if pos.current() != "<":
                raise g2l.GbnfToLarkError(pos, "Expected '<' after '!'")
        end = pos.text.find(">", pos.pos + 1)
        if end < 0:
            raise g2l.GbnfToLarkError(pos, "Expected '>' closing the token reference")
        return _TOKEN_MARK + pos.text[start.pos:end + 1], pos.advance(end + 1 - pos.pos)


def _token_ref(ref: str, tokenize: Callable[[str], list[int]] | None) -> _TokenRef:
    """`!<[11]>` / `<[10]>` / `<text>` (after the mark) -> a _TokenRef."""
    negated = ref.startswith("!")
    body = ref[1:] if negated else ref  # "<...>"
    inner = body[1:-1]
    if inner.startswith("["):
        digits = inner[1:-1] if inner.endswith("]") else ""
        if not digits.isdigit():
            raise GbnfError(f"token reference {ref}: expected <[id]> with a decimal id")
        token = int(digits)
        if token >= 1 << 32:
            raise GbnfError(f"token reference {ref}: the id is too big")
        return _TokenRef(token, negated)
    if tokenize is None:
        raise GbnfError(f"token reference {ref}: no vocabulary to resolve it with")
    ids = tokenize(body)
    if len(ids) != 1:
        raise GbnfError(f"token reference {ref}: the text is {len(ids)} tokens, not one")
    return _TokenRef(int(ids[0]), negated)


def _rewrite(node: Any, fix: Callable[[Any], Any]) -> Any:
    """Bottom-up rewrite of one rule body (children first, then the node itself)."""
    if isinstance(node, g2l.SequenceNode):
        node.nodes = [_rewrite(n, fix) for n in node.nodes]
    elif isinstance(node, g2l.AlternativeNode):
        node.alternatives = [_rewrite(n, fix) for n in node.alternatives]
    elif isinstance(node, g2l.RepetitionNode):
        node.node = _rewrite(node.node, fix)
    return fix(node)


def _fix_items(tokenize: Callable[[str], list[int]] | None) -> Callable[[Any], Any]:
    def fix(node: Any) -> Any:
        if isinstance(node, g2l.RuleRefNode) and node.name.startswith(_TOKEN_MARK):
            return _token_ref(node.name[len(_TOKEN_MARK):], tokenize)
        if isinstance(node, g2l.RepetitionNode):
            lo, hi = node.min_times, node.max_times
            if lo > MAX_REPETITION:
                raise GbnfError(f"a repetition of at least {lo}: the limit is {MAX_REPETITION} "
                                "(llama.cpp's)")
            if hi is not None and hi > MAX_REPETITION:
                hi = None  # as llama.cpp: a maximum beyond the threshold means none
            return _Repetition(node.node, lo, hi)
        return node
    return fix


def parse(text: str, tokenize: Callable[[str], list[int]] | None = None) -> dict:
    """GBNF text -> llguidance's rule AST (name -> RuleNode), with the fixes above applied."""
    rules = _Parser().parse(text)
    fix = _fix_items(tokenize)
    for name, rule in rules.items():
        if name.startswith(_TOKEN_MARK):
            raise GbnfError(f"{name[len(_TOKEN_MARK):]} cannot name a rule")
        rule.alternatives = _rewrite(rule.alternatives, fix)
    return rules


# ---------------------------------------------------------------------------- lexemes


def _nullable_rules(rules: dict) -> set[str]:
    """Names of the GBNF rules that can match the empty string (fixpoint)."""
    def nullable(node: Any, names: set[str]) -> bool:
        if isinstance(node, g2l.LiteralNode):
            return node.value == ""
        if isinstance(node, g2l.RuleRefNode):
            return node.name in names
        if isinstance(node, g2l.RepetitionNode):
            return node.min_times == 0 or nullable(node.node, names)
        if isinstance(node, g2l.SequenceNode):
            return all(nullable(n, names) for n in node.nodes)
        if isinstance(node, g2l.AlternativeNode):
            return any(nullable(n, names) for n in node.alternatives)
        return False  # character classes, ".", tokens

    names: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, rule in rules.items():
            if name not in names and nullable(rule.alternatives, names):
                names.add(name)
                changed = True
    return names


def _split_trailing_optional(rules: dict) -> None:
    """Keep a trailing reference to an optional rule out of the lexeme before it.

    llguidance's converter folds every all-terminal GBNF rule into one lexeme, and
    lexemes are matched greedily. For `num ::= [0-9]+ ws` with `ws ::= [ \t\n]*`
    followed by a literal "\n" (llama.cpp's arithmetic.gbnf), the lexeme NUM swallows
    the "\n" and the grammar then demands a second one: "1+2= 3\n" would not be
    complete as it is for llama.cpp. Such alternatives become `body ws`, the body a
    lexeme of its own, and the optional rule (`ws`) is kept at the parser level, one
    lexeme per character, so that " \n" can still end as ws " " + literal "\n".
    """
    nullable = _nullable_rules(rules)
    boundary: set[str] = set()
    for name, rule in list(rules.items()):
        if name == "root" or not isinstance(rule.alternatives, g2l.AlternativeNode):
            continue
        for i, alt in enumerate(rule.alternatives.alternatives):
            if not isinstance(alt, g2l.SequenceNode):
                continue
            k = 0
            while (k < len(alt.nodes) and isinstance(alt.nodes[-1 - k], g2l.RuleRefNode)
                   and alt.nodes[-1 - k].name in nullable):
                k += 1
            if k == 0 or k == len(alt.nodes):
                continue
            body = f"{name}-lexeme-{i}"
            while body in rules:
                body += "x"
            rules[body] = g2l.RuleNode(body, g2l.AlternativeNode([g2l.SequenceNode(
                alt.nodes[:-k])]), "")
            boundary.update(n.name for n in alt.nodes[-k:])
            alt.nodes = [g2l.RuleRefNode(body)] + [_BoundaryRef(n.name) for n in alt.nodes[-k:]]
    for name in boundary:
        rule = rules[name]
        alts = rule.alternatives
        rule.alternatives = _CharLevelAlternatives(
            alts.alternatives if isinstance(alts, g2l.AlternativeNode) else [alts])


# ---------------------------------------------------------------------------- printing


def gbnf_to_lark(text: str, tokenize: Callable[[str], list[int]] | None = None,
                 max_rules: int | None = None) -> str:
    """llama.cpp GBNF -> llguidance Lark (`%llguidance {}` + rules, `root` renamed `start`).

    tokenize(text) -> token ids resolves `<text>` token references (special tokens parsed);
    without it only `<[id]>` references are accepted. Raises GbnfError, or llguidance's
    converter's plain Exception, on bad GBNF.
    """
    rules = parse(text, tokenize)
    if max_rules is not None and len(rules) > max_rules:
        raise GbnfError(f"{len(rules)} rules, the limit is {max_rules}")
    _split_trailing_optional(rules)
    g2l.resolve(rules)
    body = "\n\n".join(str(r) for r in sorted(rules.values(), key=lambda r: r.order))
    return "%llguidance {}\n\n" + body + "\n"
