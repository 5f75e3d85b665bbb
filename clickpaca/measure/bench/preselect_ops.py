"""What the pre-selection's graph ops add to a decode on this machine.

``python -m clickpaca.measure.bench.preselect_ops [--seqs 8,64] [--rounds 7] [--threads N]``:
one context with a presampler (llama/presample.py) on the default model, N sequences
with a short prompt each, then decode ticks of one token per sequence (every row an
output), alternating, two ticks at a time, between the orders of each chain (the graph builds
its ops for every row) and no orders (every row passes through whole, as on the host
path): the second tick of each pair reuses the first's graph, as a steady state does, and
the difference of their median decode times is what the ops cost; the first ticks (a
new graph, and llama.cpp's re-reserve of its scheduler) are shown apart. A plain context
without samplers is timed in the same alternation, so the cost of having backend
samplers at all (llama.cpp's padded logits copy, the copies of whole rows) shows too. The host's
own work is `bench sampler`'s; this is the decode's side of the trade.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ...llama import core, native
from ...llama.models import resolve_model
from ...llama.presample import Presampler
from ...results.table import markdown
from ...sampling import fastpath
from ...sampling.bench import SCENARIOS, random_mask
from ...sampling.chain import SequenceSampler

PROMPT = "The capital of France is"


def _prefill(ctx: core.Context, batch: core.Batch, toks: list[int], n: int) -> None:
    ctx.clear()
    batch.clear()
    for s in range(n):
        batch.add(toks, 0, s, output_last=True)
    if ctx.decode(batch) != 0:
        raise RuntimeError("prefill failed")


def _tick(ctx: core.Context, batch: core.Batch, pos: int, n: int) -> float:
    batch.clear()
    for s in range(n):
        batch.add([1000 + s], pos, s, output_last=True)
    t0 = time.perf_counter()
    if ctx.decode(batch) != 0:
        raise RuntimeError("decode failed")
    ctx.logits()  # the reorder llama.cpp does on the first read counts too
    return (time.perf_counter() - t0) * 1000


def measure(seqs: list[int], rounds: int, threads: int, chains: list[str]) -> list[dict]:
    nat = native.load("mainline")
    model = core.Model(resolve_model(), nat=nat)
    toks = model.tokenize(PROMPT).tolist()
    n_max = max(seqs)
    ps = Presampler(nat, model.n_vocab, n_max)
    n_ctx = n_max * (len(toks) + 2 * (rounds + 1) * (len(chains) + 2) + 8)
    with_ps = core.Context(model, n_ctx=n_ctx, n_batch=max(512, n_max * len(toks)), n_seq_max=n_max,
                           n_threads=threads, presampler=ps)
    plain = core.Context(model, n_ctx=n_ctx, n_batch=max(512, n_max * len(toks)), n_seq_max=n_max,
                         n_threads=threads)
    rng = np.random.default_rng(0)
    out = []
    try:
        for n in seqs:
            samplers = {c: [SequenceSampler(SCENARIOS[c][0].replace(seed=i), model.n_vocab, toks)
                            for i in range(n)] for c in chains}
            masks = {c: random_mask(rng, model.n_vocab, SCENARIOS[c][1]) if SCENARIOS[c][1] else None
                     for c in chains}
            times: dict[str, list[float]] = {k: [] for k in ["plain", "pass-through", *chains]}
            costs: dict[str, dict] = {}
            for ctx in (with_ps, plain):
                _prefill(ctx, core.Batch(nat, max(512, n * len(toks))), toks, n)
            batch = core.Batch(nat, max(512, n))
            pos = {id(with_ps): len(toks), id(plain): len(toks)}  # each context's next position
            sides = ["plain", "pass-through", *chains]
            firsts: dict[str, list[float]] = {k: [] for k in sides[1:]}
            for r in range(rounds + 1):  # round 0 warms up
                for side in (sides if r % 2 else sides[::-1]):
                    ctx = plain if side == "plain" else with_ps
                    # two ticks a side: its first builds a graph for its orders (a new plan:
                    # llama.cpp re-reserves), the second reuses it, as a steady state does
                    for tick in range(2):
                        if side != "plain":
                            ps.order({} if side == "pass-through" else
                                     {s: fastpath.order(samplers[side][s], masks[side]) for s in range(n)})
                        ms = _tick(ctx, batch, pos[id(ctx)], n)
                        pos[id(ctx)] += 1
                        if r and tick == 1:
                            times[side].append(ms)
                            if side in chains:
                                costs[side] = dict(ps.cost)
                        elif r and side != "plain":
                            firsts[side].append(ms)
            base = statistics.median(times["pass-through"])
            row = {"seqs": n, **{k: round(statistics.median(v), 2) for k, v in times.items()}}
            row["first_tick_ms"] = {k: round(statistics.median(v), 2) for k, v in firsts.items()}
            row["ops_ms"] = {c: round(statistics.median(times[c]) - base, 2) for c in chains}
            row["ops_per_row_us"] = {c: round(1000 * row["ops_ms"][c] / n, 1) for c in chains}
            row["callback_us_per_row"] = {c: round(costs[c]["callback_ns"] / 1000 / n, 1) for c in chains}
            row["bytes_per_row"] = {c: {"up": costs[c]["up_bytes"] // n, "down": costs[c]["down_bytes"] // n}
                                    for c in chains}
            out.append(row)
    finally:
        with_ps.close()
        plain.close()
        model.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chains", default="greedy,default,temperature_only,top_p_only,n_probs_5,grammar_10pct")
    a = ap.parse_args(argv)
    chains = a.chains.split(",")
    rows = measure([int(x) for x in a.seqs.split(",")], a.rounds, a.threads, chains)
    print(markdown(["seqs", "plain decode ms", "samplers, rows whole ms"] + [f"{c} ms" for c in chains],
                   [[r["seqs"], r["plain"], r["pass-through"]] + [r[c] for c in chains] for r in rows]))
    print()
    print(markdown(["seqs"] + [f"{c}: first tick of its plan ms" for c in ["pass-through", *chains]],
                   [[r["seqs"]] + [r["first_tick_ms"][c] for c in ["pass-through", *chains]] for r in rows]))
    print()
    print(markdown(["seqs"] + [f"{c}: ops per row us" for c in chains],
                   [[r["seqs"]] + [r["ops_per_row_us"][c] for c in chains] for r in rows]))
    print()
    print(markdown(["seqs", "chain", "callbacks us per row (host)", "bytes up per row", "bytes down per row"],
                   [[r["seqs"], c, r["callback_us_per_row"][c], r["bytes_per_row"][c]["up"],
                     r["bytes_per_row"][c]["down"]] for r in rows for c in chains]))


if __name__ == "__main__":
    main()
