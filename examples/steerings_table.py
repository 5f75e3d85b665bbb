"""100 prompts under 3 steerings, as a table.

    .venv/bin/python examples/steerings_table.py            # 100 prompts x 3 steerings
    .venv/bin/python examples/steerings_table.py --n 12     # fewer

All 300 requests go to one `generate` call: each item carries its own steering and a
label, and the Workbench keeps every slot of the server busy until the last one ends.
The table shows, per steering, how long the outputs are, how diverse (distinct word
pairs across all outputs), how likely the model found its own tokens, and the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from clickpaca import Workbench

SUBJECTS = ["the sea", "a lighthouse", "winter", "a small village", "the moon", "an old clock", "bread",
            "a river", "the library", "rain", "a train station", "the forest", "a market", "snow",
            "a violin", "the desert", "a garden", "a bridge", "the harbour", "thunder", "a kitchen",
            "the mountains", "a letter", "the city at night", "a cat"]
TEMPLATES = ["A short description of {}:", "The first thing you notice about {} is",
             "Here is a sentence about {}.", "Once, near {},"]
STEERINGS = {
    "greedy": {"temperature": 0},
    "sampled T=0.9": {"temperature": 0.9, "topP": 0.95, "seed": 7},
    "penalised": {"temperature": 0.7, "seed": 7, "penaltyRepeat": 1.3, "penaltyPresent": 0.6},
}


def prompts(n: int) -> list[str]:
    every = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    return (every * (n // len(every) + 1))[:n]


def distinct_pairs(texts: list[str]) -> float:
    """Distinct word pairs over all word pairs of the outputs (1.0: none repeats)."""
    pairs = [tuple(w[i:i + 2]) for w in (t.split() for t in texts) for i in range(len(w) - 1)]
    return len(set(pairs)) / len(pairs) if pairs else float("nan")


def table(records: list[dict], wall_s: float) -> tuple[str, list[dict]]:
    rows = []
    for name in STEERINGS:
        mine = [r for r in records if r["steering"] == name]
        ok = [r for r in mine if r["error"] is None]
        toks = sum(r["tokens_predicted"] for r in ok)
        lp = [r["mean_logprob"] for r in ok if r["mean_logprob"] is not None]
        rows.append({"steering": name, "requests": len(mine), "errors": len(mine) - len(ok),
                     "mean_tokens": toks / len(ok) if ok else float("nan"),
                     "distinct_pairs": distinct_pairs([r["text"] for r in ok]),
                     "mean_logprob": sum(lp) / len(lp) if lp else float("nan"),
                     "eval_tps_median": sorted(r["eval_tps"] or 0 for r in ok)[len(ok) // 2] if ok else float("nan")})
    head = "| steering | requests | errors | mean tokens | distinct word pairs | mean logprob | tok/s per seq (median) |"
    lines = [head, "|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['steering']} | {r['requests']} | {r['errors']} | {r['mean_tokens']:.1f} | "
                     f"{r['distinct_pairs']:.2f} | {r['mean_logprob']:.2f} | {r['eval_tps_median']:.1f} |")
    total = sum(r["tokens_predicted"] or 0 for r in records)
    lines.append(f"\n{len(records)} requests, {total} tokens in {wall_s:.1f} s: {total / wall_s:.0f} tok/s in all")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_N", 100)),
                    help="prompts (default 100; $CLICKPACA_EXAMPLE_N)")
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_TOKENS", 24)))
    ap.add_argument("--slots", type=int, default=32, help="nSeqMax of the server")
    ap.add_argument("--out", default="examples-output", help="folder for the records (JSON)")
    args = ap.parse_args(argv)

    items = [{"prompt": p, "label": name, **params}
             for name, params in STEERINGS.items() for p in prompts(args.n)]
    with Workbench.spawn(nCtx=4096, nSeqMax=args.slots) as wb:
        t0 = time.perf_counter()
        gens = wb.generate(items, maxTokens=args.tokens, nProbs=1)
        wall = time.perf_counter() - t0
    text, rows = table(gens.to_records(), wall)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steerings_table.json").write_text(json.dumps({"rows": rows, "records": gens.to_records()}, indent=1))
    print(f"records: {out / 'steerings_table.json'}")
    return 0 if not gens.errors else 1


if __name__ == "__main__":
    sys.exit(main())
