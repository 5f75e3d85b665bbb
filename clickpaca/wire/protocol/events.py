"""The events: one constructor per event type; the engine and the servers build events
only through them. EVENTS maps each type to its constructor; END_EVENTS are the types
that answer a request on its seq_id (the last event a client waits for there;
endings.py holds the same set for the client, checked here at import).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import orjson

from .. import endings as _endings


EVENTS: dict[str, Callable[..., dict]] = {}
END_EVENTS: set[str] = set()


def _event(kind: str, ends: bool = False) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    def register(make: Callable[..., dict]) -> Callable[..., dict]:
        EVENTS[kind] = make
        if ends:
            END_EVENTS.add(kind)
        return make
    return register


@_event("ready")
def ready_event(**fields: Any) -> dict:
    """The answer to `init`: what was loaded (runtime.py names the fields)."""
    return {"type": "ready", **fields}


@_event("grammar_ready")
def grammar_ready_event(grammar_id: str, enforced: bool | None = None,
                        ignored: list[dict] | None = None) -> dict:
    """A grammar registered; for a JSON schema, whether it is ``enforced`` whole and what
    is not (``ignored``: path, keyword, reason each; docs/GRAMMARS.md)."""
    ev: dict[str, Any] = {"type": "grammar_ready", "id": grammar_id}
    if enforced is not None:
        ev["enforced"] = enforced
    if ignored is not None:
        ev["ignored"] = list(ignored)
    return ev


@_event("vector_ready")
def vector_ready_event(vector_id: str, slot: int, layers: list[int], norms: dict, reserves: int) -> dict:
    """A steering vector registered: its slot, its layers, each layer's norm, and how often
    the steering has re-reserved the graph so far (activations/steering.py)."""
    return {"type": "vector_ready", "id": vector_id, "slot": slot, "layers": layers, "norms": norms,
            "reserves": reserves}


@_event("vector_freed")
def vector_freed_event(vector_id: str) -> dict:
    return {"type": "vector_freed", "id": vector_id}


@_event("token")
def token_event(seq_id: int, token: int, piece: str, logprobs: dict | None = None,
                forced: bool = False) -> dict:
    """One generated token; with nProbs, ``logprobs`` holds logprob, top, steered_logprob
    and steered_top; ``forced``: the grammar forced it and it was fed in a jump-forward
    chunk (the field is present only then)."""
    ev: dict[str, Any] = {"type": "token", "seq_id": seq_id, "token": token, "piece": piece}
    if forced:
        ev["forced"] = True
    if logprobs is not None:
        ev.update(logprobs)
    return ev


@_event("done", ends=True)
def done_event(seq_id: int, stop_reason: str, stop: str | None = None, request: str | None = None,
               **stats: Any) -> dict:
    """The end of an infer (``stats``: tokens_prompt, tokens_reused, tokens_predicted,
    prompt_ms, eval_ms, prompt_tps, eval_tps), or of a cancelled score or prefill (its
    ``request`` instead)."""
    ev: dict[str, Any] = {"type": "done", "seq_id": seq_id, **stats, "stop_reason": stop_reason}
    if stop is not None:
        ev["stop"] = stop
    if request is not None:
        ev["request"] = request
    return ev


@_event("error", ends=True)
def error_event(message: str, seq_id: int = -1, request: str | None = None) -> dict:
    ev: dict[str, Any] = {"type": "error", "seq_id": seq_id, "message": message}
    if request:
        ev["request"] = request
    return ev


@_event("scored", ends=True)
def scored_event(seq_id: int, nll: list[float], windows: int, per_token: bool,
                 capture: dict | None = None, lens: dict | None = None) -> dict:
    """The mean negative log-likelihood of the scored tokens and its perplexity (and the
    request's `capture`, when it asked)."""
    mean = float(np.mean(nll)) if nll else float("nan")
    ev: dict[str, Any] = {"type": "scored", "seq_id": seq_id, "tokens": len(nll), "nll": mean,
                          "ppl": float(np.exp(mean)), "windows": windows}
    if per_token:
        ev["token_nll"] = [round(x, 6) for x in nll]
    if capture is not None:
        ev["capture"] = capture
    if lens is not None:
        ev["lens"] = lens
    return ev


@_event("prefilled", ends=True)
def prefilled_event(seq_id: int, tokens: int, prompt_ms: float, capture: dict | None = None) -> dict:
    ev = {"type": "prefilled", "seq_id": seq_id, "tokens": tokens, "prompt_ms": round(prompt_ms, 3)}
    if capture is not None:
        ev["capture"] = capture
    return ev


@_event("forked", ends=True)
def forked_event(seq_id: int, dst_seq_id: int, tokens: int) -> dict:
    return {"type": "forked", "seq_id": seq_id, "dst_seq_id": dst_seq_id, "tokens": tokens}


@_event("saved", ends=True)
def saved_event(seq_id: int, path: str, n_bytes: int, tokens: int) -> dict:
    return {"type": "saved", "seq_id": seq_id, "path": path, "bytes": n_bytes, "tokens": tokens}


@_event("loaded", ends=True)
def loaded_event(seq_id: int, tokens: int) -> dict:
    return {"type": "loaded", "seq_id": seq_id, "tokens": tokens}


@_event("freed", ends=True)
def freed_event(seq_id: int) -> dict:
    return {"type": "freed", "seq_id": seq_id}


@_event("stats")
def stats_event(**fields: Any) -> dict:
    """The answer to `stats`: ticks so far, rssBytes, every cache with its bounds, logitsRows."""
    return {"type": "stats", **fields}


def encode(event: dict) -> bytes:
    """One event as one line (orjson: compact, UTF-8; non-finite floats become null)."""
    return orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


if END_EVENTS != _endings.END_EVENTS:  # an ending event added here needs its row there
    raise ImportError(f"protocol END_EVENTS {sorted(END_EVENTS)} differ from endings.py's "
                      f"{sorted(_endings.END_EVENTS)}")
