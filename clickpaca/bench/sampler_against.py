"""The sampler chain of an earlier commit against this tree's, alternating in one process.

``python -m clickpaca.bench.sampler_against REV [--rounds N]``: extracts REV's
``clickpaca/sampling`` (git archive) into a temporary directory as a package of its own,
then alternates, round by round, both microbenchmarks (synthetic rows) and both chains
on the same 64 real logits rows of the default model: thread CPU us per token per
sequence, best round, and this tree's ``batch.sample_tick`` over the same rows. For an
"old against new in one run" table on a shared machine (issue 29).
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

from ..sampling import SequenceSampler
from ..sampling import bench as NB
from ..sampling.batch import sample_tick
from .sampler import real_rows
from .table import markdown

COLUMNS = ("old_synthetic", "new_synthetic", "new_batched_synthetic", "old_real", "new_real", "new_batched_real")


def load_old(rev: str, into: Path):
    """REV's clickpaca/sampling imported as the package ``sampling_old``."""
    root = Path(__file__).resolve().parents[2]
    data = subprocess.run(["git", "-C", str(root), "archive", rev, "clickpaca/sampling"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "clickpaca" / "sampling").rename(into / "sampling_old")
    sys.path.insert(0, str(into))
    return importlib.import_module("sampling_old"), importlib.import_module("sampling_old.bench")


def _on_rows(make, scenarios, names, rows, hist, res, key, batched):
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
        d[key] = min(d.get(key, float("inf")), (time.thread_time_ns() - c0) / len(rows) / 1e3)
        if batched and mask is None:
            forks = [s.fork() for _ in range(len(rows))]
            c0 = time.thread_time_ns()
            sample_tick(forks, rows, list(range(len(rows))))
            v = (time.thread_time_ns() - c0) / len(rows) / 1e3
            d["new_batched_real"] = min(d.get("new_batched_real", float("inf")), v)


def compare(rev: str, rounds: int = 3) -> tuple[dict, dict]:
    """({scenario: {column: us}}, calibration {row_max, row_exp}: the minimum of both sides)."""
    with tempfile.TemporaryDirectory(prefix="clkp-old-sampling-") as tmp:
        old, OB = load_old(rev, Path(tmp))
        names = [k for k in NB.SCENARIOS if k != "trace" and k in OB.SCENARIOS]
        real = real_rows(64, None)
        res: dict = {}
        cal: dict = {}
        for _ in range(rounds):
            o = OB.microbench(repeats=100, rounds=1, scenarios={k: OB.SCENARIOS[k] for k in names})
            n = NB.microbench(repeats=100, rounds=1, scenarios={k: NB.SCENARIOS[k] for k in names})
            for k in names:
                d = res.setdefault(k, {})
                for col, v in (("old_synthetic", o[k]["chain"]), ("new_synthetic", n[k]["chain"]),
                               ("new_batched_synthetic", n[k].get("batched"))):
                    if v is not None:
                        d[col] = min(d.get(col, float("inf")), v)
            for c in ("row_max", "row_exp"):
                cal[c] = min(cal.get(c, float("inf")), o["calibration"][c], n["calibration"][c])
            if real is not None:
                _on_rows(old.SequenceSampler, OB.SCENARIOS, names, real[0], real[1], res, "old_real", False)
                _on_rows(SequenceSampler, NB.SCENARIOS, names, real[0], real[1], res, "new_real", True)
        sys.path.remove(tmp)
    return res, cal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.bench.sampler_against")
    ap.add_argument("rev", help="the earlier commit (its clickpaca/sampling)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    res, cal = compare(a.rev, a.rounds)
    print(f"calibration (us): one np.max over a row {cal['row_max']:g}, one np.exp {cal['row_exp']:g}")
    print(markdown(["chain", *COLUMNS], [[k, *(round(d[c], 1) if c in d else None for c in COLUMNS)]
                                         for k, d in res.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
