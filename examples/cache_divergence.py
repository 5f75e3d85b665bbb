"""f16 / q8_0 / q4_0 KV caches on the same prompts: where each output parts from f16.

    .venv/bin/python examples/cache_divergence.py            # 24 prompts, 64 tokens
    .venv/bin/python examples/cache_divergence.py --n 6 --tokens 24

`Workbench.sweep` starts one server per cache type, one after another, sends the same
greedy requests to each and pairs every output with f16's: the first position where
the tokens differ, how close the two choices were there (the margin, in nats), and the
log-probability differences before it. Each type also scores f16's texts, so the run
is recorded with paired per-token NLL: `clickpaca results compare RUN_ID` prints ΔPPL
of q8_0 and q4_0 against f16 with bootstrap intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from clickpaca import Workbench

PROMPTS = ["The history of the printing press begins", "To make a good loaf of bread, you need",
           "The three largest planets of the solar system are", "In the winter of 1816, the weather",
           "A recipe for tomato soup:", "The rules of chess say that a bishop",
           "Photosynthesis is the process by which", "The old lighthouse keeper climbed the stairs and",
           "Python is a programming language that", "The river flows from the mountains to",
           "The best way to learn a language is", "When the train arrived at the station,",
           "Dear diary, today I", "The causes of the French Revolution include",
           "A list of common garden birds:", "The violin has four strings, tuned",
           "Once upon a time, a fox and a crow", "The main ingredients of a curry are",
           "To change a flat tyre, first", "The moon affects the tides because",
           "In the library, the oldest book was", "Snow falls when the air is",
           "The market opened at dawn, and", "A good night's sleep helps"]
CACHES = ["f16", "q8_0", "q4_0"]


def plot(res, n_tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    for k, label in enumerate(res.labels[1:]):
        rows = [p for p in res.pairs if p["config"] == label]
        xs = [p["index"] + (k - 0.5) * 0.25 for p in rows]
        ys = [p["first_divergence"] if p["first_divergence"] is not None else n_tokens for p in rows]
        ax.plot(xs, ys, "o" if k == 0 else "s", label=f"{label} vs {res.baseline}")
    ax.axhline(n_tokens, color="grey", lw=0.8, ls=":")
    ax.text(0, n_tokens, " same tokens throughout", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("prompt")
    ax.set_ylabel("first divergent token")
    ax.set_ylim(-1, n_tokens * 1.12)
    ax.set_title("Greedy outputs under quantized KV caches: where they part from f16")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_N", len(PROMPTS))),
                    help=f"prompts (default {len(PROMPTS)}; $CLICKPACA_EXAMPLE_N)")
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_TOKENS", 64)))
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--out", default="examples-output")
    args = ap.parse_args(argv)

    prompts = (PROMPTS * (args.n // len(PROMPTS) + 1))[:args.n]
    # every sequence runs to --tokens: end-of-generation tokens banned
    ban_eog = [{"token": t, "bias": -1e9} for t in (1, 106, 212)]
    res = Workbench.sweep(args.caches.split(","), prompts, init={"nCtx": 4096, "nSeqMax": 16},
                          temperature=0, maxTokens=args.tokens, logit_bias=ban_eog)
    print("| cache | build | PPL of f16's texts | prompts with the same tokens as f16 | errors |")
    print("|---|---|--:|--:|--:|")
    for r in res.summary():
        same = "-" if r["identical"] is None else f"{r['identical']}/{len(prompts)}"
        print(f"| {r['cache']} | {r['build']} | {r['ppl']:.3f} | {same} | {r['errors']} |")
    print()
    print("| cache | prompt | first divergence | margin there (nats) | mean |Δlogprob| before |")
    print("|---|--:|--:|--:|--:|")
    for p in res.pairs:
        div = "-" if p["first_divergence"] is None else p["first_divergence"]
        margin = "-" if p.get("margin") is None else f"{p['margin']:.3f}"
        dlp = "-" if p.get("dlogprob_mean") is None else f"{p['dlogprob_mean']:.4f}"
        print(f"| {p['config']} | {p['index']} | {div} | {margin} | {dlp} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(res, args.tokens, out / "cache_divergence.png")
    (out / "cache_divergence.json").write_text(json.dumps(
        {"run_id": res.run_id, "summary": res.summary(), "pairs": res.pairs}, indent=1))
    print(f"\nplot: {out / 'cache_divergence.png'}; records: {out / 'cache_divergence.json'}")
    print(f"recorded as run {res.run_id}: .venv/bin/clickpaca results compare {res.run_id}")
    errors = sum(r["errors"] for r in res.summary())
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
