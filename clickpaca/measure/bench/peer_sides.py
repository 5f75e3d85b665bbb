"""One timed run of a load on each side: the same requests, as each side spells them.

Timing is the same on both sides: from the moment every request has been handed over
(one write to clickpaca; a barrier releasing one HTTP thread per request to
llama-server) to the arrival of the last answer. Throughput = tokens of all outputs
(end-of-generation tokens not counted) / that wall time: prompt processing and, in the
per-request registration variant, grammar compilation are inside it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import orjson

from .llama_server import LlamaServer
from .peer_check import Output
from .peer_loads import GREEDY_SAMPLING, SCHEMA_SAMPLING, SCHEMAS, SEED_BASE, Load
from .serve import EOG_TOKENS, Server

#: clickpaca's default chain is penalties -> top_k -> min_p -> top_p -> temperature (after
#: the grammar and logit_bias); llama-server is sent the same order.
LLAMA_SAMPLERS = ["penalties", "top_k", "min_p", "top_p", "temperature"]


@dataclass(frozen=True)
class Req:
    prompt: str
    schema: str | None
    ban_id: int | None
    seed: int


def plan(load: Load, ban_ids: dict[str, int]) -> list[Req]:
    out = []
    for i in range(load.requests):
        prompt, schema, ban = load.request(i)
        out.append(Req(prompt, schema, ban_ids[ban] if ban is not None else None, SEED_BASE + i))
    return out


def schema_grammar(name: str) -> str:
    return "%json_schema " + json.dumps(SCHEMAS[name][1])


# ------------------------------------------------------------------ clickpaca


def clickpaca_infer(load: Load, req: Req) -> dict[str, Any]:
    s = GREEDY_SAMPLING if load.greedy else SCHEMA_SAMPLING
    bias = [{"token": t, "bias": -1e9} for t in EOG_TOKENS] if load.greedy else []
    if req.ban_id is not None:
        bias.append({"token": req.ban_id, "bias": -1e9})
    return {"maxTokens": load.tokens, "reusePrefix": False, "seed": req.seed, **s,
            **({"logit_bias": bias} if bias else {})}


def run_clickpaca(server: Server, load: Load, reqs: list[Req],
                  register_per_request: str | None = None,
                  jump_forward: bool = False) -> tuple[float, list[Output]]:
    """register_per_request: a prefix for fresh grammar ids, each request's schema then
    compiled in the timed window (a grammar line right before its infer line).
    jump_forward: the requests' `jumpForward` (a grammar's forced tokens as one chunk)."""
    c = server.client
    lines = []
    for sid, r in enumerate(reqs):
        fields = clickpaca_infer(load, r)
        if jump_forward:
            fields["jumpForward"] = True
        if r.schema is not None:
            gid = r.schema if register_per_request is None else f"{register_per_request}{sid}"
            if register_per_request is not None:
                lines.append(orjson.dumps({"type": "grammar", "id": gid,
                                           "grammar": schema_grammar(r.schema)}))
            fields["grammar_id"] = gid
        lines.append(orjson.dumps({"type": "infer", "seq_id": sid, "prompt": r.prompt, **fields}))
    t0 = time.perf_counter()
    c.send_raw(b"\n".join(lines) + b"\n")
    outs, t_end = [], t0
    for sid in range(len(reqs)):
        ids, pieces, final = [], [], {}
        for ev in c.stream(sid, 3600):
            if ev["type"] == "token":
                ids.append(ev["token"])
                pieces.append(ev["piece"])
            else:
                final = ev
        t_end = max(t_end, final.get("_t", t_end))
        if final.get("type") != "done":
            outs.append(Output("", [], "error", error=str(final.get("message", final))))
            continue
        stop = {"max_tokens": "limit"}.get(final["stop_reason"], final["stop_reason"])
        o = Output("".join(pieces), ids, stop, final.get("tokens_prompt"),
                   final.get("tokens_predicted"), forced=final.get("forced_tokens", 0))
        outs.append(o)
    if register_per_request is not None:
        for _ in range(sum(r.schema is not None for r in reqs)):
            c.wait_misc({"grammar_ready"}, 60)
    return t_end - t0, outs


# ------------------------------------------------------------------ llama-server


def llama_body(load: Load, req: Req) -> dict[str, Any]:
    s = GREEDY_SAMPLING if load.greedy else SCHEMA_SAMPLING
    body: dict[str, Any] = {
        "prompt": req.prompt, "n_predict": load.tokens, "temperature": s["temperature"],
        "top_k": s["topK"], "top_p": s["topP"], "min_p": s["minP"],
        "repeat_penalty": s["penaltyRepeat"], "repeat_last_n": s["penaltyLastN"],
        "presence_penalty": s["penaltyPresent"], "frequency_penalty": s["penaltyFreq"],
        "seed": req.seed, "samplers": LLAMA_SAMPLERS, "cache_prompt": False,
        "return_tokens": True, "stream": False,
        # greedy loads run to n_predict: llama-server bans its EOG tokens, as clickpaca's
        # logit_bias does with the model's EOG set
        "ignore_eos": load.greedy,
    }
    if req.schema is not None:
        body["json_schema"] = SCHEMAS[req.schema][1]
    if req.ban_id is not None:
        body["logit_bias"] = [[req.ban_id, False]]
    return body


def run_llama(ls: LlamaServer, load: Load, reqs: list[Req]) -> tuple[float, list[Output]]:
    t0, answers = ls.complete_all([llama_body(load, r) for r in reqs])
    t_end = max(a["_t"] for a in answers)
    outs = []
    for a in answers:
        if "error" in a:
            outs.append(Output("", [], "error", error=a["error"]))
            continue
        stop = {"eos": "eos", "limit": "limit", "word": "stop"}.get(a.get("stop_type"), str(a.get("stop_type")))
        ids = list(a.get("tokens") or [])
        # llama-server returns (and counts) the sampled end-of-generation token; clickpaca
        # emits no event for it. Neither side's count includes it here.
        eog = stop == "eos" and bool(ids) and ids[-1] in EOG_TOKENS
        outs.append(Output(a["content"], ids[:-1] if eog else ids, stop, a.get("tokens_evaluated"),
                           a.get("tokens_predicted"), eog_returned=eog))
    return t_end - t0, outs


def check_llama_counts(ls: LlamaServer, outs: list[Output]) -> None:
    """llama-server's tokens_predicted against the token ids it returned (both include a
    sampled end-of-generation token, which run_llama takes off the output), and the ids
    against its text (/detokenize). Mismatches are noted on the output."""
    for o in outs:
        if o.error:
            continue
        expected = o.tokens + (1 if o.eog_returned else 0)
        if o.reported_tokens != expected:
            o.notes.append(f"tokens_predicted {o.reported_tokens}, {o.tokens} ids returned "
                           f"(stop {o.stop})")
        text = ls.detokenize(o.token_ids) if o.token_ids else ""
        if text != o.text:
            o.notes.append(f"detokenized ids differ from content: {text[:60]!r} vs {o.text[:60]!r}")


def check_clickpaca_counts(outs: list[Output]) -> None:
    """clickpaca's done.tokens_predicted against its token events (neither counts EOG)."""
    for o in outs:
        if not o.error and o.reported_tokens != o.tokens:
            o.notes.append(f"tokens_predicted {o.reported_tokens}, {o.tokens} token events")
