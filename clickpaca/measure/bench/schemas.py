"""`clickpaca bench schemas DIR|PACKAGE`: a corpus of real-world JSON schemas, here and in
llama-server.

The corpus is a directory of schema files or one shipped in an installed package
(measure/schemas.py; `--limit` takes an evenly spread subset, `--max-bytes` leaves out large
files). Reported: how many compile in-process (by default, with `lenient`, enforced whole)
and in how long, and how many llama-server's converter accepts; the mask time per token,
walking each matcher with random allowed tokens; and generation at each of --seqs sequences,
clickpaca and llama-server alternating on the same model, build and KV cells: tokens/s and,
per output, finished, cut or valid, every output of both sides checked by the same validator
(grammar/schema_check.py), with clickpaca's own `done.schemaValid` compared to it; every
output's repeated keys are counted, and the repeated-key ban (grammar/json_keys.py) is
timed apart from llguidance's mask. `--no-peer` runs clickpaca alone.
Schemas that compile here only with `lenient` are registered so; llama-server gets each
schema as given. Results: docs/GRAMMARS.md, "Real-world schemas".
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import numpy as np

from ..common import model_path, out_dir, threads, with_defaults
from ..schemas import load, pick, versions
from .llama_server import LlamaServer, PeerError, free_port, server_command
from .serve import Server
from ...grammar.json_keys import repeated_keys
from ...grammar.schema_check import SchemaCheck
from ...wire.protocol import MAX_GRAMMAR_BYTES
from ...results.report import emit, machine
from ...results.stats import parse_list, progress, summary
from ...results.table import fmt, markdown

BATCH = 512
TEMPERATURE = 0.6
SEED_BASE = 1000


def prompt_for(name: str) -> str:
    """The same prompt on both sides: a chat turn asking for a document of that kind."""
    kind = name.rsplit("/", 1)[-1].removesuffix(".json")
    return (f"<start_of_turn>user\nWrite a short example {kind} document as JSON."
            f"<end_of_turn>\n<start_of_turn>model\n")


def p99(xs: list[float]) -> float | None:
    return float(np.percentile(xs, 99)) if xs else None


def _dist(xs: list[float]) -> dict[str, Any]:
    return {"median": float(np.median(xs)) if xs else None, "p99": p99(xs), "n": len(xs)}


# ------------------------------------------------------------------ in-process


def compile_and_masks(corpus: list, model: str, build: str, tokens: int) -> list[dict]:
    """Per schema: default and lenient compile outcome and time, coverage, mask times."""
    from ...grammar.grammars import GrammarEngine, GrammarError, allowed_ids
    from ...llama.core import Model

    m = Model(model, build=build)
    engine = None
    rows = []
    try:
        engine = GrammarEngine(m)
        is_eog = np.zeros(m.n_vocab, bool)
        is_eog[np.asarray(m.eog_tokens, np.int64)] = True
        rng = np.random.default_rng(7)
        for s in corpus:
            text = "%json_schema " + json.dumps(s.schema)
            row: dict[str, Any] = {"name": s.name, "bytes": s.size}
            compiled = None
            for mode in ("default", "lenient"):
                t0 = time.perf_counter()
                if len(text.encode()) > MAX_GRAMMAR_BYTES:  # the server's edge refuses it unread
                    row[mode] = {"ok": False, "ms": 0.0, "error": f"grammar: {len(text.encode())} bytes, "
                                 f"the limit is {MAX_GRAMMAR_BYTES}"}
                    continue
                try:
                    g = engine.compile(text, lenient=mode == "lenient")
                    row[mode] = {"ok": True, "ms": (time.perf_counter() - t0) * 1000,
                                 "enforced": g.enforced,
                                 "ignored": [i.as_dict() for i in g.ignored]}
                    compiled = compiled or g
                except GrammarError as e:
                    row[mode] = {"ok": False, "ms": (time.perf_counter() - t0) * 1000,
                                 "error": str(e)[:200]}
            row["registered"] = ("default" if row["default"]["ok"] else
                                 "lenient" if row["lenient"]["ok"] else None)
            masks, bans, cpu = [], [], []
            if compiled is not None:
                matcher = compiled.new_matcher()
                mask = engine.allocate_bitmask(1)
                for _ in range(tokens):
                    keys, matcher.keys = matcher.keys, None  # llguidance's mask alone, then the ban
                    t0, c0 = time.perf_counter(), time.thread_time()
                    engine.fill_masks([matcher], mask)
                    t1, c1 = time.perf_counter(), time.thread_time()
                    masks.append((t1 - t0) * 1e6)
                    ban_cpu = None
                    if keys is not None:
                        keys.ban(mask[0])
                        bans.append((time.perf_counter() - t1) * 1e6)
                        ban_cpu = (time.thread_time() - c1) * 1e6
                    cpu.append(((c1 - c0) * 1e6, ban_cpu))
                    matcher.keys = keys
                    ids = allowed_ids(mask[0], m.n_vocab)
                    ids = ids[~is_eog[ids]]
                    if not ids.size or not matcher.consume(int(rng.choice(ids))) or matcher.is_stopped():
                        break
            row["mask_us"], row["ban_us"], row["cpu_us"] = masks, bans, cpu
            rows.append(row)
            progress(f"schemas compile {s.name}: {row['registered'] or 'refused'} "
                     f"{row['default']['ms']:.0f} ms, {len(masks)} masks")
    finally:
        if engine is not None:
            engine.wait(None)
        m.close()
    return rows


# ------------------------------------------------------------------ the two servers


def _check(check: SchemaCheck, text: str) -> bool | None:
    return check.check(text)["schemaValid"]


#: The sides: clickpaca token by token, clickpaca with `jumpForward` (a grammar's forced
#: tokens fed as one chunk, docs/GRAMMARS.md), and llama-server unless --no-peer.
CP, CP_JUMP, LS = "clickpaca", "clickpaca, jump-forward", "llama-server"


def run_clickpaca(server: Server, reqs: list[tuple], tokens: int, jump: bool = False) -> dict[str, Any]:
    """reqs: (grammar id, prompt, seed, SchemaCheck); one round, all in flight."""
    c = server.client
    ticks0 = server.ticks()
    t0 = time.perf_counter()
    for sid, (gid, prompt, seed, _) in enumerate(reqs):
        c.infer(sid, prompt, grammar_id=gid, maxTokens=tokens, temperature=TEMPERATURE,
                seed=seed, reusePrefix=False, validate=True,  # every finished output checked, timed
                **({"jumpForward": True} if jump else {}))
    outs, t_end = [], t0
    for sid, (_, _, _, check) in enumerate(reqs):
        toks, final = c.collect(sid, 3600)
        t_end = max(t_end, final.get("_t", t_end))
        text = "".join(t["piece"] for t in toks)
        if final.get("type") != "done":
            outs.append({"stop": "error", "tokens": len(toks), "error": final.get("message")})
            continue
        finished = final["stop_reason"] == "grammar"
        valid = _check(check, text) if finished else None
        outs.append({"stop": "finished" if finished else "cut" if final["stop_reason"] == "max_tokens"
                     else final["stop_reason"], "tokens": final["tokens_predicted"], "valid": valid,
                     "repeats": repeated_keys(text), "bans": final.get("repeatKeyBans", 0),
                     "server_says": final.get("schemaValid", "absent"), "schema_ms": final.get("schema_ms"),
                     "forced": final.get("forced_tokens", 0),
                     "text": text[:200]})
    return {"wall_s": t_end - t0, "outputs": outs, "ticks": server.ticks() - ticks0}


def llama_body(schema: Any, prompt: str, seed: int, tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": tokens, "temperature": TEMPERATURE, "seed": seed,
            "json_schema": schema, "cache_prompt": False, "return_tokens": True, "stream": False}


def run_llama(ls: LlamaServer, reqs: list[tuple], tokens: int) -> dict[str, Any]:
    """reqs: (schema, prompt, seed, SchemaCheck); one round, all in flight."""
    t0, answers = ls.complete_all([llama_body(s, p, seed, tokens) for s, p, seed, _ in reqs])
    t_end = max(a["_t"] for a in answers)
    outs = []
    for (_, _, _, check), a in zip(reqs, answers):
        if "error" in a:
            outs.append({"stop": "error", "tokens": 0, "error": a["error"][:200]})
            continue
        ids = list(a.get("tokens") or [])
        finished = a.get("stop_type") == "eos"
        n = len(ids) - (1 if finished and ids else 0)  # its sampled EOG token is not counted
        valid = _check(check, a["content"]) if finished else None
        outs.append({"stop": "finished" if finished else "cut" if a.get("stop_type") == "limit"
                     else str(a.get("stop_type")), "tokens": n, "valid": valid,
                     "repeats": repeated_keys(a["content"]),
                     "text": a["content"][:200]})
    return {"wall_s": t_end - t0, "outputs": outs}


def llama_accepts(ls: LlamaServer, schema: Any) -> tuple[bool, str]:
    """Whether llama-server's converter takes the schema (a 1-token request)."""
    try:
        ls.complete(llama_body(schema, "x", 0, 1))
        return True, ""
    except PeerError as e:
        return False, str(e)[:200]


