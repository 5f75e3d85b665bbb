"""A JSON schema as llguidance is to compile it: fixed separators and no free whitespace,
the exact rewrites (schema_rewrite.py), and what it will not enforce (schema_coverage.py).
"""

from __future__ import annotations

from typing import Any

from llguidance import LLMatcher

from ..json_schema import NUMBER_DIGITS, bound_numbers
from ..schema_coverage import (Ignored, approximated_one_ofs, coverage, pointer, strip,
                               unsupported_property_counts)
from ..schema_rewrite import rewrite


#: Applied before a schema's own "x-guidance" options: fixed, json.dumps-like separators.
JSON_DEFAULTS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": "}
#: Applied after them: no free whitespace between JSON tokens, whatever the schema says.
JSON_OVERRIDES: dict[str, Any] = {"whitespace_flexible": False, "whitespace_pattern": None}


def schema_overrides(strict: bool) -> dict:
    """llguidance's options for a schema: never its own lenient (the keywords to ignore are
    removed beforehand, so a keyword the walk missed is refused, not dropped silently);
    oneOf approximated unless strict."""
    return {**JSON_OVERRIDES, "lenient": False, "coerce_one_of": not strict}


def schema_for_llguidance(schema: dict, lenient: bool = False, strict: bool = False,
                          number_digits: int | None = NUMBER_DIGITS) -> tuple[dict, list[Ignored]]:
    """The schema llguidance is to compile, and what it will not enforce (sorted by path):

    - the keywords with an exact rewrite into what llguidance implements are rewritten
      (schema_rewrite.py), unless llguidance then refuses the schema for another reason
      (an allOf it cannot intersect): it is then prepared as written;
    - unknown formats (annotations, JSON Schema says) are removed, unless `strict`;
    - with `lenient`, the keywords llguidance does not implement are removed, and so are
      the minProperties/maxProperties it cannot compile where they stand;
    - typed numbers are bounded (json_schema.py);
    - unless `strict`, the oneOfs llguidance will compile as anyOf are listed.
    A `strict` schema is handed over whole (rewritten): llguidance refuses what it cannot
    enforce. Listed paths are the client's, also inside rewritten subschemas."""
    rewritten = rewrite(schema)
    if strict:
        given = rewritten.schema
        return (bound_numbers(given, number_digits) if number_digits is not None else given), []
    if rewritten.keywords:
        given, drop = _prepared(rewritten.schema, lenient, number_digits)
        err = _refusal(given, True)
        if err is None or err.startswith("Unimplemented keys"):
            return given, sorted((Ignored(pointer(rewritten.original_path(i.at)), i.keyword, i.reason, i.at)
                                  for i in drop), key=lambda i: (i.path, i.keyword))
    return _prepared(schema, lenient, number_digits)


def _prepared(schema: dict, lenient: bool, number_digits: int | None) -> tuple[dict, list[Ignored]]:
    """`schema_for_llguidance` after the rewrites, not strict."""
    cov = coverage(schema)
    drop = cov.formats + (cov.unimplemented if lenient else [])
    given = strip(schema, drop) if drop else schema
    if number_digits is not None:
        given = bound_numbers(given, number_digits)
    if lenient and cov.property_counts:
        counts = unsupported_property_counts(given, cov.property_counts, lambda s: _refusal(s, True))
        if counts:
            drop += counts
            given = strip(given, counts)
    if cov.one_ofs:
        drop += approximated_one_ofs(given, cov.one_ofs, _refusal)
    return given, sorted(drop, key=lambda i: (i.path, i.keyword))


def _refusal(schema: dict, coerce_one_of: bool = False) -> str | None:
    """llguidance's error for the schema (oneOf approximated or not), or None."""
    grammar = LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_DEFAULTS, overrides={**schema_overrides(not coerce_one_of)})
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else None
