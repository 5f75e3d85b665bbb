"""`clickpaca bench peer`: clickpaca against llama.cpp's llama-server on the same loads.

The headline claim of the project, measured: many sequences with their own JSON schema
and steering in one forward pass, against the server llama.cpp itself ships (built
from the same pinned source by `make peer`). Per load, one clickpaca server and two
llama-servers (the default split KV layout of `-np N`, and `--kv-unified`) are started
with the same model, threads, batch size and KV cells (N x --ctx-per-seq), then run in
alternating rounds. Reported per side: generated tokens/s (median, min, max), tokens per
request, and the checks of peer_check on every output. `measure` is the one place the
result dict is produced.
"""

from __future__ import annotations

import shlex
import time
from contextlib import ExitStack
from typing import Any

from ..common import model_path, out_dir, png, threads, with_defaults
from .llama_server import LlamaServer, PeerError, free_port, server_command
from .peer_check import summarize
from .peer_loads import BANS, GREEDY_SAMPLING, SCHEMA_SAMPLING, SCHEMAS, Load, loads
from .peer_sides import (check_clickpaca_counts, check_llama_counts, plan, run_clickpaca,
                         run_llama, schema_grammar)
from ...results.report import load_pyplot, save_figure, emit, machine
from .serve import Server
from ...results.stats import alternate, progress, ratio, summary
from ...results.table import fmt, markdown

LS_SPLIT, LS_UNIFIED = "llama-server", "llama-server --kv-unified"
CP, CP_PER_REQ = "clickpaca", "clickpaca, schema per request"
CP_JUMP = "clickpaca, jump-forward"  # schema loads: infer jumpForward (docs/GRAMMARS.md)
BATCH = 512

NOTES = [
    "tok/s = tokens of all outputs (end-of-generation tokens not counted) / wall time from "
    "handing over all requests to the last answer; prompt processing is inside it on both sides",
    "same on both sides: model, build, threads, batch 512 (-b/-ub, nBatch), KV cells N x ctx-per-seq "
    "(llama-server -c; clickpaca nCtx), f16 cache, full-size SWA cache (--swa-full; clickpaca's "
    "swaFull default), flash attention auto, no prompt cache (cache_prompt false, --cache-ram 0; "
    "reusePrefix false), continuous batching (-cb), the sampler chain penalties -> top_k -> min_p "
    "-> top_p -> temperature with the same values, and the same seed per request (1000+i)",
    "KV layout: llama-server without --kv-unified (its default when -np is given) gives each slot "
    "ctx-per-seq cells; with --kv-unified, and in clickpaca, all N x ctx-per-seq cells are shared",
    "end of generation: greedy loads run to the token limit on both sides (llama-server "
    "ignore_eos, which biases its EOG tokens to -inf; clickpaca bans the EOG tokens 1, 106, 212 "
    "with logit_bias); schema loads let both sides end when the JSON is complete",
    "schema compilation: llama-server converts the schema of every request inside the timed "
    "window; clickpaca registers each schema once before the rounds (registration time "
    "reported), and the 'schema per request' side compiles every request's schema inside the window",
]

NOT_EXPRESSIBLE = [
    "grammar position: clickpaca applies the grammar first (a forbidden token is never "
    "sampled); llama-server samples with its chain, then checks the token against the grammar "
    "and resamples with the grammar applied only if it was rejected. Identical for greedy, "
    "different distributions at T=0.8; llama-server has no request field to change it",
    "random numbers: the same seeds, but different generators (llama.cpp's std::mt19937 dist "
    "sampler, clickpaca's numpy); sampled outputs are compared by validity and length, not text",
    "JSON whitespace: llama-server's schema grammar allows newlines and indentation (json_schema "
    "has no whitespace option); clickpaca compiles schemas without free whitespace "
    "(docs/GRAMMARS.md). Pretty-printed outputs cost llama-server tokens: tokens per request shown",
]


def clickpaca_init(model: str, build: str, t: int, n: int, ctx_per_seq: int,
                   ubatch: int | None = None) -> dict[str, Any]:
    return {"modelPath": model, "build": build, "nThreads": t, "nSeqMax": n,
            "nCtx": n * ctx_per_seq, "nBatch": max(BATCH, n), "kvUnified": True,
            "swaFull": True, "flashAttn": "auto", **({"nUbatch": ubatch} if ubatch else {})}


def register_schemas(server: Server) -> list[float]:
    """Register every schema once (grammar id = its name); milliseconds per schema."""
    ms = []
    for name in SCHEMAS:
        t0 = time.perf_counter()
        server.client.grammar(name, schema_grammar(name))
        ms.append((time.perf_counter() - t0) * 1000)
    return ms


