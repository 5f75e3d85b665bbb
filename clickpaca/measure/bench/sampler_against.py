"""`clickpaca bench sampler --against REV`: an earlier commit's sampler chain against this
tree's, alternating in one process.

REV's ``clickpaca/sampling`` (against.py) is imported beside this tree's (REV's package
renamed ``clickpaca_old``); then, round
by round, both microbenchmarks (synthetic rows) and both chains on the same 64 real logits
rows of the default model: thread CPU us per token per sequence, best round; both
``batch.sample_tick`` (REV's when it has one) over the same rows as one tick, thread CPU
and wall, and this tree's on T threads (wall: the other threads' CPU is not this thread's).

With ``--seqs 1,8,64``: instead, ``bench sampler --seqs``'s ticks (sampler_ticks) with REV's
sides (per sequence, batched) beside this tree's (per sequence, batched, on T threads),
each on samplers of its own, on the same logits of every tick, results checked equal
(the fields both result types have).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ...sampling import SequenceSampler
from ...sampling import bench as NB
from ...sampling.batch import sample_tick
from .against import extract
from ...results.table import markdown

COLUMNS = ("old_synthetic", "new_synthetic", "old_real", "new_real", "old_batched_real", "new_batched_real",
           "old_batched_wall", "new_batched_wall", "new_threads_wall")


def load_old(rev: str, into: Path):
    """REV's clickpaca/sampling, imported from REV's whole package renamed ``clickpaca_old``
    (its relative imports reach REV's own base/ and llama/); returns it and its bench."""
    extract(rev, into)
    (into / "clickpaca").rename(into / "clickpaca_old")
    sys.path.insert(0, str(into))
    return (importlib.import_module("clickpaca_old.sampling"),
            importlib.import_module("clickpaca_old.sampling.bench"))


def _best(d: dict, key: str, v: float) -> None:
    d[key] = min(d.get(key, float("inf")), v)


def _on_rows(make, tick, scenarios, names, rows, hist, res, side, threads):
    """Per scenario: one sampler over the rows in turn (CPU), then forks of it over the
    rows as one tick through ``tick`` (CPU and wall; this tree's also on ``threads``)."""
    rng = np.random.default_rng(0)
    for name in names:
        params, density = scenarios[name]
        mask = NB.random_mask(rng, rows.shape[1], density) if density is not None else None
        s = make(params.replace(seed=0), rows.shape[1], hist[:64].tolist())
        for r in rows[:2]:
            s.sample(r, mask)
        c0 = time.thread_time_ns()
        for r in rows:
            s.sample(r, mask)
        d = res.setdefault(name, {})
        _best(d, f"{side}_real", (time.thread_time_ns() - c0) / len(rows) / 1e3)
        if tick is None or mask is not None:
            continue
        for key, kw in (("batched", {}), ("threads", {"threads": threads})):
            if key == "threads" and side != "new":
                continue
            forks = [s.fork() for _ in range(len(rows))]
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            tick(forks, rows, list(range(len(rows))), **kw)
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            if key == "batched":
                _best(d, f"{side}_batched_real", (c1 - c0) / len(rows) / 1e3)
            _best(d, f"{side}_{key}_wall", (w1 - w0) / len(rows) / 1e3)


def _old_tick(rev_pkg):
    try:
        return importlib.import_module(rev_pkg.__name__ + ".batch").sample_tick
    except ImportError:  # REV has no batched tick
        return None


def compare(rev: str, real: tuple[np.ndarray, np.ndarray] | None, rounds: int = 3,
            threads: int = 2) -> tuple[dict, dict]:
    """({scenario: {column: us}}, calibration {row_max, row_exp}: the minimum of both sides),
    on the real (logits rows, tokens) given (None: the synthetic rows only)."""
    with tempfile.TemporaryDirectory(prefix="clkp-old-sampling-") as tmp:
        old, OB = load_old(rev, Path(tmp))
        old_tick = _old_tick(old)
        names = [k for k in NB.SCENARIOS if k != "trace" and k in OB.SCENARIOS]
        res: dict = {}
        cal: dict = {}
        for _ in range(rounds):
            o = OB.microbench(repeats=100, rounds=1, scenarios={k: OB.SCENARIOS[k] for k in names}, batched=False)
            n = NB.microbench(repeats=100, rounds=1, scenarios={k: NB.SCENARIOS[k] for k in names}, batched=False)
            for k in names:
                d = res.setdefault(k, {})
                _best(d, "old_synthetic", o[k]["chain"])
                _best(d, "new_synthetic", n[k]["chain"])
            for c in ("row_max", "row_exp"):
                cal[c] = min(cal.get(c, float("inf")), o["calibration"][c], n["calibration"][c])
            if real is not None:
                _on_rows(old.SequenceSampler, old_tick, OB.SCENARIOS, names, real[0], real[1], res, "old", threads)
                _on_rows(SequenceSampler, sample_tick, NB.SCENARIOS, names, real[0], real[1], res, "new", threads)
        sys.path.remove(tmp)
    return res, cal


def ticks(rev: str, seqs: list[int], threads: int) -> list[dict]:
    """sampler_ticks.measure with REV's sides beside this tree's."""
    from . import sampler_ticks as T

    with tempfile.TemporaryDirectory(prefix="clkp-old-sampling-") as tmp:
        old, _ = load_old(rev, Path(tmp))
        old_tick = _old_tick(old)

        def make_old(p, V, prompt):
            return old.SequenceSampler(old.SamplerParams.from_request(p.to_request()), V, prompt)

        sides: T.Sides = {"old_per_seq": (make_old, lambda ss, lg, rows: [s.sample(lg[i]) for s, i in zip(ss, rows)])}
        if old_tick is not None:
            sides["old_batched"] = (make_old, lambda ss, lg, rows: old_tick(ss, lg, rows))
        sides.update({f"new_{k}": v for k, v in T.default_sides(threads).items()})
        try:
            return T.measure(seqs, None, threads, sides=sides)
        finally:
            sys.path.remove(tmp)


def table(res: dict, cal: dict) -> str:
    """`compare`'s figures, one row per chain, the calibration below."""
    return (markdown(["chain", *COLUMNS], [[k, *(round(d[c], 1) if c in d else None for c in COLUMNS)]
                                           for k, d in res.items()])
            + f"\n\ncalibration (us): one np.max over a row {cal['row_max']:g}, one np.exp {cal['row_exp']:g}")
