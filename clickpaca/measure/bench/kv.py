"""`clickpaca bench kv`: KV cache memory per cache type, read from servers' ready.kvBytes.

One server per cache type (K = V = type; with --cache, K/V pairs as `q8_0/turbo3`),
each with nCtx cells and one sequence. Reported: the bytes llama.cpp allocated,
bytes per token, per 1,000 tokens and per sequence of --kv-ctx tokens, nominal bits
per value (ggml's type table) and effective bits per value (measured bytes against
the f16 run: f16 is 16 bits per value). Every type of the mainline build by default,
plus each other build's own types (the turboquant build's turbo types) when it is built:
default_pairs, from the rows of clickpaca/llama/cachetypes.py.
"""

from __future__ import annotations

from typing import Any

from ...llama import cachetypes
from ...llama.cachetypes import DEFAULT, attention, build_for, pair_name, parse_pair
from .cachetypes import bits_per_value, other_builds, pair_bpv
from ..common import model_path, out_dir, png, threads, with_defaults
from ...results.report import emit, machine, plot_points
from .serve import Server
from ...results.stats import median, parse_list, progress, ratio, summary
from ...results.table import markdown
from .tools import llama_bench_kv

KV_CTX = 4096


def default_pairs(model: str, build: str) -> list[tuple[str, str]]:
    """Every type the build offers (ready.cacheTypes), in the table's order; from mainline,
    also the types of each other build here that are its own, K = V and then as V under
    the K their row names (bench_k)."""
    def offered(b: str) -> list[str]:
        with Server({"modelPath": model, "build": b, "nCtx": 256, "nSeqMax": 1}) as s:
            return cachetypes.display_sorted(s.ready["cacheTypes"])

    pairs = [(t, t) for t in offered(build)]
    if build == cachetypes.MAINLINE:
        for other in other_builds():
            own = [t for t in offered(other) if (r := cachetypes.find(t)) and r.build == other]
            pairs += [(t, t) for t in own]
            pairs += [(k, t) for t in own if (k := cachetypes.get(t).bench_k)]
    return pairs


def measure(args: Any) -> dict[str, Any]:
    model = model_path(args)
    m0 = machine()
    n_ctx = int(getattr(args, "kv_ctx", None) or KV_CTX)
    cache = getattr(args, "cache", None)
    pairs = [parse_pair(s) for s in parse_list(cache, str)] if cache else default_pairs(model, args.build)
    builds = {build_for(k, v) if args.build == cachetypes.MAINLINE else args.build for k, v in pairs}
    bpv_tables = {b: bits_per_value(b) for b in sorted(builds)}
    rows, problems = [], []
    for k, v in pairs:
        build = build_for(k, v) if args.build == cachetypes.MAINLINE else args.build
        progress(f"kv: {pair_name(k, v)} ({build})")
        try:
            with Server({"modelPath": model, "build": build, "nCtx": n_ctx, "nSeqMax": 1,
                         "cacheTypeK": k, "cacheTypeV": v, "flashAttn": attention(k, v)}) as s:
                ready = s.ready
            problems += s.problems
        except Exception as e:  # noqa: BLE001 - a refused type is a result too
            rows.append({"cache": pair_name(k, v), "build": build, "error": str(e)})
            continue
        kvb = int(ready["kvBytes"])
        rows.append({"cache": pair_name(k, v), "cache_k": k, "cache_v": v, "build": build,
                     "n_ctx": ready["nCtx"], "kv_bytes": kvb, "bytes_per_token": kvb / ready["nCtx"],
                     "bytes_per_1k_tokens": kvb / ready["nCtx"] * 1000,
                     "bpv_nominal": pair_bpv(k, v, bpv_tables.get(build, {}))})
    f16 = next((r for r in rows if r.get("cache") == DEFAULT and "kv_bytes" in r), None)
    for r in rows:
        if f16 and "kv_bytes" in r:
            r["bpv_effective"] = cachetypes.get(DEFAULT).bits * r["bytes_per_token"] / f16["bytes_per_token"]
    speed = bool(getattr(args, "speed", False))
    if speed:
        measure_speed(args, model, rows)
    return {"params": {"n_ctx": n_ctx, "model": model, "build": args.build, "cache": [r["cache"] for r in rows],
                       **({"speed": True, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                           "repeats": args.repeats, "threads": threads(args)} if speed else {})},
            "machine_start": m0, "rows": rows, "server_problems": problems,
            "notes": [f"one server per type: nCtx {n_ctx}, nSeqMax 1, {cachetypes.attention_note()}; kvBytes is what "
                      "llama.cpp reports allocating (parsed from its log, MiB with 2 decimals)",
                      "the cache is unified: a sequence of L tokens uses L x bytes/token",
                      "effective bits/value = 16 x bytes/token / f16 bytes/token"]}


