"""`clickpaca bench WHAT` and `bench all` (what `make bench` runs), from the rows of
benches.py, each run as measure/checks.py's `measured` runs every measuring command."""

from __future__ import annotations

import argparse
import copy
import sys
import time

from ...results.stats import progress
from ..checks import Refused, check, measured
from .benches import get, in_all

def run_bench(args: argparse.Namespace) -> int:
    if args.what != "all":
        bench = get(args.what)
        return measured(f"bench {bench.name}", args, bench.needs, bench.run)
    runs = []
    for bench in in_all():
        sub = copy.copy(args)
        sub.what = bench.name
        for k, v in bench.all.items():
            if getattr(sub, k, None) is None:  # what the user gave explicitly wins
                setattr(sub, k, v)
        runs.append((bench, sub))
    for bench, sub in runs:  # every bench's checks before any of them measures
        try:
            check(sub, bench.needs)
        except Refused as e:
            print(f"clickpaca bench all: {bench.name}: {e}", file=sys.stderr)
            return 2
    failed = []
    t0 = time.perf_counter()
    group = time.strftime("bench-all-%Y%m%dT%H%M%SZ", time.gmtime())
    for bench, sub in runs:
        sub.run_group = group
        progress(f"all: {bench.name} ({time.perf_counter() - t0:.0f} s so far)")
        try:
            if measured(f"bench {bench.name}", sub, (), bench.run) != 0:  # one failing bench does not stop the set
                failed.append(bench.name)
        except Exception as e:  # noqa: BLE001 - nor does a defect in one
            failed.append(f"{bench.name}: {e}")
            progress(f"all: {bench.name} FAILED: {e}")
    progress(f"all: done in {time.perf_counter() - t0:.0f} s")
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed else 0
