"""What `bench peer` checks on every output of both sides, outside the timed window.

Why: a throughput figure is worth nothing if one side's outputs are invalid, contain a
banned token or are counted differently. Outputs are checked with jsonschema (not with
either side's grammar engine), token ids against the banned id, and llama-server's own
token counts against the token ids and text it returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema


@dataclass
class Output:
    """One request's result on one side, in the same shape for both."""

    text: str
    token_ids: list[int]
    stop: str                      # "eos"/"grammar" (ended), "limit" (max tokens), "error"
    prompt_tokens: int | None = None
    reported_tokens: int | None = None   # the side's own count (done.tokens_predicted / tokens_predicted)
    error: str | None = None
    eog_returned: bool = False       # llama-server: its token list ended with the EOG token
    forced: int = 0                  # clickpaca with jumpForward: tokens fed as forced chunks (done.forced_tokens)
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def validity(text: str, schema: dict[str, Any]) -> str:
    """'valid', 'unparsed' (not JSON) or 'invalid' (JSON, but not of the schema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return "unparsed"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return "invalid"
    return "valid"


def summarize(outputs: list[Output], schemas: list[dict | None], banned: list[int | None]) -> dict:
    """Counts over one side's outputs of one load (all rounds)."""
    out = {"outputs": len(outputs), "errors": 0, "valid": 0, "invalid": 0, "unparsed": 0,
           "cut_at_limit": 0, "pretty_printed": 0, "banned_seen": 0, "count_mismatches": 0,
           "tokens_per_request": [], "examples_bad": []}
    for o, schema, ban in zip(outputs, schemas, banned):
        if o.error:
            out["errors"] += 1
            out["examples_bad"].append(o.error[:200])
            continue
        out["tokens_per_request"].append(o.tokens)
        if o.stop == "limit":
            out["cut_at_limit"] += 1
        if ban is not None and ban in o.token_ids:
            out["banned_seen"] += 1
        if o.notes:
            out["count_mismatches"] += 1
            out["examples_bad"].append("; ".join(o.notes)[:200])
        if schema is None:
            continue
        if "\n" in o.text.strip():
            out["pretty_printed"] += 1
        v = validity(o.text, schema)
        out[v] += 1
        if v != "valid" and len(out["examples_bad"]) < 3:
            out["examples_bad"].append(f"{v} ({o.stop}): {o.text[:160]!r}")
    del out["examples_bad"][3:]
    return out