def side_stats(rounds: list[dict]) -> dict[str, Any]:
    outs = [o for r in rounds for o in r["outputs"]]
    tps = [sum(o["tokens"] for o in r["outputs"]) / r["wall_s"] for r in rounds if r["wall_s"] > 0]
    ticks = {}
    if all("ticks" in r for r in rounds):  # clickpaca: decode ticks per round, and the most one
        # request needed (its tokens less those fed as forced chunks): a round lasts at least that
        ticks = {"ticks": summary([r["ticks"] for r in rounds]),
                 "longest_request_ticks": summary([max((o["tokens"] - o.get("forced", 0) for o in r["outputs"]),
                                                       default=0) for r in rounds])}
    return {"tps": summary(tps), "outputs": len(outs), **ticks,
            "wall_s": summary([r["wall_s"] for r in rounds]),
            "tokens": summary([sum(o["tokens"] for o in r["outputs"]) for r in rounds]),
            "finished": sum(o["stop"] == "finished" for o in outs),
            "valid": sum(o.get("valid") is True for o in outs),
            "invalid": sum(o.get("valid") is False for o in outs),
            "cut": sum(o["stop"] == "cut" for o in outs),
            "errors": sum(o["stop"] == "error" for o in outs),
            "repeating": sum(o.get("repeats", 0) > 0 for o in outs),  # outputs that repeat a key
            "repeated_key_stops": sum(o["stop"] == "repeated_key" for o in outs),
            "banned_in": sum(o.get("bans", 0) > 0 for o in outs),  # outputs the ban narrowed
            "forced_share": (sum(o.get("forced", 0) for o in outs) / sum(o["tokens"] for o in outs)
                             if sum(o["tokens"] for o in outs) else None),
            "disagreements": sum(1 for o in outs if "server_says" in o and o["stop"] == "finished"
                                 and o["server_says"] != "absent" and o["server_says"] != o["valid"]),
            "schema_ms": _dist([o["schema_ms"] for o in outs if o.get("schema_ms") is not None]),
            "examples_invalid": [o["text"] for o in outs if o.get("valid") is False][:2],
            "examples_error": [o.get("error") for o in outs if o["stop"] == "error"][:2]}


