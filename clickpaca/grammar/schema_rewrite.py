"""Exact rewrites of JSON Schema keywords llguidance does not implement into ones it does.

llguidance has no ``not``, ``if``/``then``/``else``, ``dependencies``, ``dependentRequired``
or ``dependentSchemas``. Some of their uses have an exact equivalent in what it does
implement, built from one fact: ``{"properties": {"A": false}}`` says "A is absent" (and
holds for every non-object, as the keywords it replaces do). `rewrite` replaces these uses,
in every subschema of the document, by an ``allOf`` entry that accepts exactly the same
instances (tests/test_schema_rewrite.py checks each against jsonschema):

- ``dependentRequired: {A: [B, ...]}`` and ``dependencies: {A: [B, ...]}``:
  ``anyOf: [A absent, required: [A, B, ...]]``;
- ``dependentSchemas: {A: S}`` and ``dependencies: {A: S}``: ``anyOf: [A absent, S]``;
- ``not: C`` where C is a *condition* with an exact complement (below): ``complement(C)``;
- ``if: C, then: T, else: E`` with such a C: ``anyOf: [allOf: [C, T], allOf: [complement(C), E]]``
  (a missing ``then``/``else`` is ``true``).

Conditions and their complements (a condition holds when each of its keywords does, so its
complement is the ``anyOf`` of theirs; a condition with any other keyword is not rewritten):

- ``required: [A1, ..., An]``: an object missing one of them,
  ``{"type": "object", "anyOf": [{"properties": {"Ai": false}}, ...]}``;
- ``const: v`` for v null, a boolean, a number (drafts 6+: numbers use numeric
  ``exclusiveMinimum``/``exclusiveMaximum``) or a string (any other type, a string of another
  length, or one of the same length differing at some position: a ``pattern`` of
  ``[^c]`` classes, no lookaround; not for a string holding ``"`` or ``\\``, which
  llguidance's negated classes do not exclude once escaped); arrays and objects are not
  rewritten;
- ``enum: [v1, ...]`` of such values: ``allOf`` of their complements;
- ``type``: the other types (not ``integer`` without ``number``: "a number that is not an
  integer" has no exact form);
- ``properties: {A: C, ...}`` with such conditions C: an object where some A is present and
  its value meets the complement of C (``{"properties": {"kind": {"const": "x"}}}``, the
  usual discriminator of an ``if``).

Each rewrite is done only where the draft defines the keyword (``if`` is not one in draft 4)
and not beside a ``$ref`` in drafts before 2019-09 (where ``$ref`` hides its siblings);
``dependencies`` in a 2019-09/2020-12 schema, where the standard dropped it, is rewritten
with its draft 7 meaning (narrower than a 2020-12 validator, which ignores it). A subtree
some ``$ref`` points into is never moved. What is not rewritten stays as it was:
schema_coverage.py lists it as not enforced.

Moved subschemas (``then``, ``else``, dependent schemas) get new JSON pointers;
`Rewritten.original_path` maps a path of the rewritten schema back to the one the client
wrote, so what is reported still names the client's places.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from .schema_coverage import ANNOTATIONS, draft_of, known_keyword

__all__ = ["Rewritten", "rewrite", "complement"]

_TYPES = ("null", "boolean", "number", "string", "array", "object")
_MAX_PATTERN_CHARS = 64  # a string const longer than this is not rewritten (pattern size)

# Keywords whose value is one subschema, a list of them, or a map name -> subschema.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")


@dataclass
class Rewritten:
    """The rewritten schema, which keywords were rewritten (path of the holding subschema in
    the client's schema, keyword), and the moves made (to map paths back)."""

    schema: Any
    keywords: list[tuple[str, str]] = field(default_factory=list)
    moves: list[tuple[tuple, tuple]] = field(default_factory=list)  # (new, old) in order

    def original_path(self, path: tuple) -> tuple:
        """A path of the rewritten schema as a path of the schema the client gave."""
        for new, old in reversed(self.moves):
            if path[:len(new)] == new:
                path = old + path[len(new):]
        return path


def _absent(name: str) -> dict:
    return {"properties": {name: False}}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def _regex_char(c: str) -> str:
    return "\\" + c if c in "\\.^$|?*+()[]{}/" else c


def _not_const(v: Any, draft: int) -> dict | None:
    others = lambda *skip: {"type": [t for t in _TYPES if t not in skip]}  # noqa: E731
    if v is None:
        return others("null")
    if isinstance(v, bool):
        return {"anyOf": [others("boolean"), {"const": not v}]}
    if _is_number(v):
        if draft < 6:
            return None  # draft 4's exclusive bounds are booleans
        return {"anyOf": [others("number"), {"type": "number", "exclusiveMaximum": v},
                          {"type": "number", "exclusiveMinimum": v}]}
    if isinstance(v, str):
        n = len(v)
        if n > _MAX_PATTERN_CHARS or any(0xD800 <= ord(c) <= 0xDFFF or c in '"\\' for c in v):
            return None  # llguidance's [^"] and [^\\] still let the escaped character through
        branches: list[Any] = [others("string"), {"type": "string", "minLength": n + 1}]
        if n:
            branches.append({"type": "string", "maxLength": n - 1})
            differ = "|".join("".join(_regex_char(c) for c in v[:i]) + "[^" + _class_char(v[i]) + "]"
                              for i in range(n))
            branches.append({"type": "string", "minLength": n, "maxLength": n,
                             "pattern": "^(?:" + differ + ")"})
        return {"anyOf": branches}
    return None


def complement(cond: Any, draft: int) -> dict | None:
    """A schema accepting exactly what `cond` rejects, or None if `cond` is not one of the
    conditions listed in the module doc. A condition is the conjunction of its keywords,
    so its complement is the anyOf of theirs."""
    if not isinstance(cond, dict):
        return None
    keys = [k for k in cond if k not in ANNOTATIONS and known_keyword(draft, k)]
    parts = []
    for key in keys:
        part = _complement_of(key, cond[key], draft)
        if part is None:
            return None
        if part is not _ALWAYS:
            parts.append(part)
    if not parts:
        return None  # always true: the complement is `false`
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_ALWAYS = {}  # a keyword that always holds (its complement adds no branch)


def _complement_of(key: str, value: Any, draft: int) -> dict | None:
    if key == "required":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            return None
        if not value:
            return _ALWAYS
        return {"type": "object", "anyOf": [_absent(a) for a in dict.fromkeys(value)]}
    if key == "const":
        return _not_const(value, draft)
    if key == "enum":
        if not isinstance(value, list) or not value:
            return None
        parts = [_not_const(v, draft) for v in value]
        return None if any(p is None for p in parts) else {"allOf": parts}
    if key == "type":
        types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
        if not types or not types <= {*_TYPES, "integer"} or ("integer" in types and "number" not in types):
            return None  # "a number that is not an integer" has no exact form in llguidance
        rest = [t for t in _TYPES if t not in types]
        return {"type": rest} if rest else None
    if key == "properties":
        if not isinstance(value, dict):
            return None
        parts = []
        for name, sub in value.items():
            if sub is True:
                continue
            neg = False if sub is False else complement(sub, draft)
            if neg is None:
                return None
            parts.append({"type": "object", "required": [name]} if neg is False else
                         {"type": "object", "required": [name], "properties": {name: neg}})
        if not parts:
            return _ALWAYS
        return parts[0] if len(parts) == 1 else {"anyOf": parts}
    return None


def _condition(cond: Any) -> dict:
    """The condition as it stands in the rewrite: its one asserting keyword."""
    return {k: v for k, v in cond.items() if k not in ANNOTATIONS}


def _ref_paths(schema: Any) -> list[tuple]:
    """Every local JSON-pointer `$ref` of the document, as a path (to keep their targets)."""
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                out.append(tuple(unquote(p).replace("~1", "/").replace("~0", "~")
                                 for p in ref[2:].split("/")))
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return out


def _children(node: dict) -> list[tuple[tuple, Any]]:
    out = []
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out.append(((key,), node[key]))
    for key in _LIST:
        if isinstance(node.get(key), list):
            out += [((key, i), sub) for i, sub in enumerate(node[key])]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out += [((key, name), sub) for name, sub in node[key].items()]
    return out


def rewrite(schema: Any) -> Rewritten:
    """A copy of `schema` with every exact rewrite of the module doc done (the input is
    not changed); subschemas are rewritten before the ones holding them."""
    out = Rewritten(json.loads(json.dumps(schema)))  # no shared subschemas
    if not isinstance(out.schema, dict):
        return out
    draft = draft_of(out.schema)
    refs = _ref_paths(out.schema)
    # Post-order over the original tree: paths are recorded before anything moves.
    order: list[tuple[tuple, dict]] = []
    stack: list[tuple[tuple, Any, bool]] = [((), out.schema, False)]
    while stack:
        path, node, expanded = stack.pop()
        if not isinstance(node, dict):
            continue
        if expanded:
            order.append((path, node))
            continue
        stack.append((path, node, True))
        stack.extend((path + rel, sub, False) for rel, sub in reversed(_children(node)))
    for path, node in order:
        _rewrite_node(node, path, draft, refs, out)
    return out


def _pointed_into(path: tuple, refs: list[tuple]) -> bool:
    return any(r[:len(path)] == tuple(str(p) for p in path) for r in refs)


def _rewrite_node(node: dict, path: tuple, draft: int, refs: list[tuple], out: Rewritten) -> None:
    """Rewrite this subschema's own keywords in place (its children are done already).
    `path` is where it stood in the client's schema before anything above it moved."""
    if "$ref" in node and draft < 2019:
        return
    added: list[Any] = []

    if not isinstance(node.get("allOf", []), list):
        return

    def place(branch: Any, moved: list[tuple[tuple, tuple]]) -> None:
        """Append `branch` to the node's allOf; moved: (path inside `branch`, the
        node-relative path that subschema came from)."""
        k = len(node.get("allOf", [])) + len(added)
        added.append(branch)
        for inside, came_from in moved:
            out.moves.append((path + ("allOf", k) + inside, path + came_from))

    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        deps = node.get(key)
        if not known_keyword(draft, key) or not isinstance(deps, dict):
            continue
        if key == "dependentRequired" and not all(
                isinstance(v, list) and all(isinstance(x, str) for x in v) for v in deps.values()):
            continue
        if key != "dependentRequired" and not all(
                isinstance(v, (dict, bool)) or (key == "dependencies" and isinstance(v, list)
                                                and all(isinstance(x, str) for x in v))
                for v in deps.values()):
            continue
        if any(isinstance(v, (dict, bool)) and _pointed_into(path + (key, name), refs)
               for name, v in deps.items()):
            continue
        for name, need in deps.items():
            if isinstance(need, list):
                place({"anyOf": [_absent(name), {"required": [name, *need]}]}, [])
            else:
                place({"anyOf": [_absent(name), need]}, [(("anyOf", 1), (key, name))])
        del node[key]
        out.keywords.append((path, key))
    if known_keyword(draft, "not") and "not" in node:
        neg = complement(node["not"], draft)
        if neg is not None:
            place(neg, [])
            del node["not"]
            out.keywords.append((path, "not"))
    if known_keyword(draft, "if") and "if" in node:
        cond = node["if"]
        neg = complement(cond, draft)
        if neg is not None and not any(_pointed_into(path + (k,), refs) for k in ("then", "else")):
            then, other = node.pop("then", True), node.pop("else", True)
            moved = [(("anyOf", i, "allOf", 1), (name,))
                     for i, (name, sub) in enumerate((("then", then), ("else", other)))
                     if isinstance(sub, dict)]
            place({"anyOf": [{"allOf": [_condition(cond), then]}, {"allOf": [neg, other]}]}, moved)
            del node["if"]
            out.keywords.append((path, "if"))
    if added:
        node["allOf"] = [*node.get("allOf", []), *added]

