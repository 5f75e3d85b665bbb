"""The three grammar formats: which one a text is (its first characters), their names in
messages, `GrammarError`, and the small text fixes before llguidance sees one.
"""

from __future__ import annotations


LARK_HEADER = "%llguidance"
JSON_SCHEMA_HEADER = "%json_schema"


class GrammarError(ValueError):
    """A grammar (GBNF, Lark or JSON schema) was rejected; the message says why."""

    def __init__(self, message: str, format: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.format = format


def detect_format(text: str) -> str:
    """'lark' (starts with %llguidance), 'json_schema' (starts with %json_schema) or 'gbnf'."""
    head = text.lstrip()
    if head.startswith(JSON_SCHEMA_HEADER):
        return "json_schema"
    if head.startswith(LARK_HEADER):
        return "lark"
    return "gbnf"


def lark_header_options(text: str) -> str:
    """`%llguidance` alone on its line means `%llguidance {}` (llguidance wants a JSON object)."""
    lead = len(text) - len(text.lstrip())
    end = text.find("\n", lead)
    line = text[lead:] if end < 0 else text[lead:end]
    if line.strip() == LARK_HEADER:
        return text[:lead] + LARK_HEADER + " {}" + ("" if end < 0 else text[end:])
    return text


def short_error(msg: str) -> str:
    """llguidance's message without its parser-state / grammar dump."""
    return msg.split("\n<state>", 1)[0].strip()


FORMAT_NAMES = {"lark": "lark grammar", "json_schema": "JSON schema", "gbnf": "GBNF grammar"}
