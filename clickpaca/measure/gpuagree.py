"""The CPU reference a GPU pack carries, and the GPU run's check against it.

Why: a GPU run has no CPU build of its own to compare with, and comparing a GPU with the
machine that made the pack is the claim (the same file, the same requests, two backends).
`make` runs greedy requests (16 tokens, top 5 log-probabilities, each sequence alone) on
a build here and writes them; `check` runs the same requests on the build at hand and says,
per prompt, whether the tokens agree up to a near tie (the f16 cache's tolerance,
llama/cachetypes.py) and how far the chosen tokens' log-probabilities moved.

    python -m clickpaca.measure.gpuagree make --model M --build patched --out reference.json
    python -m clickpaca.measure.gpuagree check --model M --build patched --reference reference.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ..llama import cachetypes
from ..wire.client import Client

PROMPTS = ["The capital of France is", "Once upon a time", "My favourite colour is", "The weather today",
           "In 1492, Columbus", "The best way to learn", "Water boils at", "A haiku about the sea:"]
N_GEN, N_TOP = 16, 5
NEAR_TIE = cachetypes.get(cachetypes.DEFAULT, "cache type").near_tie


def greedy_runs(model: str, build: str) -> list[list]:
    """[(token, logprob, [(top token, logprob), ...]) per step] per prompt, each alone."""
    c = Client.spawn("--allow-any-path")
    try:
        c.init(modelPath=model, build=build, nCtx=4096, nSeqMax=8,
               cacheTypeK=cachetypes.DEFAULT, cacheTypeV=cachetypes.DEFAULT,
               stateDir=tempfile.mkdtemp(prefix="clkp-agree-"))
        out = []
        for i, p in enumerate(PROMPTS):
            c.infer(i, p, maxTokens=N_GEN, temperature=0, nProbs=N_TOP)
            toks, done = c.collect(i, timeout=600)
            if done["type"] != "done":
                raise RuntimeError(f"prompt {i}: {done}")
            out.append([[t["token"], t["logprob"], [[x["token"], x["logprob"]] for x in t["top"]]] for t in toks])
        return out
    finally:
        c.close()


def agree(a: list, b: list, near_tie: float = NEAR_TIE) -> tuple[bool, float]:
    """(b's tokens equal a's, or part first where a had a near tie; the largest difference of
    a chosen token's log-probability over the steps both share)."""
    moved = 0.0
    for x, y in zip(a, b):
        if x[0] != y[0]:
            top = {t: lp for t, lp in x[2]}
            return y[0] in top and top[x[0]] - top[y[0]] < near_tie, moved
        moved = max(moved, abs(x[1] - y[1]))
    return len(a) == len(b), moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.gpuagree", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["make", "check"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", default="mainline")
    ap.add_argument("--out", type=Path, help="make: where the reference goes")
    ap.add_argument("--reference", type=Path, help="check: the reference to compare with")
    args = ap.parse_args(argv)
    runs = greedy_runs(args.model, args.build)
    if args.what == "make":
        args.out.write_text(json.dumps({"prompts": PROMPTS, "n_gen": N_GEN, "n_top": N_TOP, "build": args.build,
                                        "runs": runs}) + "\n")
        print(f"{args.out}: {len(runs)} prompts x {N_GEN} tokens")
        return 0
    ref = json.loads(args.reference.read_text())
    results = [agree(a, b) for a, b in zip(ref["runs"], runs)]
    for i, (ok, moved) in enumerate(results):
        print(f"prompt {i}: {'agrees' if ok else 'DIFFERS'} (chosen log-probabilities moved {moved:.2e} nats)")
    bad = [i for i, (ok, _) in enumerate(results) if not ok]
    print(f"{len(results) - len(bad)}/{len(results)} prompts agree with the reference up to a near tie "
          f"({NEAR_TIE} nats); the largest move {max(m for _, m in results):.2e} nats")
    return 1 if bad or len(results) != len(PROMPTS) else 0


if __name__ == "__main__":
    sys.exit(main())
