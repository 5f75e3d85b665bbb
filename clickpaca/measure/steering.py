"""The worked experiment of docs/ACTIVATIONS.md: one sentiment direction at several
strengths, per sequence, in one batch, beside unsteered sequences.

    python -m clickpaca.measure.steering sentiment.gguf --layers 4-9 --plot docs/cvec-sentiment.png

Through the real server on the activations build: for every prompt and round, one batch of
16 sequences of that prompt, 8 at the strengths -4..+4 (0 left out) and 8 unsteered
(strength 0), all sampled at temperature 0.8, each with its own seed. Each output is scored
by a word list (`score`: positive minus negative words, per 100 words). Prints the mean
score per strength beside the unsteered outputs' spread, as JSON too (`--json`), and plots
score against strength (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

STRENGTHS = (-4.0, -3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 4.0)
N_UNSTEERED = 8
PROMPTS = ("The movie was", "My day at the office was", "I think the new restaurant in town is",
           "Yesterday I met my neighbour and")

# A small sentiment lexicon of common words (our own list, words of one sense mostly: no
# "like", "fine", "hard"; enough to tell "great fun" from "awful mess", not an instrument).
POSITIVE = frozenset("""
good great excellent wonderful amazing fantastic awesome lovely beautiful happy happiness joy
joyful glad delighted delightful love loved loving liked enjoy enjoyed enjoyable fun
nice pleasant perfect best better brilliant superb fabulous favourite favorite friendly kind
warm smile smiled smiling laugh laughed laughing exciting excited thrilled grateful thankful
thank thanks hope hopeful peaceful calm success successful win won proud positive incredible
inspiring impressive charming cheerful comfortable cool cute gorgeous helpful interesting
marvellous marvelous outstanding relaxing remarkable satisfied sweet terrific treasure
""".split())
NEGATIVE = frozenset("""
bad terrible awful horrible horrid dreadful poor worst worse sad sadness unhappy angry anger
annoyed annoying hate hated hating dislike disliked boring bored dull disappointing
disappointed disappointment disgusting gross ugly nasty miserable painful pain hurt hurts
cry cried crying fear afraid scared scary worried worry anxious stress stressful tired
upset lonely sick fail failed failure wrong broken mess problem problems trouble difficult
lost lose losing rude cruel evil negative pathetic ridiculous stupid useless
waste wasted weak frustrating frustrated depressing depressed tragic unfortunately
""".split())
WORD = re.compile(r"[a-z']+")


def per_100_words(text: str, plus, minus) -> float:
    """(words `plus(w)` holds for - words `minus(w)` holds for) per 100 words, lower-cased;
    0 for a text without words: the word-list scorers' one arithmetic."""
    words = WORD.findall(text.lower())
    if not words:
        return 0.0
    return 100.0 * (sum(map(plus, words)) - sum(map(minus, words))) / len(words)


def score(text: str) -> float:
    """(positive - negative words) per 100 words; 0 for a text without words."""
    return per_100_words(text, POSITIVE.__contains__, NEGATIVE.__contains__)