def measure_speed(args: Any, model: str, rows: list[dict[str, Any]]) -> None:
    """llama-bench pp/tg per cache type (what `make kv-study` reports), every repetition kept."""
    p, g, t = args.prompt_tokens, args.tokens, threads(args)
    for r in rows:
        if "kv_bytes" not in r:
            continue
        progress(f"kv: llama-bench pp{p} tg{g} x{args.repeats}, {r['cache']} ({r['build']})")
        try:
            res = llama_bench_kv(model, p, g, t, r["cache_k"], r["cache_v"], r["build"], args.repeats)
        except Exception as e:  # noqa: BLE001 - a type the tool refuses is a result too
            r["speed_error"] = str(e)
            continue
        r.update({"pp_tps": summary(res["pp"]["samples_ts"]), "tg_tps": summary(res["tg"]["samples_ts"]),
                  "speed_cmd": res["cmd"]})
    f16 = next((r for r in rows if r.get("cache") == DEFAULT and "pp_tps" in r), None)
    for r in rows:
        if f16 and "pp_tps" in r:
            r["pp_vs_f16"] = ratio(r["pp_tps"]["median"], f16["pp_tps"]["median"])
            r["tg_vs_f16"] = ratio(r["tg_tps"]["median"], f16["tg_tps"]["median"])


def speed_table(out: dict[str, Any]) -> str:
    pr = out["params"]
    rows = []
    for r in out["rows"]:
        if "pp_tps" in r:
            rows.append((r["cache"], r["build"], r["pp_tps"]["median"], f"{r['pp_tps']['min']:.1f}-{r['pp_tps']['max']:.1f}",
                         r.get("pp_vs_f16"), r["tg_tps"]["median"],
                         f"{r['tg_tps']['min']:.1f}-{r['tg_tps']['max']:.1f}", r.get("tg_vs_f16")))
        elif "speed_error" in r:
            rows.append((r["cache"], r["build"], None, f"error: {r['speed_error'][:60]}", None, None, "", None))
    return markdown(["K/V", "build", f"pp{pr['prompt_tokens']} tok/s median", "min-max", "vs f16",
                     f"tg{pr['tokens']} tok/s median", "min-max", "vs f16"], rows, align="llrrrrrr")


def table(out: dict[str, Any]) -> str:
    rows = []
    for r in out["rows"]:
        if "error" in r:
            rows.append((r["cache"], r["build"], None, None, None, None, None, f"error: {r['error']}"))
            continue
        rows.append((r["cache"], r["build"], r["kv_bytes"], r["bytes_per_token"],
                     r["bytes_per_1k_tokens"] / 2**20, r["bpv_nominal"], r.get("bpv_effective"), ""))
    n = out["params"]["n_ctx"]
    return markdown(["K/V", "build", f"kvBytes ({n} cells = 1 seq of {n})", "bytes/token",
                     "MiB / 1k tokens", "bits/value nominal", "bits/value effective", "note"], rows,
                    align="llrrrrrl")


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args, prompt_tokens=512)
    out = measure(args)
    text = table(out)
    if out["params"].get("speed"):
        pr = out["params"]
        text += (f"\n\nSpeed: llama-bench -fa 1 -p {pr['prompt_tokens']} -n {pr['tokens']} -t {pr['threads']} "
                 f"-r {pr['repeats']} of the type's build (median and min-max of the repetitions)\n\n"
                 + speed_table(out))
    emit(out_dir(args), "kv", out, text, "KV cache memory per cache type")
    if args.plot:
        pts = [(r["cache"], r.get("bpv_nominal") or r.get("bpv_effective"), r["bytes_per_1k_tokens"] / 2**20)
               for r in out["rows"] if "kv_bytes" in r]
        plot_points(png(args, "kv"), pts, "bits per value", "MiB per 1,000 tokens",
                    "KV cache memory vs bits per value")
    return out
