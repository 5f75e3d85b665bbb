"""`clickpaca bench sampler --against REV`: an earlier commit's sampler chain against this
tree's, alternating in one process.

REV's ``clickpaca/sampling`` (against.py) is imported beside this tree's (REV's package
renamed ``clickpaca_old``); then, round by round (the side that goes first turned each
round), both microbenchmarks (synthetic rows) and both chains on the same 64 real logits
rows of the default model: thread CPU us per token per sequence; both
``batch.sample_tick`` (REV's when it has one) over the same rows as one tick, thread CPU
and wall, and this tree's on T threads (wall: the other threads' CPU is not this thread's).
Every round is kept: the table gives each side's median and new / old per round (median,
min-max), the spread a difference has to leave to be one.

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
from ...results.stats import median, spread
from ...results.table import markdown

#: The measures both sides take, each a column pair (old, new) and a ratio new / old
PAIRED = ("synthetic", "real", "batched_real", "batched_wall")
#: Taken on this tree only (its tick on T threads)
NEW_ONLY = ("new_threads_wall",)


def load_old(rev: str, into: Path):
    """REV's clickpaca/sampling, imported from REV's whole package renamed ``clickpaca_old``
    (its relative imports reach REV's own base/ and llama/); returns it and its bench."""
    extract(rev, into)
    (into / "clickpaca").rename(into / "clickpaca_old")
    for name in [m for m in sys.modules if m == "clickpaca_old" or m.startswith("clickpaca_old.")]:
        del sys.modules[name]  # an earlier call's REV, its directory gone
    sys.path.insert(0, str(into))
    return (importlib.import_module("clickpaca_old.sampling"),
            importlib.import_module("clickpaca_old.sampling.bench"))


def _add(d: dict, key: str, v: float) -> None:
    d.setdefault(key, []).append(v)


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
        _add(d, f"{side}_real", (time.thread_time_ns() - c0) / len(rows) / 1e3)
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
                _add(d, f"{side}_batched_real", (c1 - c0) / len(rows) / 1e3)
            _add(d, f"{side}_{key}_wall", (w1 - w0) / len(rows) / 1e3)


def _old_tick(rev_pkg):
    try:
        return importlib.import_module(rev_pkg.__name__ + ".batch").sample_tick
    except ImportError:  # REV has no batched tick
        return None


def compare(rev: str, real: tuple[np.ndarray, np.ndarray] | None, rounds: int = 3,
            threads: int = 2) -> tuple[dict, dict]:
    """({scenario: {column: [us, one per round]}}, calibration {row_max, row_exp}: the
    minimum of both sides), on the real (logits rows, tokens) given (None: the synthetic
    rows only). Each round runs both sides, old first in even rounds, new first in odd."""
    with tempfile.TemporaryDirectory(prefix="clkp-old-sampling-") as tmp:
        old, OB = load_old(rev, Path(tmp))
        sides = {"old": (OB, old.SequenceSampler, _old_tick(old)), "new": (NB, SequenceSampler, sample_tick)}
        names = [k for k in NB.SCENARIOS if k != "trace" and k in OB.SCENARIOS]
        res: dict = {}
        cal: dict = {}
        for r in range(rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                bench, make, tick = sides[side]
                m = bench.microbench(repeats=100, rounds=1, scenarios={k: bench.SCENARIOS[k] for k in names},
                                     batched=False)
                for k in names:
                    _add(res.setdefault(k, {}), f"{side}_synthetic", m[k]["chain"])
                for c in ("row_max", "row_exp"):
                    cal[c] = min(cal.get(c, float("inf")), m["calibration"][c])
                if real is not None:
                    _on_rows(make, tick, bench.SCENARIOS, names, real[0], real[1], res, side, threads)
        sys.path.remove(tmp)
    return res, cal


def summary(res: dict) -> dict:
    """{scenario: {column: median, <measure>_ratio: {median, min, max, rounds}}}: each
    side's median per measure and new / old round by round."""
    out = {}
    for k, d in res.items():
        row = {c: median(v) for c, v in d.items()}
        for m in PAIRED:
            o, n = d.get(f"old_{m}"), d.get(f"new_{m}")
            if o and n:
                row[f"{m}_ratio"] = _per_round(o, n)
        out[k] = row
    return out


def _per_round(old: list[float], new: list[float]) -> dict:
    """new / old round by round (or tick by tick): median, min, max and the ratios."""
    per = [b / a for a, b in zip(old, new)]
    lo, hi = spread(per)
    return {"median": median(per), "min": lo, "max": hi, "rounds": [round(x, 4) for x in per]}


def _fmt(r: dict | None) -> str | None:
    """A _per_round result as the tables write it: median (min-max)."""
    return None if r is None else f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def ticks(rev: str, seqs: list[int], threads: int, n_ticks: int | None = None) -> list[dict]:
    """sampler_ticks.measure with REV's sides beside this tree's (``n_ticks`` ticks each)."""
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
            return T.measure(seqs, None, threads, ticks=n_ticks, sides=sides)
        finally:
            sys.path.remove(tmp)


def table(res: dict, cal: dict) -> str:
    """`compare`'s figures, one row per chain: per measure old and new (medians of the
    rounds) and new / old per round, median (min-max); the calibration below."""
    summ = summary(res)
    head = ["chain"] + [h for m in PAIRED for h in (f"old {m}", f"new {m}", f"new / old {m}")] + list(NEW_ONLY)
    rows = [[k] + [x for m in PAIRED
                   for x in (_r(d.get(f"old_{m}")), _r(d.get(f"new_{m}")), _fmt(d.get(f"{m}_ratio")))]
            + [_r(d.get(c)) for c in NEW_ONLY] for k, d in summ.items()]
    return (markdown(head, rows)
            + f"\n\ncalibration (us): one np.max over a row {cal['row_max']:g}, one np.exp {cal['row_exp']:g}")


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


#: (old side, new side) of the ticks compared tick by tick
TICK_PAIRS = (("old_per_seq", "new_per_seq"), ("old_batched", "new_batched"))


def ticks_table(ticks: list[dict]) -> str:
    """--seqs: one row per (seqs, scenario): the decode, each pair's host ms (wall, medians
    of the ticks) and new / old tick by tick, median (min-max)."""
    head = ["seqs", "scenario", "decode ms (tick)"]
    for o, n in TICK_PAIRS:
        head += [f"{o} ms", f"{n} ms", f"{n} / {o} per tick"]
    head += ["new_threads ms"]
    rows = []
    for t in ticks:
        for name, s in t["scenarios"].items():
            raw = t["samples"][name]
            r = [t["n_seq"], name, t["decode_ms"]]
            for o, n in TICK_PAIRS:
                a, b = raw.get(f"{o}_wall_ms"), raw.get(f"{n}_wall_ms")
                r += [s.get(f"{o}_wall_ms"), s.get(f"{n}_wall_ms"), _fmt(_per_round(a, b)) if a and b else None]
            rows.append(r + [s.get("new_threads_wall_ms")])
    return markdown(head, rows)
