"""The loads of `clickpaca bench peer`: what each request asks for, identical on both sides.

Why these: one request and eight greedy requests show the shared decode path; eight
different JSON schemas at T=0.8 (with and without a banned token) and 64 requests of
mixed schemas are what clickpaca is for: many sequences with their own grammar and
steering in one forward pass. The schemas are written like real extraction targets:
enums, integer ranges, arrays with maxItems, nested objects, strings with maxLength.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _arr(items: dict[str, Any], n: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": n}


#: name -> (prompt, schema). Prompts are plain text (no chat template on either side).
SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("A customer record as JSON, for a nurse who lives in Lyon:\n",
               _obj({"name": _str(40), "age": _int(0, 120), "email": _str(60),
                     "tags": _arr(_str(20), 3)})),
    "product": ("The catalogue entry of a waterproof hiking jacket, as JSON:\n",
                _obj({"sku": _str(12), "title": _str(60), "price_cents": _int(0, 1000000),
                      "currency": _enum("USD", "EUR", "GBP", "JPY"), "in_stock": {"type": "boolean"}})),
    "address": ("The postal address of the Louvre museum, as JSON:\n",
                _obj({"street": _str(60), "city": _str(30), "postcode": _str(10),
                      "country": _enum("FR", "DE", "IT", "ES", "GB", "US")})),
    "event": ("A team meeting next Monday with three colleagues, as JSON:\n",
              _obj({"title": _str(50), "day": _enum("mon", "tue", "wed", "thu", "fri"),
                    "hour": _int(0, 23),
                    "attendees": _arr(_obj({"name": _str(30),
                                            "role": _enum("host", "guest", "optional")}), 3)})),
    "order": ("An online order of two books and a lamp, as JSON:\n",
              _obj({"order_id": _int(1, 99999),
                    "items": _arr(_obj({"sku": _str(10), "qty": _int(1, 10)}), 4),
                    "status": _enum("pending", "paid", "shipped", "cancelled")})),
    "review": ("A short review of a coffee grinder, as JSON:\n",
               _obj({"rating": _int(1, 5), "title": _str(60), "pros": _arr(_str(30), 3),
                     "recommend": {"type": "boolean"}})),
    "weather": ("Today's weather report for Oslo, as JSON:\n",
                _obj({"city": _str(30), "temperature_c": _int(-50, 60),
                      "conditions": _enum("sunny", "cloudy", "rain", "snow", "fog"),
                      "wind": _obj({"speed_kmh": _int(0, 200),
                                    "direction": _enum("N", "E", "S", "W")})})),
    "task": ("A to-do item for repainting the kitchen, with subtasks, as JSON:\n",
             _obj({"title": _str(40), "priority": _enum("low", "medium", "high"),
                   "done": {"type": "boolean"},
                   "subtasks": _arr(_obj({"title": _str(40), "estimate_h": _int(0, 40)}), 3)})),
}

#: One banned string per schema request, in the order of SCHEMAS (single tokens of the
#: default model, checked at run time): content the model would otherwise use (digits,
#: words, the newline of pretty-printed JSON), never a key or punctuation the schema
#: forces: a ban there makes both sides spell the forced text with other tokens, which
#: measures tokenization detours rather than the steering a user asks for.
BANS = ["\n", "true", " the", "1", "0", "The", "2", "name"]

GREEDY_PROMPT = "The history of the printing press begins"


@dataclass(frozen=True)
class Load:
    """One row of the table: n requests at once, each made of the same fields on both sides."""

    name: str
    title: str
    requests: int
    tokens: int
    schemas: bool       # each request constrained by a JSON schema (cycling through SCHEMAS)
    ban: bool = False   # one banned token per request (BANS, cycling)

    @property
    def greedy(self) -> bool:
        return not self.schemas

    def request(self, i: int) -> tuple[str, str | None, str | None]:
        """(prompt, schema name or None, banned string or None) of request i."""
        if not self.schemas:
            return GREEDY_PROMPT, None, None
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        return SCHEMAS[name][0], name, BANS[i % len(BANS)] if self.ban else None


def loads(tokens_greedy1: int = 128, tokens_greedy8: int = 64, tokens_schema: int = 128,
          mixed: int = 64) -> list[Load]:
    return [
        Load("greedy1", f"1 request, {tokens_greedy1} tokens, greedy", 1, tokens_greedy1, False),
        Load("greedy8", f"8 concurrent, {tokens_greedy8} tokens each, greedy", 8, tokens_greedy8, False),
        Load("schema8", "8 concurrent, 8 different JSON schemas, T=0.8", 8, tokens_schema, True),
        Load("schema8_ban", "the same plus a banned token per request", 8, tokens_schema, True, True),
        Load("mixed", f"{mixed} concurrent, mixed JSON schemas, T=0.8", mixed, tokens_schema, True),
    ]


#: Sampling of the schema loads, sent to both sides (llama-server names in comments).
SCHEMA_SAMPLING = {"temperature": 0.8, "topK": 40, "topP": 0.95, "minP": 0.0,
                   "penaltyRepeat": 1.0, "penaltyLastN": 64, "penaltyFreq": 0.0,
                   "penaltyPresent": 0.0}
GREEDY_SAMPLING = {**SCHEMA_SAMPLING, "temperature": 0.0}
SEED_BASE = 1000
