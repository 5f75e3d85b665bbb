"""Which parts of a JSON schema llguidance enforces, found by walking the schema ourselves.

llguidance reports what it leaves out without saying where (``Unimplemented keys: [...]``,
``Unknown format: x``, ``oneOf not fully supported``). `coverage` walks the schema the way
llguidance's compiler reaches it (properties and items where the subschema admits objects or
arrays, every anyOf / allOf / oneOf branch, local `$ref`s once each; nothing under `not` or
`if`) and lists every keyword it does not enforce with the JSON pointer of its subschema,
from tables copied from llguidance's own (parser/src/json/schema.rs, draft.rs, formats.rs;
tests/test_schema_coverage.py checks them). `strip` removes exactly those keywords before
llguidance compiles with its own `lenient` off, so a keyword the walk misses is refused,
never dropped unannounced. A ``oneOf`` whose branches llguidance cannot prove disjoint
compiles as ``anyOf`` and is listed (`approximated_one_ofs` asks llguidance which).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import unquote, urldefrag, urljoin

__all__ = ["IMPLEMENTED", "ANNOTATIONS", "FORMATS", "Ignored", "Coverage", "coverage", "strip",
           "approximated_one_ofs", "unsupported_property_counts", "known_keyword", "draft_of",
           "pointer", "ONE_OF_REFUSED", "PROPERTY_COUNTS_REFUSED"]

#: Assertion and applicator keywords llguidance compiles (schema.rs IMPLEMENTED).
IMPLEMENTED = frozenset((
    "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type",
    "items", "additionalItems", "prefixItems", "minItems", "maxItems",
    "properties", "additionalProperties", "patternProperties", "required", "minProperties",
    "maxProperties", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))
#: Keywords that assert nothing (schema.rs META_AND_ANNOTATIONS).
ANNOTATIONS = frozenset((
    "$anchor", "$defs", "definitions", "$schema", "$id", "id", "$comment", "title",
    "description", "default", "readOnly", "writeOnly", "examples", "contentMediaType",
    "contentEncoding"))
#: The `format` values llguidance enforces (formats.rs); any other is an annotation here.
FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uuid", "uri"))

DRAFTS = {  # $schema (without a trailing '#') -> draft, as llguidance detects it
    "http://json-schema.org/draft-04/schema": 4, "http://json-schema.org/draft-06/schema": 6,
    "http://json-schema.org/draft-07/schema": 7,
    "https://json-schema.org/draft/2019-09/schema": 2019,
    "https://json-schema.org/draft/2020-12/schema": 2020,
}
_ALL_DRAFTS = frozenset((
    "$ref", "$schema", "additionalItems", "additionalProperties", "allOf", "anyOf",
    "dependencies", "enum", "exclusiveMaximum", "exclusiveMinimum", "format", "items",
    "maxItems", "maxLength", "maxProperties", "maximum", "minItems", "minLength",
    "minProperties", "minimum", "multipleOf", "not", "oneOf", "pattern", "patternProperties",
    "properties", "required", "type", "uniqueItems"))
_SINCE = {  # keyword -> the first draft that knows it (draft.rs is_known_keyword)
    **{k: 6 for k in ("$id", "const", "contains", "propertyNames")},
    **{k: 7 for k in ("if", "then", "else")},
    **{k: 2019 for k in ("$anchor", "$defs", "$recursiveAnchor", "$recursiveRef",
                         "dependentRequired", "dependentSchemas", "maxContains", "minContains",
                         "prefixItems", "unevaluatedItems", "unevaluatedProperties")},
    **{k: 2020 for k in ("$dynamicAnchor", "$dynamicRef")},
}
_ONLY = {"id": (4,), "contentEncoding": (6, 7), "contentMediaType": (6, 7)}
_TYPES = ("null", "boolean", "number", "integer", "string", "array", "object")

#: llguidance's refusal of a oneOf it cannot prove disjoint (without coerce_one_of).
ONE_OF_REFUSED = "oneOf constraints are not supported"
#: llguidance's refusal of minProperties/maxProperties beside optional properties.
PROPERTY_COUNTS_REFUSED = "min/maxProperties only supported when"

NOT_IMPLEMENTED = "not implemented by llguidance"
APPROXIMATED = "compiled as anyOf: its branches are not proven disjoint"
PROPERTY_COUNTS = "not implemented by llguidance beside optional properties"


def known_keyword(draft: int, key: str) -> bool:
    """Whether the draft defines the keyword (draft.rs): unknown keywords assert nothing."""
    if key in _ALL_DRAFTS:
        return True
    if key in _ONLY:
        return draft in _ONLY[key]
    since = _SINCE.get(key)
    return since is not None and draft >= since


def draft_of(schema: Any) -> int:
    """The draft a schema's `$schema` names (2020 without one, as llguidance and jsonschema
    both default); an unknown `$schema` is 2020 here and refused by llguidance."""
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        return DRAFTS.get(schema["$schema"].rstrip("#"), 2020)
    return 2020


def pointer(parts: tuple) -> str:
    """A JSON pointer as a URI fragment: ("properties", "a/b") -> "#/properties/a~1b"."""
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


@dataclass(frozen=True)
class Ignored:
    """One keyword not enforced: the subschema's JSON pointer, the keyword, why."""

    path: str
    keyword: str
    reason: str
    at: tuple = field(default=(), compare=False, repr=False)  # the path as keys and indices

    def as_dict(self) -> dict:
        return {"path": self.path, "keyword": self.keyword, "reason": self.reason}


