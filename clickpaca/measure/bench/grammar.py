"""`clickpaca bench grammar`: constrained vs unconstrained decoding at 1, 8, 64 sequences.

The three grammar formats the server accepts (JSON schema, llguidance Lark, GBNF), each
written so it cannot end within the requested tokens (a JSON array with minItems, a
repetition of lines), against the same sampler chain without a grammar. Every side
bans end-of-generation tokens and uses the same per-sequence seeds. Reported: aggregate
generated tokens/s (generation phase, as in `bench batch`) and the ratio
constrained / unconstrained (goal >= 0.9). A grammar that ends early is reported.

Then, in-process, the cost of the masks alone: time per mask per sequence with every
matcher filled one after another (serial) and with llguidance's thread pool (parallel),
on the same matcher states, alternating which goes first; each step then advances every
matcher by a random allowed token. This is what PARALLEL_MIN_BATCH in grammars/grammar_engine.py is
tuned from.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from .batch import server_init
from ..common import model_path, out_dir, png, threads, with_defaults
from ...results.report import emit, machine, plot_lines
from .serve import Server, group_stats, run_group
from ...results.stats import alternate, median, parse_list, progress, ratio, summary
from ...results.table import markdown

DEFAULT_SEQS = "1,8,64"
PROMPT = "Here is a long list of records, one after another:\n"

JSON_SCHEMA = {
    "type": "array", "minItems": 500,
    "items": {"type": "object", "additionalProperties": False,
              "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                             "city": {"type": "string"}}},
}

GRAMMARS = {
    "json_schema": "%json_schema " + json.dumps(JSON_SCHEMA),
    "lark": "%llguidance {}\n"
            "start: line+\n"
            "line: WORD (\" \" WORD)* \".\\n\"\n"
            "WORD: /[A-Za-z]+/\n",
    "gbnf": "root ::= line+\n"
            "line ::= word (\" \" word)* \".\\n\"\n"
            "word ::= [a-zA-Z]+\n",
}


def measure(args: Any) -> dict[str, Any]:
    seqs = parse_list(args.seqs or DEFAULT_SEQS)
    g, t, model = args.tokens, threads(args), model_path(args)
    m0 = machine()
    progress(f"grammar: starting the server (nSeqMax {max(seqs)})")
    server = Server(server_init(model, args.build, t, max(seqs), 16, g))
    bias = server.ban_eog()
    for gid, text in GRAMMARS.items():
        server.client.grammar(gid, text)
    rows = []
    try:
        for n in seqs:
            per_seq = [{"seed": 1000 + i} for i in range(n)]

            def side(gid: str | None, n=n, per_seq=per_seq):
                params = {"maxTokens": g, "reusePrefix": False, **bias}
                if gid:
                    params["grammar_id"] = gid
                return lambda r: group_stats(run_group(server, [PROMPT] * n, params, per_seq=per_seq))

            sides = {"unconstrained": side(None), **{gid: side(gid) for gid in GRAMMARS}}
            res = alternate(sides, args.repeats, f"grammar N={n}")
            base = median([x["wall_tps"] for x in res["unconstrained"]])
            for name, runs in res.items():
                tps = [x["wall_tps"] for x in runs]
                stops = {}
                for x in runs:
                    for k, v in x["stop_reasons"].items():
                        stops[k] = stops.get(k, 0) + v
                short = sorted({k for x in runs for k in x["tokens"] if k != g})
                errors = [e for x in runs for e in x["errors"]]
                rows.append({"seqs": n, "grammar": name, "tps": summary(tps),
                             "latency_ms": summary([x["latency_per_token_ms"] for x in runs]),
                             "ratio": None if name == "unconstrained" else ratio(median(tps), base),
                             "stop_reasons": stops, "ended_early": bool(short), "short_lengths": short,
                             "errors": errors[:3]})
            progress(f"grammar N={n}: " + ", ".join(f"{r['grammar']} {r['tps']['median']}"
                                                     for r in rows if r["seqs"] == n))
    finally:
        server.close()
    notes = [f"ratio = constrained / unconstrained generated tokens/s (medians of {args.repeats} "
             "alternating rounds, default sampler chain, seeds 1000+i); goal >= 0.9"]
    for r in rows:
        if r["ended_early"]:
            notes.append(f"{r['grammar']} at N={r['seqs']} ENDED EARLY: lengths {r['short_lengths']}, "
                         f"stop reasons {r['stop_reasons']}")
        if r["errors"]:
            notes.append(f"{r['grammar']} at N={r['seqs']}: errors {r['errors']}")
    progress("grammar: mask times in-process")
    masks = mask_timings(model, args.build, seqs)
    notes.append("mask us = time to fill one sequence's mask (median over steps), all matchers "
                 "serially vs llguidance's parallel fill, on the same states")
    return {"params": {"seqs": seqs, "tokens": g, "threads": t, "repeats": args.repeats,
                       "build": args.build, "model": model, "prompt": PROMPT},
            "grammars": GRAMMARS, "machine_start": m0, "rows": rows, "mask_rows": masks,
            "notes": notes, "server_problems": server.problems}


def mask_timings(model_path: str, build: str, seqs: list[int]) -> list[dict[str, Any]]:
    """Per grammar and batch size: median microseconds per mask, serial vs parallel."""
    from ...llama.core import Model
    from ...grammar.grammars import PARALLEL_MIN_BATCH, GrammarEngine, allowed_ids

    model = Model(model_path, build=build)
    engine = None
    try:
        engine = GrammarEngine.start(model)
        engine.wait()
        is_eog = np.zeros(model.n_vocab, bool)
        is_eog[np.asarray(model.eog_tokens, np.int64)] = True
        out = []
        for name, text in GRAMMARS.items():
            grammar = engine.compile(text)
            for batch in seqs:
                rng = np.random.default_rng(7)
                matchers = [grammar.new_matcher() for _ in range(batch)]
                bitmask = engine.allocate_bitmask(batch)
                times: dict[bool, list[float]] = {False: [], True: []}
                for step in range(9 if batch < 64 else 5):
                    for parallel in ((False, True) if step % 2 else (True, False)):
                        t0 = time.perf_counter()
                        engine.fill_masks(matchers, bitmask, parallel=parallel)
                        times[parallel].append((time.perf_counter() - t0) / batch * 1e6)
                    for i, m in enumerate(matchers):
                        ids = allowed_ids(bitmask[i])
                        ids = ids[~is_eog[ids]]
                        if not ids.size or not m.consume(int(rng.choice(ids))):
                            matchers[i] = grammar.new_matcher()
                out.append({"grammar": name, "seqs": batch, "serial_us": summary(times[False]),
                            "parallel_us": summary(times[True]),
                            "parallel_min_batch": PARALLEL_MIN_BATCH})
                progress(f"grammar masks {name} N={batch}: {out[-1]['serial_us']['median']:.1f} / "
                         f"{out[-1]['parallel_us']['median']:.1f} us")
    finally:
        if engine is not None:
            engine.wait(None)
        model.close()
    return out


def table(out: dict[str, Any]) -> str:
    rows = [(r["seqs"], r["grammar"], r["tps"]["median"], r["ratio"], r["latency_ms"]["median"],
             "yes" if r["ended_early"] else "no") for r in out["rows"]]
    decoding = markdown(["seqs", "grammar", "tok/s", "ratio vs unconstrained", "ms/token/seq",
                         "ended early"], rows, align="rlrrrl")
    masks = [(r["seqs"], r["grammar"], r["serial_us"]["median"], r["parallel_us"]["median"])
             for r in out.get("mask_rows", [])]
    return decoding + "\n\n" + markdown(["seqs", "grammar", "mask us serial", "mask us parallel"],
                                          masks, align="rlrr")


def plot(out: dict[str, Any], path) -> None:
    series = {}
    for r in out["rows"]:
        xs, ys = series.setdefault(r["grammar"], ([], []))
        xs.append(r["seqs"])
        ys.append(r["tps"]["median"])
    plot_lines(path, series, "sequences decoded together", "generated tokens/s (all sequences)",
               f"Constrained decoding, G={out['params']['tokens']}", logx=True)


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args)
    out = measure(args)
    emit(out_dir(args), "grammar", out, table(out), "Constrained decoding (tokens/s)")
    if args.plot:
        plot(out, png(args, "grammar"))
    return out
