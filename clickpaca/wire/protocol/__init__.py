"""The NDJSON protocol: one JSON object per line in each direction, a line to a typed
request with every check that needs only the request, and the events back.

- checks.py: the protocol's own field checks and the limits they enforce;
- declare.py: how a request type is declared (`wire`), `Request`, REQUESTS (the field table);
- requests.py: the request types, one frozen dataclass each, and their checks across fields;
- parse.py: `parse_line` and `validate`, `ProtocolError` naming the wire field and the reason;
- events.py: one constructor per event type, EVENTS, END_EVENTS, `encode`.

This package is the protocol's one public face: callers import from here. Checks that
need the server's state (is the seq_id active, does the grammar exist) are the engine's
handlers'. docs/PROTOCOL.md is the user-facing description; tests/test_protocol_doc.py
runs its examples.
"""

from .checks import (CAPTURE_DEFAULT, CAPTURE_DTYPES, CAPTURE_TOKENS, MAX_CAPTURE_NODES, MAX_GRAMMAR_BYTES,
                     MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_NUMBER_DIGITS, MAX_PROMPT_BYTES, MAX_RPC_SERVERS,
                     MAX_SCORE_BYTES, MAX_STOP_BYTES, MAX_STOPS, MAX_TEMPLATE_BYTES, MAX_THREADS, SEQ,
                     sampler_fields)
from .declare import REQUEST_TYPES, REQUESTS, Request, request_type, wire, with_params
from .events import (END_EVENTS, EVENTS, done_event, encode, error_event, forked_event, freed_event,
                     grammar_ready_event, loaded_event, prefilled_event, ready_event, saved_event,
                     scored_event, stats_event, token_event, vector_freed_event,
                     vector_ready_event)
from .parse import MAX_JSON_DEPTH, MAX_LINE_BYTES, ProtocolError, json_depth, parse_line, validate
from .requests import (CancelRequest, ForkRequest, FreeRequest, GrammarRequest, InferRequest, InitRequest,
                       LoadRequest, PrefillRequest, QuitRequest, SaveRequest, ScoreRequest, StatsRequest,
                       VectorRequest)

__all__ = ["CAPTURE_DEFAULT", "CAPTURE_DTYPES", "CAPTURE_TOKENS", "END_EVENTS", "EVENTS", "MAX_CAPTURE_NODES",
           "MAX_GRAMMAR_BYTES", "MAX_JSON_DEPTH", "MAX_LINE_BYTES", "MAX_LOGIT_BIAS", "MAX_MESSAGES",
           "MAX_NUMBER_DIGITS", "MAX_PROMPT_BYTES", "MAX_RPC_SERVERS", "MAX_SCORE_BYTES", "MAX_STOP_BYTES",
           "MAX_STOPS", "MAX_TEMPLATE_BYTES", "MAX_THREADS", "REQUESTS", "REQUEST_TYPES", "SEQ", "CancelRequest",
           "ForkRequest", "FreeRequest", "GrammarRequest", "InferRequest", "InitRequest", "LoadRequest",
           "PrefillRequest", "ProtocolError", "QuitRequest", "Request", "SaveRequest", "ScoreRequest",
           "StatsRequest", "done_event", "encode", "error_event", "forked_event", "freed_event",
           "grammar_ready_event", "json_depth", "loaded_event", "parse_line", "prefilled_event", "ready_event",
           "request_type", "sampler_fields", "saved_event", "scored_event", "stats_event", "token_event",
           "validate", "wire", "with_params", "VectorRequest", "vector_freed_event",
           "vector_ready_event"]
