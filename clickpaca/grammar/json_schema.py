"""A JSON schema made ready for llguidance: numbers bounded.

A bare ``{"type": "number"}`` or ``"integer"`` lets a sampler write digits until maxTokens
(Gemma has a token per digit); llama.cpp's converter bounds the integral part to 16 digits.
llguidance has no such option, so `bound_numbers` adds the bound as schema keywords, which
narrow the language without changing what validates: a typed number without bounds gets
``minimum`` / ``maximum`` of +-(10**digits - 1) (read as f64 by llguidance, so one 17-digit
integer slips through at 16 digits), and a ``number`` without ``multipleOf`` gets
``"multipleOf": 1e-10`` (llguidance refuses a finer one). Numbers inside untyped values are
not reached. `numberDigits: null` on the `grammar` request lifts the bound
(docs/GRAMMARS.md). What llguidance does not enforce is schema_coverage.py's.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

__all__ = ["NUMBER_DIGITS", "FRACTION_STEP", "bound_numbers"]

#: Default bound on a JSON number's integral digits (llama.cpp's schema converter: 16).
NUMBER_DIGITS = 16
#: multipleOf added to unbounded numbers: the finest step llguidance accepts (1e-11 is
#: refused as "too many digits").
FRACTION_STEP = 1e-10

# Keywords whose value is one subschema, a list of them, or a map name -> subschema.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def _subschemas(schema: dict) -> Iterable[Any]:
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key]
    for key in _LIST:
        if isinstance(schema.get(key), list):
            yield from schema[key]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            yield from schema[key].values()


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _bound(schema: dict, keys: tuple[str, str]) -> float | None:
    """The schema's own bound on one side (draft 4's boolean exclusive* are not bounds)."""
    values = [schema[k] for k in keys if isinstance(schema.get(k), (int, float))
              and not isinstance(schema.get(k), bool)]
    if not values:
        return None
    return max(values) if keys is _LOWER else min(values)


def bound_numbers(schema: dict, digits: int = NUMBER_DIGITS) -> dict:
    """A copy of `schema` with every typed number bounded to `digits` integral digits
    (and numbers to 10 fractional digits); the input is not changed."""
    out = copy.deepcopy(schema)
    limit = 10 ** digits - 1
    stack = [out]
    while stack:  # iterative: schemas may nest deeply (grammars/limits.py limits the depth)
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        types = _types(node)
        if types & {"integer", "number"}:
            lower, upper = _bound(node, _LOWER), _bound(node, _UPPER)
            # Never make a satisfiable schema unsatisfiable: a bound the schema itself puts
            # beyond the limit leaves that side open.
            if lower is None and (upper is None or upper > -limit):
                node["minimum"] = -limit
            if upper is None and (lower is None or lower < limit):
                node["maximum"] = limit
            if "number" in types and "multipleOf" not in node:
                node["multipleOf"] = FRACTION_STEP
        stack.extend(_subschemas(node))
    return out
