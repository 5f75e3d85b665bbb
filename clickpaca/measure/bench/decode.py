"""`clickpaca bench decode`: single-sequence decode speed, server vs llama-bench tg
(with --rpc: local against one and two RPC workers, measure/bench/rpc.py).

One server (started once; start-up is not measured) and `llama-bench -p 0 -n N -t T`
of the same build, model and threads run alternately, `--repeats` rounds. The server
runs greedy (temperature 0) and the default sampler chain. Its speed is read two ways:
`done.eval_tps` (generation only, prompt excluded, like llama-bench tg; the headline
ratio uses it) and the wall clock between its first and last token events ((n-1)
intervals). End-of-generation tokens are banned so every run makes exactly N tokens.
With --deterministic a second server in deterministic mode (docs/DETERMINISM.md) runs in
the same alternating rounds, and its speed is given as a ratio to the default server's.
"""

from __future__ import annotations

from typing import Any

from ..common import model_path, out_dir, threads, with_defaults
from ...results.report import emit, machine
from .serve import Server, exact_prompt, run_group
from ...results.stats import alternate, median, progress, ratio, summary
from ...results.table import markdown
from .tools import llama_bench_tg

PROMPT_TOKENS = 8


def measure(args: Any) -> dict[str, Any]:
    n, t, model = args.tokens, threads(args), model_path(args)
    m0 = machine()
    progress(f"decode: starting the server ({args.build}, {t} threads)")
    init = {"modelPath": model, "nCtx": max(512, n + 64), "nSeqMax": 1, "nBatch": 512,
            "nThreads": t, "build": args.build}
    server = Server(init)
    det = Server({**init, "deterministic": True}) if getattr(args, "deterministic", False) else None
    bias = server.ban_eog()
    variants = {"greedy": {"temperature": 0}, "default_chain": {"seed": 1234}}

    def side(srv: Server):
        def run(r: int) -> dict[str, Any]:
            out = {}
            for name, params in variants.items():
                [one] = run_group(srv, [exact_prompt(PROMPT_TOKENS)],
                                  {"maxTokens": n, "reusePrefix": False, **bias, **params})
                out[name] = {"eval_tps": one.final.get("eval_tps"), "wall_tps": one.wall_tps,
                             "tokens": one.tokens, "final": {k: v for k, v in one.final.items()
                                                             if not k.startswith("_")}}
            return out
        return run

    def native_side(r: int) -> dict[str, Any]:
        return llama_bench_tg(model, n, t, args.build, repetitions=1)

    sides = {"server": side(server), "llama-bench": native_side}
    if det is not None:
        sides["deterministic"] = side(det)
    try:
        res = alternate(sides, args.repeats, "decode")
    finally:
        server.close()
        if det is not None:
            det.close()
    native = [r["avg_ts"] for r in res["llama-bench"]]
    native_med = median(native)
    out: dict[str, Any] = {
        "params": {"tokens": n, "threads": t, "repeats": args.repeats, "build": args.build,
                   "deterministic": det is not None,
                   "model": model, "prompt_tokens": PROMPT_TOKENS},
        "machine_start": m0, "native_cmd": res["llama-bench"][0]["cmd"],
        "llama_bench_tg": summary(native), "server": {},
        "server_init": {k: v for k, v in server.ready.items() if k not in ("_t",)},
        "server_problems": server.problems,
        "ratio_uses": "done.eval_tps (generation only, excludes prompt processing, as llama-bench tg)",
    }
    for name in variants:
        ev = [r[name]["eval_tps"] for r in res["server"]]
        wall = [r[name]["wall_tps"] for r in res["server"]]
        toks = [r[name]["tokens"] for r in res["server"]]
        out["server"][name] = {"eval_tps": summary(ev), "wall_tps": summary(wall), "tokens": toks,
                               "ratio_eval": ratio(median(ev), native_med),
                               "ratio_wall": ratio(median(wall), native_med),
                               "last_done": res["server"][-1][name]["final"]}
    if det is not None:
        out["deterministic"] = {}
        for name in variants:
            ev = [r[name]["eval_tps"] for r in res["deterministic"]]
            base = [r[name]["eval_tps"] for r in res["server"]]
            out["deterministic"][name] = {
                "eval_tps": summary(ev), "ratio_to_default": ratio(median(ev), median(base)),
                "paired_ratios": [round(a / b, 4) for a, b in zip(ev, base) if a and b],
                "tokens": [r[name]["tokens"] for r in res["deterministic"]]}
        out["deterministic_init"] = {k: v for k, v in det.ready.items() if k not in ("_t",)}
    notes = [f"ratio = server done.eval_tps / llama-bench tg{n} (medians of {args.repeats} "
             "alternating rounds); goal >= 0.95",
             "done.eval_tps divides n tokens by the time after the prompt decode, which holds "
             "n-1 decodes (the first token comes from the prompt decode): it reads about "
             "n/(n-1) high; wall_tps counts the n-1 intervals between token events"]
    bad = [f"{name}: round {i + 1} made {k} tokens, not {n}" for name in variants
           for i, k in enumerate(out["server"][name]["tokens"]) if k != n]
    notes += bad
    out["notes"] = notes
    return out