def ban_ids(ls: LlamaServer) -> dict[str, int]:
    """Token ids of the banned strings; each must be one token of the model."""
    out = {}
    for s in BANS:
        ids = ls.tokenize(s)
        if len(ids) != 1:
            raise PeerError(f"banned string {s!r} is {len(ids)} tokens of this model, not one")
        out[s] = ids[0]
    return out


def measure_load(load: Load, args: Any, model: str, t: int, commands: dict) -> dict[str, Any]:
    n, cps = load.requests, args.ctx_per_seq
    with ExitStack() as stack:
        servers = {}
        for name, unified in ((LS_SPLIT, False), (LS_UNIFIED, True)):
            port = free_port()
            cmd = server_command(model, args.build, t, n, n * cps, BATCH, unified, port, getattr(args, "ubatch", None))
            commands.setdefault(name, {})[load.name] = shlex.join(cmd)
            servers[name] = stack.enter_context(LlamaServer(cmd, port))
        progress(f"peer {load.name}: starting clickpaca (nSeqMax {n})")
        cp = stack.enter_context(Server(clickpaca_init(model, args.build, t, n, cps, getattr(args, "ubatch", None))))
        reg_ms = register_schemas(cp) if load.schemas else []
        reqs = plan(load, ban_ids(servers[LS_UNIFIED]) if load.ban else {})
        outputs: dict[str, list] = {}
        ticks: dict[str, list[int]] = {}

        def side(name: str):
            def run(r: int) -> dict[str, Any]:
                if name in servers:
                    wall, outs = run_llama(servers[name], load, reqs)
                    check_llama_counts(servers[name], outs)
                else:
                    prefix = f"r{r}_" if name == CP_PER_REQ else None
                    t0 = cp.ticks()
                    wall, outs = run_clickpaca(cp, load, reqs, prefix, jump_forward=name == CP_JUMP)
                    check_clickpaca_counts(outs)
                    ticks.setdefault(name, []).append(cp.ticks() - t0)
                outputs.setdefault(name, []).append(outs)
                return {"wall_s": wall, "tokens": sum(o.tokens for o in outs),
                        "tps": sum(o.tokens for o in outs) / wall if wall > 0 else None}
            return run

        names = [LS_SPLIT, LS_UNIFIED, CP] + ([CP_PER_REQ, CP_JUMP] if load.schemas else [])
        res = alternate({name: side(name) for name in names}, args.repeats, f"peer {load.name}")
    # after the with: closing adds what each server's exit showed
    problems = [p for s in (*servers.values(), cp) for p in s.problems]
    schemas = [SCHEMAS[r.schema][1] if r.schema else None for r in reqs]
    bans = [r.ban_id for r in reqs]
    sides = {}
    for name in names:
        rounds = outputs[name]
        flat = [o for outs in rounds for o in outs]
        checks = summarize(flat, schemas * len(rounds), bans * len(rounds))
        sides[name] = {
            "tps": summary([x["tps"] for x in res[name]]),
            "wall_s": summary([x["wall_s"] for x in res[name]]),
            "tokens_per_request": summary(checks.pop("tokens_per_request")),
            "prompt_tokens": sorted({o.prompt_tokens for o in flat if o.prompt_tokens is not None}),
            "checks": checks,
            "same_text_every_round": len({tuple(o.text for o in outs) for outs in rounds}) == 1,
            "forced_share": (sum(o.forced for o in flat) / sum(o.tokens for o in flat)
                             if sum(o.tokens for o in flat) else None),
        }
        if name in ticks:  # clickpaca: decode ticks per round, and the most one request needed
            # (its tokens less those fed as forced chunks): a round lasts at least that many
            sides[name]["ticks"] = summary(ticks[name])
            sides[name]["longest_request_ticks"] = summary([max(o.tokens - o.forced for o in outs)
                                                            for outs in rounds])
    cp_tps = sides[CP]["tps"]["median"]
    row = {"load": load.name, "title": load.title, "requests": n, "max_tokens": load.tokens,
           "schemas": load.schemas, "banned": load.ban, "sides": sides,
           "ratio_vs_unified": ratio(cp_tps, sides[LS_UNIFIED]["tps"]["median"]),
           "ratio_vs_split": ratio(cp_tps, sides[LS_SPLIT]["tps"]["median"]),
           "registration_ms": summary(reg_ms) if reg_ms else None,
           "banned_ids": sorted({b for b in bans if b is not None}), "problems": problems}
    if CP_PER_REQ in sides:
        row["ratio_per_request_vs_unified"] = ratio(sides[CP_PER_REQ]["tps"]["median"],
                                                    sides[LS_UNIFIED]["tps"]["median"])
    if CP_JUMP in sides:
        row["ratio_jump_vs_unified"] = ratio(sides[CP_JUMP]["tps"]["median"], sides[LS_UNIFIED]["tps"]["median"])
        row["ratio_jump_vs_off"] = ratio(sides[CP_JUMP]["tps"]["median"], cp_tps)
    progress(f"peer {load.name}: " + ", ".join(f"{k} {fmt(v['tps']['median'])} tok/s"
                                               for k, v in sides.items()))
    return row


