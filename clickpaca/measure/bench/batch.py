"""`clickpaca bench batch`: N sequences at once, server vs llama-batched-bench (with
--rpc: local against one and two RPC workers, measure/bench/rpc.py).

For each N in --seqs, N infers of P prompt tokens (--prompt-tokens) and exactly G generated
tokens (--tokens; end of generation banned) go to one server, alternating with
`llama-batched-bench -npp P -ntg G -npl N` (same build, model, threads, unified KV). Every
sequence samples greedily unless --chain names `bench sampler` scenarios without a grammar
(sampling/bench.py SCENARIOS): each chain's fields go into every infer, so its host cost is
inside the server's figure; several chains share the servers and rounds, each beside the
first (`vs_first`, the median of per-round ratios). Server throughput = generated tokens
after each sequence's first / (last token event - first token event), the generation phase
only, as S_TG is; per-sequence latency = median time between its token events.

--against REV: REV's whole server (measure/bench/against.py) is one more side of the same
alternating rounds; with --deterministic its tokens are compared with this tree's per round.
--fresh-servers: every server side is a new process each round (serve.Servers).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..common import model_path, out_dir, png, threads, with_defaults
from ...results.report import emit, machine, plot_lines
from .serve import Server, Servers, exact_prompt, group_stats, run_group
from ...results.stats import alternate, median, parse_list, progress, ratio, summary
from ...results.table import markdown
from .tools import batched_bench

GOALS = {8: 0.9, 64: 0.8}


def chain_params(name: str | None, ban: dict) -> dict[str, Any]:
    """The infer fields of the chain every sequence runs, the end-of-generation bans of
    ``ban`` (``Server.ban_eog``) added to its own logit_bias."""
    from ...sampling import SamplerParams
    from ...sampling.bench import SCENARIOS

    if name in (None, "greedy"):
        return {"temperature": 0, **ban}
    choices = sorted(k for k, (_, density) in SCENARIOS.items() if density is None)
    if name not in choices:
        raise ValueError(f"--chain: unknown chain {name!r}; known: greedy, {', '.join(c for c in choices if c != 'greedy')}")
    params = SCENARIOS[name][0]
    req, base = params.to_request(), SamplerParams().to_request()
    out = {k: v for k, v in req.items() if v != base[k] and k != "logit_bias"}
    bias = {b["token"]: b["bias"] for b in req["logit_bias"]}
    bias.update({b["token"]: b["bias"] for b in ban.get("logit_bias", ())})
    return {**out, "logit_bias": [{"token": t, "bias": b} for t, b in sorted(bias.items())]}


def server_init(model: str, build: str, t: int, max_seqs: int, p: int, g: int, **extra: Any) -> dict:
    return {"modelPath": model, "build": build, "nThreads": t, "nSeqMax": max(1, max_seqs),
            "nCtx": max(512, max_seqs * (p + g) + 64), "nBatch": max(512, max_seqs * p), **extra}


#: The servers beside the default one, each a side of the same alternating rounds: its
#: name, the prefix of its row keys, and its init fields from the arguments (None: not
#: asked). --center FILE: keys stored minus that center, what the subtraction costs a decode.
SIDES = (
    ("deterministic", "det", lambda a: {"deterministic": True} if getattr(a, "deterministic", False) else None),
    ("preselect", "pre", lambda a: {"preselect": True} if getattr(a, "preselect", False) else None),
    ("ubatch", "ub", lambda a: {"nUbatch": a.ubatch} if getattr(a, "ubatch", None) else None),
    ("centered", "cen", lambda a: {"kvCenter": a.center} if getattr(a, "center", None) else None),
)
#: --against REV: REV's default server, its rows' key prefix
AGAINST = ("against", "old")
#: --against REV with --preselect: REV's pre-selecting server too, held to this tree's
AGAINST_PRESELECT = ("against-preselect", "oldpre")


def side_servers(args: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (row key prefix, init fields) of the SIDES the arguments ask for."""
    return {name: (key, init) for name, key, fields in SIDES if (init := fields(args)) is not None}