def table(out: dict[str, Any]) -> str:
    n = out["params"]["tokens"]
    nat = out["llama_bench_tg"]
    rows = [(f"llama-bench tg{n}", "avg_ts", nat["median"], nat["min"], nat["max"], None)]
    for name, s in out["server"].items():
        rows.append((f"server {name}", "done.eval_tps", s["eval_tps"]["median"], s["eval_tps"]["min"],
                     s["eval_tps"]["max"], s["ratio_eval"]))
        rows.append((f"server {name}", "wall first->last token", s["wall_tps"]["median"],
                     s["wall_tps"]["min"], s["wall_tps"]["max"], s["ratio_wall"]))
    for name, s in out.get("deterministic", {}).items():
        rows.append((f"deterministic {name}", "done.eval_tps", s["eval_tps"]["median"], s["eval_tps"]["min"],
                     s["eval_tps"]["max"], None))
    text = markdown(["side", "measure", "tok/s median", "min", "max", "ratio vs native"], rows)
    if out.get("deterministic"):
        text += "\n\n" + markdown(
            ["deterministic / default", "ratio of medians", "per-round ratios"],
            [(name, s["ratio_to_default"], ", ".join(f"{x:.3f}" for x in s["paired_ratios"]))
             for name, s in out["deterministic"].items()])
    return text


def measure_rpc(args: Any) -> dict[str, Any]:
    """--rpc: greedy decode of N tokens on the local model, one worker, two workers
    (measure/bench/rpc.py), alternating rounds, a fresh server per side and round."""
    from . import rpc

    n, t, model = args.tokens, threads(args), model_path(args)
    m0 = machine()
    base = {"modelPath": model, "nCtx": max(512, n + 64), "nSeqMax": 1, "nBatch": 512,
            "nThreads": t, "build": args.build}
    with rpc.workers(args.rpc, args.build, t) as endpoints:
        servers = rpc.side_servers(base, endpoints, args.rpc_layers, args.rpc_output_local)

        def side(init: dict[str, Any]):
            def run_once(r: int) -> dict[str, Any]:
                with Server(init) as server:
                    eps = init.get("rpcServers", [])
                    before = rpc.traffic(eps)
                    [run] = run_group(server, [exact_prompt(PROMPT_TOKENS)],
                                      {"maxTokens": n, "reusePrefix": False, "temperature": 0,
                                       **server.ban_eog()})
                    moved = rpc.delta(before, rpc.traffic(eps)) if eps else None
                    # n decodes (the prompt's, then one per token), each sampling one token
                    return {"tps": run.wall_tps, "eval_tps": run.final.get("eval_tps"),
                            "tokens": run.tokens, "bytes": moved,
                            "bytes_per_token": rpc.per_token(moved, n), "devices": rpc.where(server.ready),
                            "problems": server.problems}
            return run_once

        res = alternate({name: side(init) for name, init in servers}, args.repeats, "decode --rpc")
    per_side = {name: {"tps": summary([x["tps"] for x in runs]),
                       "eval_tps": summary([x["eval_tps"] for x in runs]),
                       "tokens": [x["tokens"] for x in runs],
                       "bytes_per_token": runs[-1]["bytes_per_token"],
                       "bytes_samples": [x["bytes"] for x in runs],
                       "devices": runs[-1]["devices"],
                       "problems": [p for x in runs for p in x["problems"]]}
                for name, runs in res.items()}
    notes = ["tok/s = token events per second between the first and the last token (greedy, "
             f"{n} tokens, end-of-generation banned), medians of {args.repeats} alternating rounds",
             f"RPC sides: nGpuLayers {args.rpc_layers}, layers split evenly over the workers, "
             f"outputLocal {str(bool(args.rpc_output_local)).lower()}",
             "bytes/token = bytes sent + received on the connections to the workers during the run "
             f"(kernel counters via ss; the {PROMPT_TOKENS}-token prompt included) / the {n} generated "
             "tokens (one decode each)"]
    return {"params": {"tokens": n, "threads": t, "repeats": args.repeats, "build": args.build,
                       "model": model, "prompt_tokens": PROMPT_TOKENS, "rpc": args.rpc,
                       "rpc_layers": args.rpc_layers, "rpc_output_local": bool(args.rpc_output_local),
                       "endpoints": endpoints},
            "machine_start": m0, "sides": per_side, "notes": notes}


def table_rpc(out: dict[str, Any]) -> str:
    from . import rpc

    names = list(out["sides"])
    return rpc.table(names, [(f"decode {out['params']['tokens']} tokens", out["sides"])], "load")


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args)
    if getattr(args, "rpc", None):
        out = measure_rpc(args)
        emit(out_dir(args), "decode-rpc", out, table_rpc(out),
             "Single-sequence decode: local against RPC workers (tokens/s)")
        return out
    out = measure(args)
    emit(out_dir(args), "decode", out, table(out), "Single-sequence decode (tokens/s)")
    return out
