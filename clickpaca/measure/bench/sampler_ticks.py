"""`clickpaca bench sampler --seqs 1,8,64`: the host's sampling time per tick beside the
decode of the same tick.

For each sequence count n: one context, n sequences with the same short prompt, then
a few ticks of one token per sequence. Each tick's decode is timed (wall), then every
scenario samples the tick's [n, n_vocab] logits block once per side: per sequence (one
``SequenceSampler.sample`` per row), batched (``sampling.batch.sample_tick``) and
batched on the decode's threads (``threads=``); ``bench sampler --against REV --seqs`` adds an
earlier commit's sides. Each side has samplers of its own, and every side's results
must equal the first side's (checked, on the fields all their result types have). The
order of the sides turns round from tick to tick (the first side after a decode meets
the coldest rows). Host ms per tick: wall,
CPU of this thread, CPU of the process (all threads), and host / decode = wall over
wall. The greedy tokens feed the next tick.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import numpy as np

from ...sampling import SequenceSampler
from ...sampling.batch import sample_tick
from ...sampling.bench import SCENARIOS
from ...results.stats import progress
from ...results.table import markdown

TICKS = 4
PROMPT_TOKENS = 16
TICK_SCENARIOS = tuple(k for k in SCENARIOS if k not in ("trace", "grammar_10pct"))

#: side name -> (make a sampler from (new SamplerParams, n_vocab, prompt), sample a tick)
Sides = dict[str, tuple[Callable[..., Any], Callable[[list, np.ndarray, list], list]]]


def default_sides(threads: int) -> Sides:
    """This tree's three ways of sampling a tick."""
    return {"per_seq": (SequenceSampler, lambda ss, lg, rows: [s.sample(lg[i]) for s, i in zip(ss, rows)]),
            "batched": (SequenceSampler, lambda ss, lg, rows: sample_tick(ss, lg, rows)),
            "threads": (SequenceSampler, lambda ss, lg, rows: sample_tick(ss, lg, rows, threads=threads))}


def _timed(f) -> tuple[float, float, float, Any]:
    c0, p0, w0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
    r = f()
    return ((time.thread_time_ns() - c0) / 1e6, (time.process_time_ns() - p0) / 1e6,
            (time.perf_counter_ns() - w0) / 1e6, r)


def measure(seqs: list[int], model_path: str | None = None, n_threads: int | None = None,
            ticks: int | None = None, sides: Sides | None = None) -> list[dict[str, Any]]:
    """[{n_seq, decode_ms, scenarios: {name: {<side>_cpu_ms, <side>_proc_cpu_ms, <side>_wall_ms,
    fraction_<side>, ...}}}], medians over the ticks."""
    from ...llama import core
    from ...llama.models import resolve_model
    from ..texts import read_text

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
                out.append(_one(ctx, core, model, prompt, n, ticks, sides or default_sides(ctx.n_threads)))
            finally:
                ctx.close()
    finally:
        model.close()
    return out


def _shared_fields(results: list) -> tuple[str, ...]:
    """The fields every side's result type has (a SampleResult of an earlier commit may
    lack one added since, such as ``fallback``): the ones compared."""
    kinds = {type(r) for r in results}
    names = [tuple(f.name for f in dataclasses.fields(k)) for k in kinds]
    return tuple(f for f in names[0] if all(f in n for n in names[1:]))


def _seen(results: list, fields: tuple[str, ...]) -> str:
    """What is compared of a side's results: those fields, as repr writes them (NaN
    log-probabilities compare equal so)."""
    return repr([tuple(getattr(r, f) for f in fields) for r in results])


def _one(ctx, core, model, prompt, n, ticks, sides: Sides) -> dict[str, Any]:
    V = model.n_vocab
    batch = core.Batch(model.nat, max(n * len(prompt), n))
    for s in range(n):
        batch.add(prompt, 0, s)
    if ctx.decode(batch):
        raise RuntimeError("prompt decode failed")
    names = list(sides)
    samplers = {(name, side): [sides[side][0](p.replace(seed=1000 + s), V, prompt) for s in range(n)]
                for name, (p, density) in SCENARIOS.items() if name in TICK_SCENARIOS for side in names}
    rows = list(range(n))
    pos = len(prompt)
    dec: list[float] = []
    per: dict[str, dict[str, list[float]]] = {k: {} for k in TICK_SCENARIOS}
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
        order = names[t % len(names):] + names[:t % len(names)]
        for name in TICK_SCENARIOS:
            got = {}
            for side in order:
                ss, f = samplers[(name, side)], sides[side][1]
                cpu, proc, wall, got[side] = _timed(lambda: f(ss, logits, rows))
                for s, r in zip(ss, got[side]):
                    s.accept(r.token)
                if t:  # tick 0 (after the prompt) warms up
                    for k, v in (("cpu_ms", cpu), ("proc_cpu_ms", proc), ("wall_ms", wall)):
                        per[name].setdefault(f"{side}_{k}", []).append(v)
            shared = _shared_fields([r for side in names for r in got[side]])
            want = _seen(got[names[0]], shared)
            for side in names[1:]:
                if _seen(got[side], shared) != want:
                    raise AssertionError(f"{name}: {side}'s results differ from {names[0]}'s")
            if name == "greedy":
                tokens = [r.token for r in got[names[0]]]
    d = statistics.median(dec)
    res = {"n_seq": n, "decode_ms": round(d, 2), "ticks": ticks, "sides": names, "scenarios": {},
           "samples": per}
    for name, m in per.items():
        med = {k: statistics.median(v) for k, v in m.items()}
        row = {k: round(v, 3) for k, v in med.items()}
        for side in names:
            row[f"fraction_{side}"] = float(f"{med[f'{side}_wall_ms'] / d:.4g}")  # 4 digits, however small
            row[f"us_per_token_per_seq_{side}"] = round(med[f"{side}_cpu_ms"] * 1e3 / n, 1)
        res["scenarios"][name] = row
    return res


def table(ticks: list[dict[str, Any]]) -> str:
    """One row per (seqs, scenario): the decode, then each side's wall ms and host / decode."""
    names = ticks[0]["sides"] if ticks else []
    head = ["seqs", "scenario", "decode ms (tick)"]
    for side in names:
        head += [f"{side} host ms (wall)", f"{side} host / decode"]
    rows = []
    for t in ticks:
        for name, s in t["scenarios"].items():
            r = [t["n_seq"], name, t["decode_ms"]]
            for side in names:
                r += [s[f"{side}_wall_ms"], s[f"fraction_{side}"]]
            rows.append(r)
    return markdown(head, rows)