def run_server_group(server: Server, n: int, p: int, g: int, params: dict) -> dict[str, Any]:
    runs = run_group(server, [exact_prompt(p)] * n,
                     {"maxTokens": g, "reusePrefix": False, **params})
    st = group_stats(runs)
    if st["errors"]:
        server.problems.append(f"{n} sequences: errors {st['errors'][:3]}")
        progress(f"SERVER PROBLEM: {server.problems[-1]}")
    return st


def measure(args: Any) -> dict[str, Any]:
    seqs = parse_list(args.seqs)
    p, g, t, model = args.prompt_tokens, args.tokens, threads(args), model_path(args)
    m0 = machine()
    fresh = bool(getattr(args, "fresh_servers", False))
    progress(f"batch: starting the server (nSeqMax {max(seqs)})" + (", a new one every round" if fresh else ""))
    servers = Servers(fresh)
    others: dict[str, str] = {}  # side name -> its rows' key prefix
    rev = getattr(args, "against", None)
    old_tree = tempfile.TemporaryDirectory(prefix="clickpaca-against-") if rev else None
    try:
        servers.add("server", server_init(model, args.build, t, max(seqs), p, g))
        for name, (key, init) in side_servers(args).items():
            servers.add(name, server_init(model, args.build, t, max(seqs), p, g, **init))
            others[name] = key
        if old_tree is not None:
            from . import against

            progress(f"batch: starting {rev}'s server")
            env = against.server_env(against.extract(rev, Path(old_tree.name)))
            det = {"deterministic": True} if "deterministic" in others else {}
            servers.add(AGAINST[0], server_init(model, args.build, t, max(seqs), p, g, **det), env=env)
            others[AGAINST[0]] = AGAINST[1]
            if "preselect" in others:
                servers.add(AGAINST_PRESELECT[0],
                            server_init(model, args.build, t, max(seqs), p, g, **det, preselect=True), env=env)
                others[AGAINST_PRESELECT[0]] = AGAINST_PRESELECT[1]
    except BaseException:
        servers.close()
        if old_tree is not None:
            old_tree.cleanup()
        raise
    chains = parse_list(getattr(args, "chain", None) or "greedy", str)
    ban = servers.get("server", None).ban_eog()
    params_of = {c: chain_params(c, ban) for c in chains}
    rows = []
    try:
        for n in seqs:
            sides = {"llama-batched-bench": lambda r, n=n: batched_bench(model, p, g, n, t, args.build)}
            for c in chains:
                for name in ["server", *others]:
                    sides[_side(name, c, chains)] = (lambda r, n=n, c=c, name=name:
                                                     run_server_group(servers.get(name, (n, r)), n, p, g,
                                                                      params_of[c]))
            res = alternate(sides, args.repeats, f"batch N={n}")
            nat = res["llama-batched-bench"]
            for c in chains:
                rows.append(_row(n, c, {name: res[_side(name, c, chains)] for name in ["server", *others]},
                                 nat, others, res, chains))
            progress(f"batch N={n}: " + ", ".join(f"{r['chain']} {r['server_wall_tps']['median']}"
                                                  for r in rows[-len(chains):])
                     + f" tok/s, native {median([x['speed_tg'] for x in nat])} tok/s")
    finally:
        servers.close()
        if old_tree is not None:
            old_tree.cleanup()
    notes = ["server tok/s = token events per second while all N sequences generate (wall clock); "
             "span tok/s also counts ticks where some prompts were still being processed",
             "ratio = server wall-clock generation tok/s / llama-batched-bench S_TG "
             f"(medians of {args.repeats} alternating rounds); goals >= 0.9 at 8, >= 0.8 at 64",
             "eval_tps_sum (sum of done.eval_tps) reads about G/(G-1) high: see bench decode"]
    if rev:
        notes.append(f"against: {rev}'s server (its clickpaca/ from git archive, on this checkout's builds) "
                     "in the same alternating rounds; against / default = its tok/s over this tree's"
                     + ("; both in deterministic mode, old_same_tokens_as_det: per round, whether its "
                        "tokens equal this tree's deterministic server's" if "deterministic" in others else "")
                     + ("; against-preselect: its server with init preselect, oldpre_ratio_to_pre = its tok/s "
                        "over this tree's preselect server's" if "preselect" in others else ""))
    if fresh:
        notes.append("--fresh-servers: every server side started a new process for each round (and each N), "
                     "so the rounds' spread includes process-to-process variation")
    if len(chains) > 1:
        notes.append(f"chains {', '.join(chains)} ran on the same servers in the same rounds; vs_first = the "
                     f"median of the per-round ratios of a chain's tok/s to {chains[0]}'s on the same server")
    for row in rows:
        bad = [k for toks in row["server_tokens"] for k in toks if k != g]
        if bad:
            notes.append(f"N={row['seqs']} {row['chain']}: some sequences made {sorted(set(bad))} tokens, not {g}")
        if row["server_prompt_tokens"] != [p]:
            notes.append(f"N={row['seqs']} {row['chain']}: prompt tokens {row['server_prompt_tokens']}, expected {p}")
    return {"params": {"seqs": seqs, "prompt_tokens": p, "tokens": g, "threads": t,
                       "repeats": args.repeats, "build": args.build, "model": model, "fresh_servers": fresh,
                       "deterministic": "deterministic" in others, "preselect": "preselect" in others,
                       "center": getattr(args, "center", None), "chain": ",".join(chains), "against": rev,
                       "infer_fields": params_of[chains[0]] if len(chains) == 1 else params_of},
            "machine_start": m0, "server_init": servers.ready["server"], "rows": rows, "notes": notes,
            "server_problems": servers.problems, "server_processes": servers.started}