def run(vector: str, layers: tuple[int, int] | None, rounds: int = 2, max_tokens: int = 32,
        prompts: tuple[str, ...] = PROMPTS, build: str = "activations") -> dict[str, Any]:
    """Every batch through one server; the outputs and their scores."""
    from ..wire.client import Client

    c = Client.spawn()
    init = {"nCtx": 16 * 128, "nSeqMax": 16, "nBatch": 512, "build": build, "controlVector": vector,
            "controlVectorStrength": 0.0, "stateDir": tempfile.mkdtemp(prefix="clkp-state-")}
    if layers is not None:
        init["controlVectorLayers"] = list(layers)
    t0 = time.perf_counter()
    try:
        ready = c.init(**init)
        rows = []
        for r in range(rounds):
            for p, prompt in enumerate(prompts):
                plan = [(s, False) for s in STRENGTHS] + [(0.0, True)] * N_UNSTEERED
                lines = []
                for seq, (s, unsteered) in enumerate(plan):
                    req = {"type": "infer", "seq_id": seq, "prompt": prompt, "maxTokens": max_tokens,
                           "temperature": 0.8, "seed": 1000 * r + 100 * p + seq, "controlVectorStrength": s}
                    lines.append(json.dumps(req).encode() + b"\n")
                c.send_raw(b"".join(lines))  # one write: they share the ticks
                for seq, (s, unsteered) in enumerate(plan):
                    toks, done = c.collect(seq, timeout=600)
                    if done["type"] != "done":
                        raise RuntimeError(f"seq {seq}: {done}")
                    text = "".join(t["piece"] for t in toks)
                    rows.append({"round": r, "prompt": prompt, "strength": s, "unsteered": unsteered,
                                 "text": text, "score": score(text)})
    finally:
        c.close()
    return {"ready": {k: ready.get(k) for k in ("build", "controlVector", "nThreads")},
            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}


def summary(rows: list[dict]) -> dict[str, Any]:
    """Mean score (and min-max, n) per strength; the unsteered outputs' mean, std and range."""
    by: dict[float, list[float]] = {}
    for r in rows:
        if not r["unsteered"]:
            by.setdefault(r["strength"], []).append(r["score"])
    free = [r["score"] for r in rows if r["unsteered"]]
    return {"steered": {s: {"mean": float(np.mean(v)), "min": min(v), "max": max(v), "n": len(v)}
                        for s, v in sorted(by.items())},
            "unsteered": {"mean": float(np.mean(free)), "std": float(np.std(free)), "min": min(free),
                          "max": max(free), "n": len(free)}}


def plot(summ: dict[str, Any], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = summ["steered"]
    xs = sorted(st)
    means = [st[s]["mean"] for s in xs]
    lo = [st[s]["mean"] - st[s]["min"] for s in xs]
    hi = [st[s]["max"] - st[s]["mean"] for s in xs]
    u = summ["unsteered"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.axhspan(u["mean"] - u["std"], u["mean"] + u["std"], color="0.85",
               label=f"unsteered (strength 0, n={u['n']}): mean +- std")
    ax.axhline(u["mean"], color="0.5", lw=1)
    ax.errorbar(xs, means, yerr=[lo, hi], fmt="o-", capsize=3, label="steered: mean (min-max)")
    ax.set_xlabel("controlVectorStrength")
    ax.set_ylabel("sentiment words per 100 words (pos - neg)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vector", help="a control-vector GGUF (clickpaca cvec)")
    ap.add_argument("--layers", help="A-B: the layers steered (default: all the vector has)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--plot", help="write the plot here (PNG)")
    ap.add_argument("--json", help="write the outputs and the summary here")
    a = ap.parse_args(argv)
    layers = tuple(int(x) for x in a.layers.split("-")) if a.layers else None
    res = run(a.vector, layers, a.rounds, a.tokens)
    summ = summary(res["rows"])
    import os
    print(f"{len(res['rows'])} outputs in {res['seconds']} s, load {os.getloadavg()[0]:.2f}; "
          f"ready.controlVector {res['ready']['controlVector']}")
    u = summ["unsteered"]
    print(f"  unsteered  mean {u['mean']:+6.2f}  std {u['std']:.2f}  ({u['min']:+.2f}..{u['max']:+.2f}, n={u['n']})")
    for s, v in summ["steered"].items():
        print(f"  s={s:+.0f}       mean {v['mean']:+6.2f}  ({v['min']:+.2f}..{v['max']:+.2f}, n={v['n']})")
    if a.json:
        Path(a.json).write_text(json.dumps({**res, "summary": summ}, indent=1) + "\n")
    if a.plot:
        title = (f"{Path(a.vector).name}, layers {a.layers or 'all'}; {len(PROMPTS)} prompts x {a.rounds} rounds, "
                 f"{a.tokens} tokens, T=0.8")
        print(f"plot: {plot(summ, a.plot, title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