def measure(args: Any) -> dict[str, Any]:
    corpus = pick(load(args.corpus), args.limit, args.max_bytes)
    seqs = parse_list(args.seqs)
    model, t, tokens = model_path(args), threads(args), args.tokens
    m0 = machine()
    progress(f"schemas: {len(corpus)} schemas of {args.corpus}")
    rows = compile_and_masks(corpus, model, args.build, tokens)
    usable = [(s, r) for s, r in zip(corpus, rows) if r["registered"]]
    ctx_per_seq = args.ctx_per_seq
    gen: list[dict] = []
    commands: dict[str, str] = {}
    problems: list[str] = []
    peer = not getattr(args, "no_peer", False)
    ubatch = getattr(args, "ubatch", None)  # rows per graph pass on both servers
    sides = (CP, CP_JUMP, LS) if peer else (CP, CP_JUMP)
    port = free_port()
    cmd = server_command(model, args.build, t, max(seqs), max(seqs) * ctx_per_seq, BATCH, True, port,
                         ubatch) if peer else []
    commands["llama-server"] = " ".join(cmd) if peer else "not run (--no-peer)"
    progress("schemas: starting clickpaca" + (" and llama-server" if peer else ""))
    server = Server({"modelPath": model, "build": args.build, "nThreads": t, "nSeqMax": max(seqs),
                     "nCtx": max(seqs) * ctx_per_seq, "nBatch": BATCH,
                     **({"nUbatch": ubatch} if ubatch else {})})
    ls = None
    try:
        accepted = {s.name: (None, "not asked (--no-peer)") for s in corpus}
        if peer:
            ls = LlamaServer(cmd, port)
            for s in corpus:
                accepted[s.name] = llama_accepts(ls, s.schema)
        for s, r in usable:
            server.client.grammar(f"s:{s.name}", "%json_schema " + json.dumps(s.schema),
                                  lenient=r["registered"] == "lenient")
        checks = {s.name: SchemaCheck(s.schema) for s, _ in usable}
        for n in seqs if usable else []:
            pick_i = [usable[i % len(usable)] for i in range(n)]
            ours = [(f"s:{s.name}", prompt_for(s.name), SEED_BASE + i, checks[s.name])
                    for i, (s, _) in enumerate(pick_i)]
            theirs = [(s.schema, prompt_for(s.name), SEED_BASE + i, checks[s.name])
                      for i, (s, _) in enumerate(pick_i)]
            res: dict[str, list] = {side: [] for side in sides}
            for k in range(args.repeats):
                order = sides if k % 2 == 0 else sides[::-1]
                for side in order:
                    if side in (CP, CP_JUMP):
                        res[side].append(run_clickpaca(server, ours, tokens, jump=side == CP_JUMP))
                    else:
                        res[side].append(run_llama(ls, theirs, tokens))
                    progress(f"schemas N={n} round {k + 1} {side}: "
                             f"{sum(o['tokens'] for o in res[side][-1]['outputs']) / res[side][-1]['wall_s']:.1f} tok/s")
            gen.append({"seqs": n, "sides": {k: side_stats(v) for k, v in res.items()}})
        for r in rows:
            r["llama_server_accepts"], r["llama_server_error"] = accepted[r["name"]]
    finally:
        server.close()
        problems += server.problems
        if ls is not None:
            ls.close()
            problems += ls.problems
    comp = {"schemas": len(rows),
            "default": sum(r["default"]["ok"] for r in rows),
            "lenient": sum(r["lenient"]["ok"] for r in rows),
            "enforced": sum(r["default"]["ok"] and r["default"]["enforced"] for r in rows),
            "llama_server": sum(bool(r.get("llama_server_accepts")) for r in rows) if peer else "not run",
            "compile_ms": _dist([r["default"]["ms"] for r in rows if r["default"]["ok"]]),
            "compile_ms_lenient": _dist([r["lenient"]["ms"] for r in rows if r["lenient"]["ok"]]),
            "mask_us": _dist([x for r in rows for x in r["mask_us"]]),
            "ban_us": _dist([x for r in rows for x in r["ban_us"]]),
            # the same two, in this thread's CPU time: what a busy machine's preemption leaves out
            "mask_cpu_us": _dist([m for r in rows for m, _ in r["cpu_us"]]),
            "ban_cpu_us": _dist([b for r in rows for _, b in r["cpu_us"] if b is not None])}
    notes = [f"corpus {args.corpus} {versions(args.corpus)}: {len(rows)} schemas "
             f"(--limit {args.limit}, --max-bytes {args.max_bytes})",
             f"generation: maxTokens {tokens}, T={TEMPERATURE}, seeds {SEED_BASE}+i, request i uses "
             f"schema i mod {len(usable)}; {args.repeats} alternating rounds; tok/s median (min-max)",
             "finished = ended by the grammar (llama-server: stop_type eos); valid = finished and "
             "valid by jsonschema (the same validator on both sides); cut = the token limit",
             "llama-server accepts = its /completion took the schema (a 1-token request): its "
             "converter leaves out what it cannot express without saying so",
             "mask us/token: one matcher per compiled schema walked by random allowed tokens, every "
             "mask of the 262,144-token vocabulary timed in-process (llguidance publishes about 50 us "
             "per mask for a 128k-token vocabulary on JSONSchemaBench); llama-server's grammar cost "
             "per token is inside its tok/s only",
             "key ban us/token: the repeated-key ban after llguidance's mask on the same walk, timed "
             "apart (grammar/json_keys.py); CPU: both in the thread's CPU time (no preemption)",
             "repeating = outputs (finished or cut) with a key their object already holds; "
             "repeated_key = clickpaca outputs the ban ended (nothing else allowed)"]
    dis = sum(r["sides"][name]["disagreements"] for r in gen for name in (CP, CP_JUMP))
    notes.append(f"clickpaca's own done.schemaValid disagreed with the bench's validator on {dis} outputs")
    notes.append("forced share = tokens fed as forced chunks (done.forced_tokens) / tokens generated: "
                 "each is a decode tick the request did not wait for")
    for r in gen:
        ms = r["sides"]["clickpaca"]["schema_ms"]
        notes.append(f"N={r['seqs']}: checking an output (done.schema_ms, validate on) took "
                     f"{fmt(ms['median'])} ms median, {fmt(ms['p99'])} ms p99 ({ms['n']} outputs)")
    refused: dict[str, int] = {}
    for r in rows:
        if not r["default"]["ok"]:
            key = re.sub(r"'[^']*'|\d+ bytes", "...", r["default"]["error"].removeprefix(
                "invalid JSON schema: ").split("\n")[0])[:70]
            refused[key] = refused.get(key, 0) + 1
    notes.append("refused by default: " + "; ".join(f"{v} x {k}" for k, v in
                                                     sorted(refused.items(), key=lambda kv: -kv[1])))
    return {"params": {"corpus": args.corpus, "limit": args.limit, "max_bytes": args.max_bytes,
                       "seqs": seqs, "tokens": tokens, "repeats": args.repeats, "threads": t,
                       "build": args.build, "model": model, "ctx_per_seq": ctx_per_seq,
                       "ubatch": ubatch, "versions": versions(args.corpus)},
            "llama_server_commands": commands, "machine_start": m0, "compile": comp,
            "refusals": refused,
            "schemas": [{k: v for k, v in r.items() if k not in ("mask_us", "ban_us", "cpu_us")} | {"masks": len(r["mask_us"])}
                        for r in rows],
            "rows": gen, "notes": notes, "server_problems": problems}


