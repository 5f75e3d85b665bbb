"""Two builds of the same source against each other: pp512 and tg64 of llama-bench from
each build's bin/, in alternating rounds of one run (the order flips every round), with
the per-round ratio: portable against native (docs/DETERMINISM.md, "Native or portable"):

    python -m clickpaca.measure.bench.builds portable mainline --rounds 5

(`builds/portable` linked to the PORTABLE=1 build, as `make test-portable` leaves it in
the cache: `ln -s ~/.cache/clickpaca/builds/mainline-...-<key> builds/portable`)."""

from __future__ import annotations

import argparse
import os
import statistics

from ...llama.models import resolve_model
from .tools import parse_llama_bench_json, run_tool, tool_path


def one_round(build: str, model: str, threads: int) -> dict[str, float]:
    """tokens/s of pp512 and tg64 in one llama-bench run of `build` (one repetition)."""
    out, _ = run_tool([str(tool_path("llama-bench", build)), "-m", model, "-p", "512", "-n", "64",
                       "-t", str(threads), "-r", "1", "-o", "json"])
    return {("pp512" if r["n_prompt"] else "tg64"): r["avg_ts"] for r in parse_llama_bench_json(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.bench.builds", description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="the build measured (e.g. portable)")
    ap.add_argument("against", help="the build it is divided by (e.g. mainline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = str(resolve_model(None))
    runs: dict[str, list[dict[str, float]]] = {args.build: [], args.against: []}
    for r in range(args.rounds):
        order = [args.build, args.against] if r % 2 == 0 else [args.against, args.build]
        for b in order:
            runs[b].append(one_round(b, model, args.threads))
        load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
        print(f"round {r}: " + ", ".join(f"{b} pp512 {runs[b][-1]['pp512']:.1f} tg64 {runs[b][-1]['tg64']:.1f}"
                                         for b in runs) + f" t/s (load {load})", flush=True)
    for test in ("pp512", "tg64"):
        ratios = [a[test] / b[test] for a, b in zip(runs[args.build], runs[args.against])]
        print(f"{test}: {args.build}/{args.against} median {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); medians "
              f"{statistics.median(x[test] for x in runs[args.build]):.1f} and "
              f"{statistics.median(x[test] for x in runs[args.against]):.1f} t/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
