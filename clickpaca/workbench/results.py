"""Typed results built from the server's raw events: one Generation per infer, one
Score per score request, and lists of them that turn into plain rows (or a DataFrame).

A result is made from exactly the events that answered its request, so every field
can be checked against them (tests/test_workbench_results.py does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, Iterable, TypeVar


@dataclass
class Generation:
    """What one infer request produced.

    text/tokens/pieces: the generated tokens in order (end-of-generation tokens are
      never emitted, so they are absent here too).
    logprobs/top: with nProbs, the raw model's log-probability of each chosen token and
      its n best alternatives ({token, piece, logprob}); None without nProbs.
    steered_logprobs/steered_top: the same in the distribution actually sampled from.
    stop_reason: as in the `done` event; None when the request ended in an error.
    steps_ms: CPU time of the user-defined steps (clickpaca.sampling.usersteps) by name, from `done`.
    ttft_ms: time from sending the request to the arrival of its first token, measured
      on the client (None without a token); wall_ms: to the arrival of its end.
    error: the server's message when the request ended in an `error` event.
    """

    index: int
    request: dict[str, Any]
    label: str | None = None
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: list[list[dict[str, Any]]] | None = None
    steered_logprobs: list[float | None] | None = None
    steered_top: list[list[dict[str, Any]]] | None = None
    stop_reason: str | None = None
    stop: str | None = None
    tokens_prompt: int | None = None
    tokens_reused: int | None = None
    tokens_predicted: int | None = None
    prompt_ms: float | None = None
    eval_ms: float | None = None
    prompt_tps: float | None = None
    eval_tps: float | None = None
    ttft_ms: float | None = None
    wall_ms: float | None = None
    steps_ms: dict[str, float] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_events(cls, index: int, request: dict[str, Any], events: list[dict[str, Any]],
                    t_sent: float | None = None, label: str | None = None) -> "Generation":
        """The result of one request from its events (token events, then one done or error).
        `_t` on an event is its arrival time (perf_counter), when the client stamped it."""
        g = cls(index=index, request=request, label=label)
        toks = [e for e in events if e.get("type") == "token"]
        g.tokens = [int(e["token"]) for e in toks]
        g.pieces = [e["piece"] for e in toks]
        g.text = "".join(g.pieces)
        if toks and all("logprob" in e for e in toks):
            g.logprobs = [e["logprob"] for e in toks]
            g.top = [e.get("top") or [] for e in toks]
            g.steered_logprobs = [e.get("steered_logprob") for e in toks]
            g.steered_top = [e.get("steered_top") or [] for e in toks]
        final = next((e for e in reversed(events) if e.get("type") != "token"), None)
        if final is not None and final.get("tail"):
            g.text += final["tail"]  # an unfinished character's bytes (PROTOCOL.md, done)
        if final is None or final.get("type") == "closed":
            g.error = "the server closed the connection before the request ended"
        elif final["type"] == "error":
            g.error = final.get("message") or "error"
        else:
            for k in ("stop_reason", "stop", "tokens_prompt", "tokens_reused", "tokens_predicted",
                      "prompt_ms", "eval_ms", "prompt_tps", "eval_tps", "steps_ms"):
                setattr(g, k, final.get(k))
        if t_sent is not None:
            if toks and "_t" in toks[0]:
                g.ttft_ms = (toks[0]["_t"] - t_sent) * 1000
            if final is not None and "_t" in final:
                g.wall_ms = (final["_t"] - t_sent) * 1000
        return g

    def record(self) -> dict[str, Any]:
        """One plain row: the request's prompt and steering, the text, counts and timings
        (token lists stay out of it; they are on the object)."""
        req = {k: v for k, v in self.request.items() if k not in ("type", "seq_id")}
        row: dict[str, Any] = {"index": self.index}
        prompt = req.pop("prompt", None)
        messages = req.pop("messages", None)
        row["prompt"] = prompt if prompt is not None else _messages_text(messages)
        row["steering"] = self.label if self.label is not None else _steering_label(req)
        row.update({k: getattr(self, k) for k in (
            "text", "stop_reason", "tokens_prompt", "tokens_reused", "tokens_predicted", "prompt_ms",
            "eval_ms", "prompt_tps", "eval_tps", "ttft_ms", "wall_ms", "error")})
        row["mean_logprob"] = (sum(self.logprobs) / len(self.logprobs)) if self.logprobs else None
        for name, ms in (self.steps_ms or {}).items():
            row[f"step_ms:{name}"] = ms
        return row


@dataclass
class Score:
    """What one score request produced: the negative log-likelihood of a text."""

    index: int
    text: str
    tokens: int | None = None
    nll: float | None = None
    ppl: float | None = None
    windows: int | None = None
    token_nll: list[float] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_events(cls, index: int, text: str, events: list[dict[str, Any]],
                    t_sent: float | None = None) -> "Score":
        s = cls(index=index, text=text)
        final = events[-1] if events else None
        if final is None or final.get("type") == "closed":
            s.error = "the server closed the connection before the request ended"
        elif final["type"] != "scored":
            s.error = final.get("message") or f"ended with {final['type']}"
        else:
            s.tokens, s.nll, s.ppl = final["tokens"], final["nll"], final["ppl"]
            s.windows, s.token_nll = final["windows"], final.get("token_nll")
        return s

    def record(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("token_nll")
        return row


R = TypeVar("R", Generation, Score)


class Results(list, Generic[R]):
    """A list of results in input order, with `to_records()` and `to_pandas()`."""

    def __init__(self, items: Iterable[R] = (), **meta: Any) -> None:
        super().__init__(items)
        self.meta = meta

    def to_records(self) -> list[dict[str, Any]]:
        return [r.record() for r in self]

    def to_pandas(self):
        """A pandas DataFrame of `to_records()` (pandas is the optional `pandas` extra)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("to_pandas needs pandas: pip install 'clickpaca[pandas]'") from e
        return pd.DataFrame.from_records(self.to_records())

    @property
    def errors(self) -> list[R]:
        return [r for r in self if r.error is not None]


def _messages_text(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return None
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages if isinstance(m, dict))


def _steering_label(params: dict[str, Any]) -> str:
    """The steering of a request as one short, stable string (for grouping rows)."""
    parts = []
    for k in sorted(params):
        v = params[k]
        if isinstance(v, float) and math.isfinite(v):
            v = f"{v:g}"
        elif isinstance(v, (list, dict)):
            v = f"<{type(v).__name__} of {len(v)}>"
        parts.append(f"{k}={v}")
    return " ".join(parts)
