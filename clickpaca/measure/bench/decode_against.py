"""The whole server of an earlier commit against this tree's: decode tokens/s at 1, 8 and
64 sequences, alternating rounds in one run.

``python -m clickpaca.measure.bench.decode_against REV [--rounds N] [--seqs 1,8,64]
[--tokens T] [--threads N]``: extracts REV's ``clickpaca/`` (git archive) into a
temporary directory and runs ``clickpaca serve`` from it (PYTHONPATH) and from this
tree, both on this checkout's builds (CLICKPACA_BUILDS) and the default model, each
server started once. Every round gives each side the same load: N greedy sequences of
T tokens, distinct prompts, started together; tokens/s is all sequences' tokens over
the wall time from the first request to the last `done`. The two sides alternate
(which goes first alternates too), so a change of load on a shared machine reaches both
alike; the table prints each side's median (min-max) and the ratio of medians,
new / old. For a restructuring's "no slowdown". Default mode (what users
run), or `--deterministic`: then a sequence's tokens do not depend on what shares its
decode, and the table says whether both sides generated the same greedy tokens in every
round (a speed-up that changed the output would not count). In default mode the batches
depend on when the requests arrive, so the tokens may part at near ties and are not
compared.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ...wire.client import Client
from ...results.table import markdown

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["The capital of France is", "Once upon a time", "In 1969, the first", "The best way to learn",
           "def fibonacci(n):", "Water boils at", "The three laws of", "My favourite recipe"]


def extract(rev: str, into: Path) -> Path:
    """REV's clickpaca/ package under ``into`` (importable with PYTHONPATH=into)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "clickpaca"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def spawn(pythonpath: Path, n_seq: int, threads: int, deterministic: bool) -> Client:
    env = {"PYTHONPATH": str(pythonpath), "CLICKPACA_BUILDS": str(ROOT / "builds")}
    c = Client.spawn(env=env, python=sys.executable)
    c.init(nCtx=max(2048, n_seq * 256), nSeqMax=n_seq, nThreads=threads, deterministic=deterministic)
    return c


def one_round(c: Client, n_seq: int, tokens: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    for s in range(n_seq):
        c.infer(s, f"{PROMPTS[s % len(PROMPTS)]} ({s})", maxTokens=tokens, temperature=0)
    out = []
    for s in range(n_seq):
        toks, done = c.collect(s)
        if done["type"] != "done":
            raise RuntimeError(f"sequence {s}: {done}")
        out.append([t["token"] for t in toks])
    wall = time.perf_counter() - t0
    return sum(map(len, out)) / wall, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.bench.decode_against",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the earlier commit (anything git archive takes)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic mode on both sides, and their tokens compared")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="clkp-against-") as tmp:
        old_root = extract(args.rev, Path(tmp))
        for n_seq in (int(x) for x in args.seqs.split(",")):
            sides = {side: spawn(root, n_seq, args.threads, args.deterministic)
                     for side, root in (("old", old_root), ("new", ROOT))}
            rates: dict[str, list[float]] = {"old": [], "new": []}
            same = True
            try:
                one_round(sides["old"], n_seq, 4), one_round(sides["new"], n_seq, 4)  # warm-up
                for r in range(args.rounds):
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    outs = {}
                    for side in order:
                        rate, outs[side] = one_round(sides[side], n_seq, args.tokens)
                        rates[side].append(rate)
                    same &= outs["old"] == outs["new"]
            finally:
                for c in sides.values():
                    c.close()
            med = {k: statistics.median(v) for k, v in rates.items()}
            rows.append([n_seq, *(f"{med[k]:.1f} ({min(rates[k]):.1f}-{max(rates[k]):.1f})" for k in ("old", "new")),
                         f"{med['new'] / med['old']:.3f}",
                         ("yes" if same else "no") if args.deterministic else "not compared"])
            print(f"{n_seq} sequences: old {med['old']:.1f} tok/s, new {med['new']:.1f} tok/s", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mode = "deterministic" if args.deterministic else "default"
    print(f"\n{args.rev} (old) against this tree (new): greedy, {mode} mode, {args.tokens} tokens per "
          f"sequence, {args.rounds} alternating rounds, {args.threads} threads, load {load:.1f} at the end")
    print(markdown(["sequences", "old tok/s median (min-max)", "new tok/s median (min-max)", "new / old",
                    "same tokens"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
