"""The sampler chain of an earlier commit against this tree's, alternating in one process.

``python -m clickpaca.measure.bench.sampler_against REV [--rounds N] [--threads T]``: extracts
REV's ``clickpaca/sampling`` (git archive) into a temporary directory as a package of
its own, then alternates, round by round, both microbenchmarks (synthetic rows) and
both chains on the same 64 real logits rows of the default model: thread CPU us per
token per sequence, best round; both ``batch.sample_tick`` (REV's when it has one) over
the same rows as one tick, thread CPU and wall, and this tree's on T threads (wall: the
other threads' CPU is not this thread's). For an "old against new in one run" table on
a shared machine.

``--seqs 1,8,64``: instead, ``bench sampler --seqs``'s ticks (sampler_ticks) with REV's
sides (per sequence, batched) beside this tree's (per sequence, batched, on T threads),
each on samplers of its own, on the same logits of every tick, results checked equal.
"""

from __future__ import annotations

import argparse
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from ...sampling import SequenceSampler
from ...sampling import bench as NB
from ...sampling.batch import sample_tick
from .sampler import real_rows
from ...results.table import markdown

COLUMNS = ("old_synthetic", "new_synthetic", "old_real", "new_real", "old_batched_real", "new_batched_real",
           "old_batched_wall", "new_batched_wall", "new_threads_wall")


def load_old(rev: str, into: Path):
    """REV's clickpaca/sampling imported as the package ``sampling_old``."""
    root = Path(__file__).resolve().parents[3]
    data = subprocess.run(["git", "-C", str(root), "archive", rev, "clickpaca/sampling"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "clickpaca" / "sampling").rename(into / "sampling_old")
    sys.path.insert(0, str(into))
    return importlib.import_module("sampling_old"), importlib.import_module("sampling_old.bench")


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


def compare(rev: str, rounds: int = 3, threads: int = 2) -> tuple[dict, dict]:
    """({scenario: {column: us}}, calibration {row_max, row_exp}: the minimum of both sides)."""
    with tempfile.TemporaryDirectory(prefix="clkp-old-sampling-") as tmp:
        old, OB = load_old(rev, Path(tmp))
        old_tick = _old_tick(old)
        names = [k for k in NB.SCENARIOS if k != "trace" and k in OB.SCENARIOS]
        real = real_rows(64, None)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.bench.sampler_against")
    ap.add_argument("rev", help="the earlier commit (its clickpaca/sampling)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="this tree's threaded tick (default 2)")
    ap.add_argument("--seqs", default=None, help="comma list: per-tick sides on the real decode instead")
    a = ap.parse_args(argv)
    if a.seqs:
        from . import sampler_ticks as T

        out = ticks(a.rev, [int(x) for x in a.seqs.split(",")], a.threads)
        print(T.table(out))
        print("\nus per token per sequence, CPU of this thread: " + "; ".join(
            f"{t['n_seq']} {name}: " + ", ".join(f"{side} {s[f'us_per_token_per_seq_{side}']}" for side in t["sides"])
            for t in out for name, s in t["scenarios"].items()))
        return 0
    res, cal = compare(a.rev, a.rounds, a.threads)
    print(f"calibration (us): one np.max over a row {cal['row_max']:g}, one np.exp {cal['row_exp']:g}")
    print(markdown(["chain", *COLUMNS], [[k, *(round(d[c], 1) if c in d else None for c in COLUMNS)]
                                         for k, d in res.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
