"""A finished output checked against its whole JSON schema, by a standard validator.

The grammar enforces what llguidance compiles (schema_coverage.py); what it does not
(`ignored`) may be broken by the output. The `done` event of such an output therefore
carries ``schemaValid`` from the `jsonschema` package, the validator class chosen by the
schema's `$schema` (2020-12 without one), with its format checker (formats the package
can check are checked; the rest are annotations there too). It checks the schema as the
client gave it: not the bounded numbers, not the keywords the compile dropped.

One `SchemaCheck` per compiled grammar; `prepare` builds its validator where the schema is
compiled (a reader thread), so the engine thread never waits for it: importing jsonschema
took 0.64 s on the loaded 2-core machine, building a validator 0.15-0.18 ms and a check
0.02-0.18 ms (check-jsonschema's codecov, github-workflows, compose-spec, readthedocs).
"""

from __future__ import annotations

import json
import threading
from typing import Any

__all__ = ["SchemaCheck", "violation_fields"]


def _json_path(path) -> str:
    """An instance location as a JSONPath ($, .name, [i]), e.g. ``$.tags[1]``."""
    out = "$"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else ("." + p if p.isidentifier() else f"[{json.dumps(p)}]")
    return out


def _schema_pointer(path) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


class SchemaCheck:
    """Validates output texts against one schema (thread-safe; the validator is built
    once, lazily)."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self._validator = None
        self._lock = threading.Lock()

    def prepare(self) -> "SchemaCheck":
        """Build the validator now (importing jsonschema the first time); a failure is
        reported by `check` (schemaError), not here."""
        try:
            self._get()
        except Exception:  # noqa: BLE001 - check() meets it again and reports it
            pass
        return self

    def _get(self):
        with self._lock:
            if self._validator is None:
                from jsonschema import validators  # imported on first use: it takes ~0.1 s
                cls = validators.validator_for(self.schema, default=validators.Draft202012Validator)
                self._validator = cls(self.schema, format_checker=cls.FORMAT_CHECKER)
            return self._validator

    def check(self, text: str) -> dict:
        """``{"schemaValid": True}``, or False with ``schemaViolation`` (the first one:
        the output's JSON path, the keyword, the schema's pointer, the message), or None
        with ``schemaError`` when the validator itself failed (an unresolvable $ref)."""
        try:
            value = json.loads(text)
        except ValueError as e:
            return {"schemaValid": False, "schemaViolation": {
                "path": "$", "keyword": "json", "schemaPath": "#", "message": f"not JSON: {e}"}}
        try:
            error = next(iter(self._get().iter_errors(value)), None)
        except Exception as e:  # noqa: BLE001 - the validator's own failure, reported
            return {"schemaValid": None, "schemaError": f"{type(e).__name__}: {e}"[:500]}
        if error is None:
            return {"schemaValid": True}
        return {"schemaValid": False, "schemaViolation": violation_fields(error)}


def violation_fields(error) -> dict:
    """A jsonschema ValidationError as the `done` event's ``schemaViolation``."""
    return {"path": _json_path(error.absolute_path), "keyword": str(error.validator),
            "schemaPath": _schema_pointer(error.absolute_schema_path),
            "message": error.message[:300]}