def _side(name: str, chain: str, chains: list[str]) -> str:
    """A side's name in the alternating rounds (the chain added when there are several)."""
    return name if len(chains) == 1 else f"{name} {chain}"


def _wall(runs: list[dict]) -> list[float]:
    return [x["wall_tps"] for x in runs]


def _row(n: int, chain: str, runs: dict[str, list[dict]], nat: list[dict], others: dict,
         res: dict[str, list], chains: list[str]) -> dict[str, Any]:
    """One row of a chain at N sequences: the default server's figures against
    llama-batched-bench's, each side server's against the default's, and with several
    chains each server's against its own figures for the first chain."""
    srv = runs["server"]
    s_wall = _wall(srv)
    n_tg = [x["speed_tg"] for x in nat]
    row = {"seqs": n, "chain": chain, "server_wall_tps": summary(s_wall),
           "server_eval_tps_sum": summary([x["eval_tps_sum"] for x in srv]),
           "server_span_tps": summary([x["span_tps"] for x in srv]),
           "server_admission_skew_ms": summary([x["admission_skew_ms"] for x in srv]),
           "server_latency_ms": summary([x["latency_per_token_ms"] for x in srv]), "native_s_tg": summary(n_tg),
           "native_latency_ms": summary([x["t_tg"] / x["tg"] * 1000 for x in nat]),
           "ratio": ratio(median(s_wall), median(n_tg)), "goal": GOALS.get(n),
           "server_tokens": [x["tokens"] for x in srv],
           "server_prompt_tokens": srv[-1]["prompt_tokens"],
           "server_stop_reasons": srv[-1]["stop_reasons"], "native_cmd": nat[0]["cmd"]}
    for name, key in others.items():
        o_wall = _wall(runs[name])
        row.update({f"{key}_wall_tps": summary(o_wall),
                    f"{key}_ratio_to_default": ratio(median(o_wall), median(s_wall)),
                    f"{key}_ratio_to_native": ratio(median(o_wall), median(n_tg)),
                    f"{key}_paired_ratios": [round(a / b, 4) for a, b in zip(o_wall, s_wall) if a and b],
                    f"{key}_tokens": [x["tokens"] for x in runs[name]]})
    if AGAINST[0] in others and "deterministic" in others:  # both deterministic: the same tokens?
        row["old_same_tokens_as_det"] = [a["tokens_digest"] == b["tokens_digest"]
                                         for a, b in zip(runs[AGAINST[0]], runs["deterministic"])]
        row["old_ratio_to_det"] = ratio(median(_wall(runs[AGAINST[0]])), median(_wall(runs["deterministic"])))
    if AGAINST_PRESELECT[0] in others:  # REV's pre-selection against this tree's, round by round
        old, new = _wall(runs[AGAINST_PRESELECT[0]]), _wall(runs["preselect"])
        row["oldpre_ratio_to_pre"] = ratio(median(old), median(new))
        row["oldpre_paired_ratios_to_pre"] = [round(a / b, 4) for a, b in zip(old, new) if a and b]
    if len(chains) > 1:
        for name, key in [("server", "server"), *others.items()]:
            first = _wall(res[_side(name, chains[0], chains)])
            per = [round(a / b, 4) for a, b in zip(_wall(runs[name]), first) if a and b]
            row[f"{key}_vs_first"] = {"median": median(per), "rounds": per}
    return row


