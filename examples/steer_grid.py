"""Two directions, each request its own strengths of both, in one batch, with a trigger.

    .venv/bin/python examples/steer_grid.py --seeds 3            # writes docs/steer-grid.png
    .venv/bin/python examples/steer_grid.py --tokens 24 --out /tmp   # /tmp/steer-grid.png

Derives a sentiment direction (examples/cvec/sentiment.jsonl) and a formality direction
(examples/cvec/formality.jsonl) with `clickpaca cvec`, registers both with the server
(`vector` requests, the activations build), and runs a 3 x 3 grid of strengths
(sentiment -2, 0, +2 x formality -0.3, 0, +0.3, layers 4-9) over the prompts: every request steers
with its own pair of entries, from the generated tokens on (`from: "generated"`: the
prompt is computed unsteered), and all of them go out at once so they share the decode.
Each output is scored, not read: sentiment by the word list of clickpaca.measure.steering
(`score`), formality by `formality` below. Prints the mean scores per cell and plots both
as heat maps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from clickpaca import Workbench
from clickpaca.measure.steering import per_100_words, score as sentiment

ROOT = Path(__file__).resolve().parents[1]
SENTIMENT = (-2.0, 0.0, 2.0)  # |direction| 43..304 on layers 4-9 (clickpaca cvec prints it)
FORMALITY = (-0.3, 0.0, 0.3)  # |direction| 309..819 there: at 1 the text breaks down
PROMPTS = ("The movie was", "My day at the office was", "I think the new restaurant in town is",
           "Yesterday I met my neighbour and")
LAYERS = "4-9"

# Register markers (our own short lists): formal connectives and phrasing against
# contractions and chat words. Crude, like the sentiment list: it tells the two apart.
FORMAL = frozenset("""therefore furthermore however moreover regarding accordingly thus hence
consequently nevertheless sincerely kindly request require shall would pleased regret inform
assistance concerning respectively additionally subsequently""".split())
INFORMAL = frozenset("""gonna wanna gotta kinda yeah yep nope hey lol ok okay cool dude guys
stuff totally super awesome like ya cause""".split())


def formality(text: str) -> float:
    """(formal - informal markers) per 100 words; a contraction counts as informal."""
    return per_100_words(text, FORMAL.__contains__, lambda w: w in INFORMAL or "'" in w)


def derive(name: str, out: Path) -> Path:
    path = out / f"{name}.gguf"
    subprocess.run([sys.executable, "-m", "clickpaca", "cvec", str(ROOT / "examples" / "cvec" / f"{name}.jsonl"),
                    "-o", str(path)], check=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_TOKENS", 32)))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_N", len(PROMPTS))),
                    help="how many of the prompts (tests run fewer)")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="the directory steer-grid.png goes to")
    a = ap.parse_args()
    prompts = PROMPTS[:max(1, a.prompts)]
    tmp = Path(tempfile.mkdtemp(prefix="steer-grid-"))
    vectors = {name: derive(name, tmp) for name in ("sentiment", "formality")}
    cells = [(s, f) for s in SENTIMENT for f in FORMALITY]
    items = []
    for seed in range(a.seeds):
        for p in prompts:
            for s, f in cells:
                items.append({"prompt": p, "seed": 100 * seed + len(items), "label": f"{s:+g}/{f:+g}",
                              "steer": [{"vector": "sentiment", "strength": s, "layers": LAYERS, "from": "generated"},
                                        {"vector": "formality", "strength": f, "layers": LAYERS, "from": "generated"}]})
    n = len(cells) * len(prompts)
    with Workbench.spawn(build="activations", nSeqMax=n, nCtx=n * 96, nBatch=512,
                         stateDir=str(tmp / "state")) as wb:
        for name, path in vectors.items():
            ready = wb.vector(name, str(path))
            print(f"{name}: layers {ready['layers'][0]}-{ready['layers'][-1]}, |dir| at 9: {ready['norms']['9']:.1f}")
        res = wb.generate(items, temperature=0.8, maxTokens=a.tokens, progress=False)
    sent = np.zeros((len(SENTIMENT), len(FORMALITY)))
    form = np.zeros_like(sent)
    count = np.zeros_like(sent)
    for item, g in zip(items, res):
        s, f = (float(x) for x in item["label"].split("/"))
        i, j = SENTIMENT.index(s), FORMALITY.index(f)
        sent[i, j] += sentiment(g.text)
        form[i, j] += formality(g.text)
        count[i, j] += 1
    sent, form = sent / count, form / count
    print(f"{int(count.sum())} outputs, {int(count[0, 0])} per cell; mean scores per 100 words")
    print("| sentiment \\ formality | " + " | ".join(f"{f:+g}" for f in FORMALITY) + " |")
    print("|---|" + "---|" * len(FORMALITY))
    for i, s in enumerate(SENTIMENT):
        print(f"| {s:+.0f} | " + " | ".join(f"sent {sent[i, j]:+.1f}, form {form[i, j]:+.1f}"
                                            for j in range(len(FORMALITY))) + " |")
    for item, g in list(zip(items, res))[:len(cells)]:
        print(f"  {item['label']}: {item['prompt']}{g.text[:90]!r}")
    figure = Path(a.out) / "steer-grid.png"
    plot(sent, form, figure)
    print(f"figure: {figure}")
    return 0


def plot(sent: np.ndarray, form: np.ndarray, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.6))
    for ax, m, title in zip(axes, (sent, form), ("sentiment score", "formality score")):
        im = ax.imshow(m, cmap="coolwarm", origin="lower")
        ax.set_xticks(range(len(FORMALITY)), [f"{x:+g}" for x in FORMALITY])
        ax.set_yticks(range(len(SENTIMENT)), [f"{x:+.0f}" for x in SENTIMENT])
        ax.set_xlabel("formality strength")
        ax.set_ylabel("sentiment strength")
        ax.set_title(title + " (per 100 words)", fontsize=9)
        for (i, j), v in np.ndenumerate(m):
            ax.text(j, i, f"{v:+.1f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
