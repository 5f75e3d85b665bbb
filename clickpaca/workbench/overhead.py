"""The Workbench's own cost: `generate` of N prompts against the same requests sent by
hand through the Client, on one server, in alternating rounds.

    .venv/bin/python -m clickpaca.workbench.overhead --prompts 64 --tokens 32 --rounds 5

By hand is what a careful user of the Client writes: seq_ids 0..N-1 chosen by hand
(N = nSeqMax, so no waves are needed), every infer in one write, then each sequence's
events collected as dicts. Both sides decode greedily with the end-of-generation tokens
banned, so every request yields exactly --tokens tokens and both sides do the same
work. tokens/s = all generated tokens / wall time from the first send to the last end;
the ratio is Workbench / by hand per round pair, and the run is recorded in the results
store (command `bench workbench-overhead`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import orjson

from .api import Workbench

EOG = (1, 106, 212)


def by_hand(wb: Workbench, prompts: list[str], params: dict) -> tuple[int, float]:
    c = wb.client
    lines = [orjson.dumps({"type": "infer", "seq_id": i, "prompt": p, **params}) + b"\n"
             for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    c.send_raw(b"".join(lines))
    tokens = 0
    for i in range(len(prompts)):
        toks, final = c.collect(i)
        assert final["type"] == "done", final
        tokens += len(toks)
    return tokens, time.perf_counter() - t0


def with_workbench(wb: Workbench, prompts: list[str], params: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    gens = wb.generate(prompts, progress=False, **params)
    wall = time.perf_counter() - t0
    assert not gens.errors, gens.errors[0].error
    return sum(len(g.tokens) for g in gens), wall


def measure(n: int, tokens: int, rounds: int, threads: int | None = None) -> dict:
    prompts = [f"Story number {i}: once upon a time" for i in range(n)]
    params = {"maxTokens": tokens, "temperature": 0, "logit_bias": [{"token": t, "bias": -1e9} for t in EOG]}
    sides = {"by_hand": by_hand, "workbench": with_workbench}
    tps: dict[str, list[float]] = {k: [] for k in sides}
    with Workbench.spawn(nCtx=n * (tokens + 32), nSeqMax=n, nThreads=threads) as wb:
        with_workbench(wb, prompts[:4], {**params, "maxTokens": 4})  # warm up (graphs, tokenizer)
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                got, wall = sides[name](wb, prompts, params)
                assert got == n * tokens, (name, got)
                tps[name].append(got / wall)
        ready = wb.ready
    ratios = [w / h for w, h in zip(tps["workbench"], tps["by_hand"])]

    def summary(v: list[float]) -> dict:
        return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}

    return {"params": {"prompts": n, "tokens": tokens, "rounds": rounds, "threads": ready.get("nThreads")},
            "rows": [{"name": k, "tps": summary(v)} for k, v in tps.items()],
            "ratio": summary(ratios), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    out = measure(args.prompts, args.tokens, args.rounds, args.threads)
    out["loadavg_start"] = load0
    for r in out["rows"]:
        s = r["tps"]
        print(f"{r['name']:10s} {s['median']:8.1f} tok/s (min {s['min']:.1f}, max {s['max']:.1f})")
    s = out["ratio"]
    print(f"ratio workbench / by hand: median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}) "
          f"over {args.rounds} alternating rounds; load average {load0[0]:.2f} -> {out['loadavg'][0]:.2f}")
    if not args.no_record:
        from ..results.record import attach

        run = attach("workbench-overhead", out)
        print(f"recorded as run {run}", file=sys.stderr)
    print(json.dumps(out["ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
