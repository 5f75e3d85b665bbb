"""`clickpaca bench sampler --seqs 1,8,64`: the host's sampling time per tick beside the
decode of the same tick.

For each sequence count n: one context, n sequences with the same short prompt, then
a few ticks of one token per sequence. Each tick's decode is timed (wall), then every
scenario samples the tick's [n, n_vocab] logits block twice, per sequence (one
``SequenceSampler.sample`` per row, as the engine does today) and batched
(``sampling.batch.sample_tick``), on forks of the same samplers: host ms per tick (CPU
of this thread and wall) and host / decode. The greedy tokens feed the next tick.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ..sampling import SequenceSampler
from ..sampling.batch import sample_tick
from ..sampling.bench import SCENARIOS
from .stats import progress
from .table import markdown

TICKS = 4
PROMPT_TOKENS = 16
TICK_SCENARIOS = tuple(k for k in SCENARIOS if k not in ("trace", "grammar_10pct"))


def _timed(f) -> tuple[float, float, Any]:
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    r = f()
    return (time.thread_time_ns() - c0) / 1e6, (time.perf_counter_ns() - w0) / 1e6, r


def measure(seqs: list[int], model_path: str | None = None, n_threads: int | None = None,
            ticks: int | None = None) -> list[dict[str, Any]]:
    """[{n_seq, decode_ms, scenarios: {name: {per_seq_cpu_ms, per_seq_wall_ms, batched_cpu_ms,
    batched_wall_ms, fraction_per_seq, fraction_batched}}}], medians over the ticks."""
    from .. import core
    from ..models import resolve_model
    from .texts import read_text

    ticks = ticks or TICKS
    model = core.Model(resolve_model(model_path))
    text, _ = read_text(None)
    prompt = model.tokenize(text[:2000])[:PROMPT_TOKENS]
    out = []
    try:
        for n in seqs:
            progress(f"sampler ticks: {n} sequences")
            ctx = core.Context(model, n_ctx=max(512, n * (len(prompt) + ticks + 4)),
                               n_batch=max(512, n * len(prompt)), n_seq_max=n, n_threads=n_threads)
            try:
                out.append(_one(ctx, core, model, prompt, n, ticks))
            finally:
                ctx.close()
    finally:
        model.close()
    return out


def _one(ctx, core, model, prompt, n, ticks) -> dict[str, Any]:
    V = model.n_vocab
    batch = core.Batch(model.nat, max(n * len(prompt), n))
    for s in range(n):
        batch.add(prompt, 0, s)
    if ctx.decode(batch):
        raise RuntimeError("prompt decode failed")
    samplers = {name: [SequenceSampler(p.replace(seed=1000 + s), V, prompt) for s in range(n)]
                for name, (p, density) in SCENARIOS.items() if name in TICK_SCENARIOS}
    rows = list(range(n))
    pos = len(prompt)
    dec: list[float] = []
    per: dict[str, dict[str, list[float]]] = {k: {} for k in samplers}
    for t in range(ticks + 1):
        if t:
            batch.clear()
            for s in range(n):
                batch.add([tokens[s]], pos, s)
            w0 = time.perf_counter_ns()
            if ctx.decode(batch):
                raise RuntimeError("decode failed")
            dec.append((time.perf_counter_ns() - w0) / 1e6)
            pos += 1
        logits = ctx.logits()
        for name, ss in samplers.items():
            forks = [s.fork() for s in ss]
            c1, w1, r1 = _timed(lambda: [s.sample(logits[i]) for s, i in zip(ss, rows)])
            c2, w2, r2 = _timed(lambda: sample_tick(forks, logits, rows))
            if repr(r1) != repr(r2):
                raise AssertionError(f"{name}: batched results differ from per-sequence ones")
            for s, r in zip(ss, r1):
                s.accept(r.token)
            if t:  # tick 0 (after the prompt) warms up
                for k, v in (("per_seq_cpu_ms", c1), ("per_seq_wall_ms", w1),
                             ("batched_cpu_ms", c2), ("batched_wall_ms", w2)):
                    per[name].setdefault(k, []).append(v)
            if name == "greedy":
                tokens = [r.token for r in r1]
    d = statistics.median(dec)
    res = {"n_seq": n, "decode_ms": round(d, 2), "ticks": ticks, "scenarios": {}}
    for name, m in per.items():
        med = {k: statistics.median(v) for k, v in m.items()}
        res["scenarios"][name] = {**{k: round(v, 3) for k, v in med.items()},
                                  "us_per_token_per_seq": round(med["per_seq_cpu_ms"] * 1e3 / n, 1),
                                  "us_per_token_per_seq_batched": round(med["batched_cpu_ms"] * 1e3 / n, 1),
                                  "fraction_per_seq": round(med["per_seq_wall_ms"] / d, 4),
                                  "fraction_batched": round(med["batched_wall_ms"] / d, 4)}
    return res


def table(ticks: list[dict[str, Any]]) -> str:
    rows = []
    for t in ticks:
        for name, s in t["scenarios"].items():
            rows.append([t["n_seq"], name, t["decode_ms"], s["per_seq_wall_ms"], s["batched_wall_ms"],
                         s["fraction_per_seq"], s["fraction_batched"], s["us_per_token_per_seq"],
                         s["us_per_token_per_seq_batched"]])
    return markdown(["seqs", "scenario", "decode ms (tick)", "host ms per seq (wall)", "host ms batched (wall)",
                     "host / decode", "host / decode batched", "us/token/seq CPU", "us/token/seq batched CPU"],
                    rows)
