"""`clickpaca bench WHAT`: dispatch, and `bench all` (what `make bench` runs)."""

from __future__ import annotations

import argparse
import copy
import time

from ...llama.cachetypes import STUDY_CACHE
from ...results import recording
from ...results.stats import progress

WHATS = ("decode", "batch", "grammar", "sampler", "kv", "state", "peer")
#: benches outside `bench all`: they need an argument (schemas: a corpus)

#: `bench all`: the standard set (make bench); the peer bench against llama-server is part of
#: every run (the headline claim, re-measured whenever the scheduler changes).
ALL_PLAN = {
    "sampler": {"repeats": 3},
    "decode": {"tokens": 64, "repeats": 3},
    "batch": {"seqs": "1,8,64", "prompt_tokens": 32, "tokens": 32, "repeats": 2},
    "grammar": {"seqs": "1,8,64", "tokens": 32, "repeats": 3},
    "kv": {},
    "state": {"repeats": 3, "cache": STUDY_CACHE},
    "peer": {"repeats": 3},
}


def _module(what: str):
    from . import batch, decode, grammar, kv, peer, sampler, schemas, state

    return {"decode": decode, "batch": batch, "grammar": grammar, "sampler": sampler, "kv": kv,
            "state": state, "peer": peer, "schemas": schemas}[what]


def run_bench(args: argparse.Namespace) -> int:
    if args.what != "all":
        with recording(f"bench {args.what}", args):
            _module(args.what).run(args)
        return 0
    failed = []
    t0 = time.perf_counter()
    group = time.strftime("bench-all-%Y%m%dT%H%M%SZ", time.gmtime())
    for what, overrides in ALL_PLAN.items():
        sub = copy.copy(args)
        sub.what = what
        sub.run_group = group
        for k, v in overrides.items():
            if getattr(sub, k, None) is None:  # what the user gave explicitly wins
                setattr(sub, k, v)
        progress(f"all: {what} ({time.perf_counter() - t0:.0f} s so far)")
        try:
            with recording(f"bench {what}", sub):
                _module(what).run(sub)
        except Exception as e:  # noqa: BLE001 - one failing bench does not stop the set
            failed.append(f"{what}: {e}")
            progress(f"all: {what} FAILED: {e}")
    progress(f"all: done in {time.perf_counter() - t0:.0f} s")
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed else 0