def selected_loads(args: Any) -> list[Load]:
    all_loads = loads(args.tokens_greedy1, args.tokens_greedy8, args.tokens_schema, args.mixed)
    want = [w.strip() for w in (args.loads or "").split(",") if w.strip()]
    unknown = set(want) - {x.name for x in all_loads}
    if unknown:
        raise ValueError(f"--loads: unknown {sorted(unknown)}; known: {[x.name for x in all_loads]}")
    return [x for x in all_loads if not want or x.name in want]


def measure(args: Any) -> dict[str, Any]:
    """The bench's result dict (the one place it is produced)."""
    model, t = model_path(args), threads(args)
    m0 = machine()
    commands: dict[str, dict[str, str]] = {}
    rows = []
    for load in selected_loads(args):
        try:
            rows.append(measure_load(load, args, model, t, commands))
        except (RuntimeError, OSError, ValueError) as e:  # llama-server or a server failed: the
            # other loads are still measured, and the run is recorded as failed (checks.failures)
            progress(f"peer {load.name}: FAILED: {e}")
            rows.append({"load": load.name, "title": load.title, "error": f"{type(e).__name__}: {e}",
                         "problems": []})
    measured = [r for r in rows if "error" not in r]
    notes = list(NOTES) + [f"medians of {args.repeats} alternating rounds (min-max in brackets); "
                           f"ratio = clickpaca / llama-server medians"]
    for r in measured:
        for name, s in r["sides"].items():
            c = s["checks"]
            bad = {k: c[k] for k in ("errors", "invalid", "unparsed", "banned_seen",
                                     "count_mismatches") if c[k]}
            if bad:
                notes.append(f"{r['load']} / {name}: {bad}; e.g. {c['examples_bad'][:2]}")
            if not r["schemas"] and not s["same_text_every_round"]:
                notes.append(f"{r['load']} / {name}: greedy texts differed between rounds")
            if s["prompt_tokens"] != r["sides"][CP]["prompt_tokens"]:
                notes.append(f"{r['load']} / {name}: prompt tokens {s['prompt_tokens']}, clickpaca "
                             f"{r['sides'][CP]['prompt_tokens']}")
    return {"params": {"loads": [r["load"] for r in rows], "repeats": args.repeats,
                       "threads": t, "build": args.build, "model": model,
                       "ctx_per_seq": args.ctx_per_seq, "batch": BATCH,
                       "ubatch": getattr(args, "ubatch", None),
                       "greedy_sampling": GREEDY_SAMPLING, "schema_sampling": SCHEMA_SAMPLING},
            "llama_server_commands": commands, "schemas": {k: v[1] for k, v in SCHEMAS.items()},
            "machine_start": m0, "rows": rows, "notes": notes,
            "not_expressible": NOT_EXPRESSIBLE,
            "server_problems": [p for r in rows for p in r["problems"]]}


def _cell(s: dict[str, Any] | None) -> str:
    if not s or s["median"] is None:
        return "-"
    return f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def headline_table(out: dict[str, Any]) -> str:
    """The README table: llama-server --kv-unified against clickpaca."""
    rows = [(r["title"], _cell(r["sides"][LS_UNIFIED]["tps"]), _cell(r["sides"][CP]["tps"]),
             r["ratio_vs_unified"]) if "error" not in r else (r["title"], "failed", "failed", None)
            for r in out["rows"]]
    return markdown(["load", "llama-server tok/s", "clickpaca tok/s", "ratio"], rows, align="lrrr")