@dataclass
class Coverage:
    """The walk's findings: keywords llguidance would refuse (`unimplemented`), unknown
    formats, and every reachable `oneOf` (as paths to the subschemas holding them)."""

    unimplemented: list[Ignored] = field(default_factory=list)
    formats: list[Ignored] = field(default_factory=list)
    one_ofs: list[tuple] = field(default_factory=list)
    property_counts: list[tuple] = field(default_factory=list)


def _types(node: dict) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set(_TYPES)


def _children(node: dict, draft: int) -> Iterator[tuple[tuple, Any]]:
    """(relative path, subschema) of what llguidance compiles under this node."""
    for key in ("anyOf", "allOf", "oneOf"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield (key, i), sub
    types = _types(node)
    if "object" in types:
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    yield (key, name), sub
        if "additionalProperties" in node:
            yield ("additionalProperties",), node["additionalProperties"]
    if "array" in types:
        items, extra = node.get("items"), node.get("additionalItems")
        if draft <= 2019 or "additionalItems" in node or isinstance(items, list):
            if isinstance(items, list):  # older drafts: array items are prefixItems
                for i, sub in enumerate(items):
                    yield ("items", i), sub
                if "additionalItems" in node:
                    yield ("additionalItems",), extra
            elif "items" in node:
                yield ("items",), items
        else:
            if isinstance(node.get("prefixItems"), list):
                for i, sub in enumerate(node["prefixItems"]):
                    yield ("prefixItems", i), sub
            if "items" in node:
                yield ("items",), items


class _Resolver:
    """Local `$ref` -> (path, subschema): JSON pointers, `$id`s and `$anchor`s of the
    document (remote references are llguidance's to refuse)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.base = root.get("$id", "") if isinstance(root, dict) and isinstance(root.get("$id"), str) else ""
        self.ids: dict[str, tuple] = {}
        stack: list[tuple[tuple, Any, str]] = [((), root, self.base)]
        while stack:
            path, node, base = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("$id"), str) and path:
                    doc, frag = urldefrag(urljoin(base, node["$id"]))
                    if frag:  # draft 6/7's {"$id": "#name"}: a name, not a new base
                        self.ids.setdefault(doc + "#" + frag, path)
                    else:
                        base = doc
                        self.ids.setdefault(doc, path)
                for name in ("$anchor", "$dynamicAnchor"):
                    if isinstance(node.get(name), str):
                        self.ids.setdefault(urldefrag(base)[0] + "#" + node[name], path)
                stack.extend((path + (k,), v, base) for k, v in node.items() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((path + (i,), v, base) for i, v in enumerate(node) if isinstance(v, (dict, list)))

    def resolve(self, ref: str) -> tuple[tuple, Any] | None:
        base_doc = urldefrag(self.base)[0]
        doc, frag = urldefrag(urljoin(self.base, ref) if self.base else ref)
        if frag and not frag.startswith("/"):
            at = self.ids.get((doc or base_doc) + "#" + unquote(frag))
            return (at, self._get(at)) if at is not None else None
        start = () if doc in ("", base_doc) else self.ids.get(doc)
        if start is None:
            return None
        path = start
        for raw in frag.split("/")[1:] if frag else []:
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            node = self._get(path)
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                path += (int(part),)
            elif isinstance(node, dict) and part in node:
                path += (part,)
            else:
                return None
        return path, self._get(path)

    def _get(self, path: tuple) -> Any:
        node = self.root
        for p in path:
            node = node[p]
        return node


def coverage(schema: Any) -> Coverage:
    """Walk what llguidance compiles of `schema` (see the module doc); iterative."""
    out = Coverage()
    draft = draft_of(schema)
    resolver = _Resolver(schema)
    seen: set[tuple] = set()
    stack: list[tuple[tuple, Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if path in seen or not isinstance(node, dict):
            continue
        seen.add(path)
        if all(k in ANNOTATIONS or not known_keyword(draft, k) for k in node):
            continue  # constrains nothing: llguidance compiles it as any value
        at = pointer(path)
        for key in sorted(node):
            if known_keyword(draft, key) and key not in IMPLEMENTED and key not in ANNOTATIONS:
                out.unimplemented.append(Ignored(at, key, NOT_IMPLEMENTED, path))
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in FORMATS and "string" in _types(node):
            out.formats.append(Ignored(at, "format", f"unknown format {fmt!r}: an annotation", path))
        if "oneOf" in node:
            out.one_ofs.append(path)
        if ("minProperties" in node or "maxProperties" in node) and "object" in _types(node):
            out.property_counts.append(path)
        children = list(_children(node, draft))
        if isinstance(node.get("$ref"), str):
            target = resolver.resolve(node["$ref"])
            if target is not None:
                children.append((None, target))
        for rel, sub in reversed(children):
            if rel is None:
                stack.append(sub)
            else:
                stack.append((path + rel, sub))
    out.unimplemented.sort(key=lambda i: (i.path, i.keyword))
    out.formats.sort(key=lambda i: i.path)
    out.one_ofs.sort()
    out.property_counts.sort()
    return out


def _at(schema: Any, path: tuple) -> Any:
    for p in path:
        schema = schema[p]
    return schema


def strip(schema: Any, ignored: list[Ignored]) -> Any:
    """A copy of `schema` without the listed keywords."""
    out = json.loads(json.dumps(schema))  # no shared subschemas (deepcopy keeps them)
    for item in ignored:
        _at(out, item.at).pop(item.keyword, None)
    return out


def _probe(schema: Any, nodes: list[tuple], disable: Callable[[dict], None], marker: str,
           refuses: Callable[[Any], str | None]) -> list[tuple]:
    """The nodes llguidance fails on with `marker` in its error: none when the schema
    compiles (one compile); the one node when there is one; else each node whose schema,
    with every other node `disable`d (deepest first: paths below stay valid), still fails."""
    if not nodes:
        return []
    err = refuses(schema)
    if err is None or marker not in err:
        return []
    if len(nodes) == 1:
        return list(nodes)
    out = []
    for keep in nodes:
        probe = json.loads(json.dumps(schema))  # no shared subschemas (deepcopy keeps them)
        for other in sorted((n for n in nodes if n != keep), key=len, reverse=True):
            disable(_at(probe, other))
        err = refuses(probe)
        if err is not None and marker in err:
            out.append(keep)
    return out


def _one_of_as_any_of(node: dict) -> None:
    branches = node.pop("oneOf")
    if "anyOf" in node:  # keep its own anyOf: the branches join an allOf
        node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
    else:
        node["anyOf"] = branches


def approximated_one_ofs(schema: Any, one_ofs: list[tuple],
                         refuses: Callable[[Any], str | None]) -> list[Ignored]:
    """The `oneOf`s llguidance compiles only as `anyOf`. `refuses(schema)`: llguidance's
    error compiling it without coerce_one_of, or None."""
    return [Ignored(pointer(p), "oneOf", APPROXIMATED, p)
            for p in _probe(schema, one_ofs, _one_of_as_any_of, ONE_OF_REFUSED, refuses)]


def _drop_property_counts(node: dict) -> None:
    node.pop("minProperties", None)
    node.pop("maxProperties", None)


def unsupported_property_counts(schema: Any, counted: list[tuple],
                                refuses: Callable[[Any], str | None]) -> list[Ignored]:
    """The `minProperties`/`maxProperties` llguidance cannot compile where they stand
    (beside optional properties: PROPERTY_COUNTS_REFUSED). `refuses(schema)`: its error
    compiling the schema as it will be compiled, or None."""
    out = []
    for p in _probe(schema, counted, _drop_property_counts, PROPERTY_COUNTS_REFUSED, refuses):
        node = _at(schema, p)
        out += [Ignored(pointer(p), k, PROPERTY_COUNTS, p) for k in ("maxProperties", "minProperties") if k in node]
    return out
