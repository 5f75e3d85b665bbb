"""How a request type is declared, and the table `validate` walks.

One frozen dataclass per request type (keyword-only: a request is built by field name,
as on the wire, and a required field may follow a defaulted one); each wire field is
declared once, with its check and its default (`wire`), and REQUESTS, the table
`validate` walks, is derived from the classes. Attributes carry the wire names
(req.nBatch, req.seq_id): the wire mixes camelCase and snake_case, and one spelling in
docs, error messages and code needs no table translating between them. Attributes that
are not on the wire are snake_case: infer's `params` (its sampler fields, folded into one
SamplerParams) and init's `given`. A request holds only what the client sent: the
engine's work on it (prompt tokens, a compiled grammar) travels beside it, in the
engine's own type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Callable, ClassVar


def wire(check: Callable[[str, Any], Any], default: Any = MISSING) -> Any:
    """A wire field: its check (name, value) -> value or ValueError naming the field, and
    its default (none: the field is required)."""
    if default is MISSING:
        return field(metadata={"check": check})
    return field(default=default, metadata={"check": check})


def folded(names: Callable[[], tuple[str, ...]], make: Callable[[], Any]) -> Any:
    """A value made from several wire fields together (the request's check_across makes
    it); ``names()`` says which fields, read at each use."""
    return field(default_factory=make, metadata={"folds": names})


def given_fields() -> Any:
    """The wire fields the client wrote (the others took their defaults); not compared:
    requests are equal by their values."""
    return field(default=frozenset(), compare=False, repr=False, metadata={"given": True})


class Request:
    """A validated request; `type` is its wire name."""

    type: ClassVar[str]

    @property
    def reply_seq_id(self) -> int:
        """The seq_id an answer about this request goes to (-1: none)."""
        return getattr(self, "seq_id", -1)

    @classmethod
    def check_across(cls, obj: dict, values: dict) -> None:
        """Checks across fields, after each field's own check: `obj` as received, `values`
        checked and defaulted (it may be completed here); a ValueError naming the field."""


class _Fields(Mapping):
    """A request's wire fields in declaration order: name -> (check, default). A folded
    group's names are asked of its source at each use (infer's sampler fields, of the
    step registry), so a step registered later is a field with no copy to refresh; the
    flat row is rebuilt only when a source answers differently."""

    def __init__(self, parts: list) -> None:
        self._parts = parts  # (name, (check, default)) pairs and folded groups' name sources
        self._key: tuple | None = None
        self._row: dict[str, tuple[Callable[[str, Any], Any], Any]] = {}

    def _flat(self) -> dict[str, tuple[Callable[[str, Any], Any], Any]]:
        key = tuple(part() for part in self._parts if callable(part))
        if key != self._key:
            row: dict[str, tuple[Callable[[str, Any], Any], Any]] = {}
            for part in self._parts:
                if callable(part):
                    row.update((name, (with_params, MISSING)) for name in part())
                else:
                    row[part[0]] = part[1]
            self._key, self._row = key, row
        return self._row

    def __getitem__(self, name: str) -> tuple[Callable[[str, Any], Any], Any]:
        return self._flat()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._flat()

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())

    def items(self):  # one look at the sources, not one per field
        return self._flat().items()

    def keys(self):
        return self._flat().keys()

    def values(self):
        return self._flat().values()


#: Request type -> its dataclass, and -> its wire fields: name -> (check, default), where
#: default MISSING means required. The sampler fields of infer map to with_params.
REQUEST_TYPES: dict[str, type[Request]] = {}
REQUESTS: dict[str, _Fields] = {}


def request_type(kind: str) -> Callable[[type], type]:
    """Register a request's dataclass under its wire type `kind` and derive its row of
    REQUESTS from the fields."""
    def register(cls: type) -> type:
        if not is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__}: a request is a frozen dataclass")
        cls.type = kind
        spec: list = []
        for f in fields(cls):
            if "check" in f.metadata:
                spec.append((f.name, (f.metadata["check"], f.default)))
            elif "folds" in f.metadata:
                spec.append(f.metadata["folds"])
            elif "given" not in f.metadata:
                raise TypeError(f"{cls.__name__}.{f.name}: declare it with wire(), folded() or given_fields()")
        REQUEST_TYPES[kind] = cls
        REQUESTS[kind] = _Fields(spec)
        return cls
    return register


def with_params(name: str, v: Any) -> Any:
    """Marks the sampler fields: never checked one by one, but together by SamplerParams
    (InferRequest.check_across), which also decides which bad field to report first."""
    raise AssertionError(name)