def table(out: dict[str, Any]) -> str:
    """Every side, tokens per request and validity."""
    rows = []
    for r in out["rows"]:
        if "error" in r:
            rows.append((r["title"], f"failed: {r['error'][:80]}", *[None] * 8))
            continue
        s = r["sides"]
        valid = (lambda c: f"{c['valid']}/{c['outputs']}" if r["schemas"] else
                 f"{c['outputs'] - c['errors']}/{c['outputs']} ok")
        rows.append((r["title"], _cell(s[LS_SPLIT]["tps"]), _cell(s[LS_UNIFIED]["tps"]),
                     _cell(s[CP]["tps"]), _cell(s[CP_PER_REQ]["tps"]) if CP_PER_REQ in s else "-",
                     r["ratio_vs_unified"], r["ratio_vs_split"],
                     f"{fmt(s[LS_UNIFIED]['tokens_per_request']['median'])} / "
                     f"{fmt(s[CP]['tokens_per_request']['median'])}",
                     f"{valid(s[LS_UNIFIED]['checks'])} / {valid(s[CP]['checks'])}",
                     f"{s[LS_UNIFIED]['checks']['pretty_printed']} / {s[CP]['checks']['pretty_printed']}"))
    return markdown(["load", "llama-server tok/s", "llama-server --kv-unified tok/s", "clickpaca tok/s",
                     "clickpaca, schema per request tok/s", "ratio vs unified", "ratio vs split",
                     "tokens/request (unified / clickpaca)", "valid (unified / clickpaca)",
                     "pretty-printed (unified / clickpaca)"], rows, align="lrrrrrrlll")


def jump_table(out: dict[str, Any]) -> str:
    """Schema loads with `jumpForward` against the same server without it and llama-server."""
    rows = []
    for r in out["rows"]:
        s = r.get("sides", {})
        if CP_JUMP not in s:
            continue
        c = s[CP_JUMP]["checks"]
        rows.append((r["title"], _cell(s[LS_UNIFIED]["tps"]), _cell(s[CP]["tps"]), _cell(s[CP_JUMP]["tps"]),
                     r["ratio_jump_vs_off"], r["ratio_jump_vs_unified"], fmt(s[CP_JUMP]["forced_share"]),
                     f"{fmt(s[CP]['ticks']['median'])} / {fmt(s[CP_JUMP]['ticks']['median'])}",
                     f"{fmt(s[CP]['longest_request_ticks']['median'])} / "
                     f"{fmt(s[CP_JUMP]['longest_request_ticks']['median'])}",
                     f"{c['valid']}/{c['outputs']}"))
    return markdown(["load", "llama-server --kv-unified tok/s", "clickpaca tok/s", "jump-forward tok/s",
                     "jump-forward / off", "jump-forward / llama-server", "forced share",
                     "ticks (off / on)", "longest request's ticks (off / on)", "valid (jump-forward)"],
                    rows, align="lrrrrrrrrl")


def registration_lines(out: dict[str, Any]) -> list[str]:
    return [f"{r['load']}: clickpaca schema registration {_cell(r['registration_ms'])} ms per schema "
            f"(8 schemas, once per server)" for r in out["rows"] if r.get("registration_ms")]


def plot(out: dict[str, Any], path) -> None:
    """Grouped bars: one group per load, one bar per side (median, min-max as error bar)."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7.4, 4.2), dpi=110)
    names = [LS_SPLIT, LS_UNIFIED, CP, CP_PER_REQ, CP_JUMP]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(out["rows"]):
            t = r.get("sides", {}).get(name, {}).get("tps")
            if t and t["median"] is not None:
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(t["median"])
                lo.append(t["median"] - t["min"])
                hi.append(t["max"] - t["median"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.set_xticks(range(len(out["rows"])), [r["load"] for r in out["rows"]])
    ax.legend(fontsize=8)
    save_figure(plt, fig, ax, path, "load", "generated tokens/s (all requests)",
          f"clickpaca vs llama-server, {out['params']['threads']} threads, "
          f"{out['params']['repeats']} rounds")


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args, repeats=5, tokens_greedy1=128, tokens_greedy8=64, tokens_schema=128,
                         mixed=64, ctx_per_seq=512)
    out = measure(args)
    for name, cmds in out["llama_server_commands"].items():
        for load, cmd in cmds.items():
            print(f"{load}: {cmd}")
    emit(out_dir(args), "peer", out, table(out), "clickpaca against llama-server (tokens/s)")
    print("headline (README):\n")
    print(headline_table(out))
    jump = jump_table(out)
    if jump.count("\n") > 1:
        print("\njump-forward (infer jumpForward):\n")
        print(jump)
    for line in registration_lines(out) + [f"not comparable: {x}" for x in NOT_EXPRESSIBLE]:
        print(f"\n- {line}")
    if args.plot:
        plot(out, png(args, "peer"))
    return out


__all__ = ["measure", "run", "table", "headline_table", "jump_table"]