def table(out: dict[str, Any]) -> str:
    c = out["compile"]
    t1 = markdown(
        ["schemas", "compile (default)", "enforced whole", "compile (lenient)", "llama-server accepts",
         "compile ms median / p99", "mask us/token median / p99 (tokens)",
         "key ban us/token median / p99", "CPU us/token mask, ban: median / p99"],
        [(c["schemas"], c["default"], c["enforced"], c["lenient"], c["llama_server"],
          f"{fmt(c['compile_ms']['median'])} / {fmt(c['compile_ms']['p99'])}",
          f"{fmt(c['mask_us']['median'])} / {fmt(c['mask_us']['p99'])} ({c['mask_us']['n']})",
          f"{fmt(c['ban_us']['median'])} / {fmt(c['ban_us']['p99'])}",
          f"{fmt(c['mask_cpu_us']['median'])} / {fmt(c['mask_cpu_us']['p99'])}, "
          f"{fmt(c['ban_cpu_us']['median'])} / {fmt(c['ban_cpu_us']['p99'])}")],
        align="rrrrrrrrr")
    rows = []
    for r in out["rows"]:
        for name, s in r["sides"].items():
            t = s["tps"]
            rows.append((r["seqs"], name, f"{fmt(t['median'])} ({fmt(t['min'])}-{fmt(t['max'])})",
                         s["outputs"], s["finished"], s["valid"], s["invalid"], s["cut"], s["errors"],
                         s["repeating"], s["repeated_key_stops"] if name != LS else "",
                         fmt(s["forced_share"]) if name == CP_JUMP else "",
                         f"{fmt(s['wall_s']['median'])}", f"{fmt(s['tokens']['median'])}",
                         _ticks(s)))
    t2 = markdown(["seqs", "side", "tok/s", "outputs", "finished", "valid", "invalid", "cut", "errors",
                   "repeating", "repeated_key", "forced share", "wall s / round", "tokens / round",
                   "ticks / round (longest request)"], rows, align="rlrrrrrrrrrrrrr")
    return t1 + "\n\n" + t2


def _ticks(s: dict[str, Any]) -> str:
    """A side's decode ticks per round and its longest request's, medians; '' for llama-server."""
    if "ticks" not in s:
        return ""
    return f"{fmt(s['ticks']['median'])} ({fmt(s['longest_request_ticks']['median'])})"


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args, seqs="8,64", tokens=64, repeats=2, limit=None, max_bytes=None,
                         ctx_per_seq=256, no_peer=False)
    if not getattr(args, "corpus", None):
        raise ValueError("bench schemas needs a corpus: a directory of schema files or a package "
                         "(check-jsonschema, schemastore)")
    out = measure(args)
    print(f"llama-server: {out['llama_server_commands']['llama-server']}")
    emit(out_dir(args), "schemas", out, table(out), f"JSON schemas of {args.corpus}")
    return out


__all__ = ["measure", "run", "table"]