def table(out: dict[str, Any]) -> str:
    multi = any("server_vs_first" in r for r in out["rows"])
    lead = (lambda r: (r["seqs"], r["chain"])) if multi else (lambda r: (r["seqs"],))
    head = ["seqs", "chain"] if multi else ["seqs"]
    rows = []
    for r in out["rows"]:
        rows.append((*lead(r), r["server_wall_tps"]["median"], r["server_span_tps"]["median"],
                     r["server_eval_tps_sum"]["median"], r["native_s_tg"]["median"], r["ratio"], r["goal"],
                     r["server_latency_ms"]["median"], r["native_latency_ms"]["median"])
                    + ((r["server_vs_first"]["median"],) if multi else ()))
    text = markdown(head + ["server tok/s", "server span tok/s", "server sum eval_tps", "batched-bench S_TG",
                            "ratio", "goal", "server ms/token/seq", "native ms/token/seq"]
                    + (["server / first chain"] if multi else []), rows)
    for name, key in [*((name, key) for name, key, _ in SIDES), AGAINST, AGAINST_PRESELECT]:
        side = [(*lead(r), r[f"{key}_wall_tps"]["median"], r["server_wall_tps"]["median"], r["native_s_tg"]["median"],
                 r[f"{key}_ratio_to_default"], r.get(f"{key}_ratio_to_native"),
                 ", ".join(f"{x:.3f}" for x in r[f"{key}_paired_ratios"]))
                + ((r[f"{key}_vs_first"]["median"],) if multi else ())
                for r in out["rows"] if f"{key}_wall_tps" in r]
        if side:
            text += "\n\n" + markdown(head + [f"{name} tok/s", "default tok/s", "batched-bench S_TG",
                                               f"{name} / default", f"{name} / native",
                                               "per-round ratios (vs default)"]
                                       + ([f"{name} / its first chain"] if multi else []), side)
    same = [(*lead(r), r["old_ratio_to_det"], ", ".join("yes" if x else "NO" for x in r["old_same_tokens_as_det"]))
            for r in out["rows"] if "old_same_tokens_as_det" in r]
    if same:
        text += "\n\n" + markdown(head + ["against / deterministic (both deterministic)", "same tokens, per round"],
                                   same)
    pre = [(*lead(r), r["oldpre_ratio_to_pre"], ", ".join(f"{x:.3f}" for x in r["oldpre_paired_ratios_to_pre"]))
           for r in out["rows"] if "oldpre_ratio_to_pre" in r]
    if pre:
        text += "\n\n" + markdown(head + ["against-preselect / preselect", "per-round ratios"], pre)
    return text


def plot(out: dict[str, Any], path) -> None:
    first = out["params"]["chain"].split(",")[0]  # (the first chain's rows: one per N)
    rows = [r for r in out["rows"] if r.get("chain", first) == first]
    xs = [r["seqs"] for r in rows]
    plot_lines(path, {"server (clickpaca)": (xs, [r["server_wall_tps"]["median"] for r in rows]),
                      "llama-batched-bench S_TG": (xs, [r["native_s_tg"]["median"] for r in rows])},
               "sequences decoded together", "generated tokens/s (all sequences)",
               f"Batched generation, P={out['params']['prompt_tokens']} G={out['params']['tokens']}, "
               f"{out['params']['threads']} threads", logx=True)


def measure_rpc(args: Any) -> dict[str, Any]:
    """--rpc: every N of --seqs on the local model, one worker, two workers (measure/bench/rpc.py),
    alternating rounds, a fresh server per side and round."""
    from . import rpc

    seqs = parse_list(args.seqs)
    p, g, t, model = args.prompt_tokens, args.tokens, threads(args), model_path(args)
    m0 = machine()
    base = server_init(model, args.build, t, max(seqs), p, g)
    with rpc.workers(args.rpc, args.build, t) as endpoints:
        servers = rpc.side_servers(base, endpoints, args.rpc_layers, args.rpc_output_local)

        def side(init: dict[str, Any]):
            def run_once(r: int) -> dict[int, dict[str, Any]]:
                out = {}
                with Server(init) as server:
                    eps = init.get("rpcServers", [])
                    for n in seqs:
                        before = rpc.traffic(eps)
                        st = run_server_group(server, n, p, g, {"temperature": 0, **server.ban_eog()})
                        moved = rpc.delta(before, rpc.traffic(eps)) if eps else None
                        out[n] = {"tps": st["wall_tps"], "tokens": st["tokens"], "bytes": moved,
                                  "bytes_per_token": rpc.per_token(moved, n * g),
                                  "devices": rpc.where(server.ready), "problems": list(server.problems)}
                return out
            return run_once

        res = alternate({name: side(init) for name, init in servers}, args.repeats, "batch --rpc")
    rows = []
    for n in seqs:
        per_side = {name: {"tps": summary([x[n]["tps"] for x in runs]),
                           "tokens": [x[n]["tokens"] for x in runs],
                           "bytes_per_token": runs[-1][n]["bytes_per_token"],
                           "bytes_samples": [x[n]["bytes"] for x in runs],
                           "devices": runs[-1][n]["devices"]}
                    for name, runs in res.items()}
        rows.append({"seqs": n, "sides": per_side})
        progress("batch --rpc N=" + str(n) + ": " + ", ".join(
            f"{name} {s['tps']['median']} tok/s" for name, s in per_side.items()))
    notes = ["tok/s = token events per second while all N sequences generate (as bench batch), "
             f"medians of {args.repeats} alternating rounds",
             f"RPC sides: nGpuLayers {args.rpc_layers}, layers split evenly over the workers, "
             f"outputLocal {str(bool(args.rpc_output_local)).lower()}",
             "bytes/token = bytes sent + received on the connections to the workers while the N "
             f"sequences ran (kernel counters via ss; their {p}-token prompts included) / the N x {g} "
             "generated tokens"]
    return {"params": {"seqs": seqs, "prompt_tokens": p, "tokens": g, "threads": t, "repeats": args.repeats,
                       "build": args.build, "model": model, "rpc": args.rpc, "rpc_layers": args.rpc_layers,
                       "rpc_output_local": bool(args.rpc_output_local),
                       "endpoints": endpoints},
            "machine_start": m0, "rows": rows, "notes": notes}


def table_rpc(out: dict[str, Any]) -> str:
    from . import rpc

    names = list(out["rows"][0]["sides"]) if out["rows"] else []
    return rpc.table(names, [(r["seqs"], r["sides"]) for r in out["rows"]], "seqs")


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args, seqs="1,2,4,8,16,32,64")
    if getattr(args, "rpc", None):
        out = measure_rpc(args)
        emit(out_dir(args), "batch-rpc", out, table_rpc(out),
             "Batched generation: local against RPC workers (tokens/s)")
        return out
    out = measure(args)
    chain = out["params"]["chain"]
    emit(out_dir(args), "batch", out, table(out),
         "Batched generation (tokens/s)" + ("" if chain == "greedy" else f", chain {chain}"))
    if args.plot:
        plot(out, png(args, "batch"))
    return out
