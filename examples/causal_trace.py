"""Causal tracing (Meng et al. 2022, ROME's figure 1) through the server's `patch`.

    make activations                                    # the build with the live eval callback
    .venv/bin/python examples/causal_trace.py --plot docs/causal-trace.png [--samples 4] [--serial]

A clean run of "The Eiffel Tower is located in the city of" captures the
scaled token embeddings (`inp_scaled`) and every layer's residual stream (`l_out-L`) at every
position, and the probability of " Paris" after it is read (one token forced by logit_bias,
its raw log-probability). The corrupted run adds Gaussian noise to the subject's embeddings (3 x the std of
the subject tokens' embeddings, as the paper does; `patch` mode `add` on `inp_scaled`). Then
for each layer L and each position p, a corrupted run with the clean `l_out-L` row restored
at p (`patch` mode `replace`) reads the answer's probability again. One grid row (a layer: every position
x every noise sample) is one batch of sequences, each with its own patch; `--serial` also
runs the grid one request at a time and reports both times.

Prints the grid and the times as JSON; `--plot` draws the heatmap (positions x layers, the
answer's probability; subject tokens starred).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from clickpaca.activations import capture as C
from clickpaca.wire.client import Client

FACT = ("The Eiffel Tower is located in the city of", "The Eiffel Tower", " Paris")
#: subjects whose embeddings set the noise scale (the paper uses its facts' subjects)
SUBJECTS = ["The Eiffel Tower", "The Colosseum", "Mount Fuji", "The Golden Gate Bridge", "Big Ben",
            "The Taj Mahal", "The Statue of Liberty", "Angela Merkel", "Lionel Messi", "Toyota",
            "The Amazon River", "Shakespeare"]
NOISE_TIMES_STD = 3.0


def ask(c: Client, seq_id: int, prompt: str, answer_id: int, **kw) -> None:
    """The answer's probability after the prompt: one token forced to the answer by
    logit_bias, whose `logprob` is the model's raw log-probability of it (only the prompt's
    last row is computed over the 262k vocabulary)."""
    c.infer(seq_id, prompt, maxTokens=1, temperature=0, nProbs=1,
            logit_bias=[{"token": answer_id, "bias": 1e9}], **kw)


def answer_prob(c: Client, seq_id: int, answer_id: int) -> float:
    toks, done = c.collect(seq_id)
    assert done["type"] == "done" and toks and toks[0]["token"] == answer_id, (toks, done)
    return math.exp(toks[0]["logprob"])


def tokens_of(model, text: str) -> list[int]:
    return [int(t) for t in model.tokenize(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4, help="noise samples per cell (the paper: 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serial", action="store_true", help="also run the grid one request at a time")
    ap.add_argument("--plot", default=None, help="write the heatmap here (PNG)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    from clickpaca.llama import core
    from clickpaca.llama.models import resolve_model

    tok = core.Model(resolve_model(), n_gpu_layers=0)  # the tokenizer: positions of the subject
    prompt, subject, answer = FACT
    toks = tokens_of(tok, prompt + answer)
    n = len(tokens_of(tok, prompt))
    assert toks[:n] == tokens_of(tok, prompt) and len(toks) == n + 1, "the answer must be one token"
    start, end = len(tokens_of(tok, prompt[:prompt.index(subject)])), len(tokens_of(tok, prompt[:prompt.index(subject) + len(subject)]))
    subj = list(range(start, end))
    ans = toks[n]
    pieces = [tok.token_to_piece(t).decode("utf-8", "replace") for t in toks[:n]]
    n_layer = tok.n_layer
    tok.close()

    c = Client.spawn()
    init = {"build": "activations", "nCtx": 4096, "nSeqMax": 64, "nBatch": 1024}
    if args.threads:
        init["nThreads"] = args.threads
    c.init(**init)
    try:
        layers = [f"l_out-{il}" for il in range(n_layer)]
        # noise scale: the std of the subject tokens' embeddings (as the model sees them)
        for i, s in enumerate(SUBJECTS):
            c.send({"type": "prefill", "seq_id": i, "prompt": s, "capture": ["inp_scaled"], "captureTokens": "all"})
        embs = []
        for i, _ in enumerate(SUBJECTS):
            ev = c.wait(i)
            embs.append(C.decode(ev["capture"]["nodes"]["inp_scaled"])[1:])  # without the BOS
            c.request({"type": "free", "seq_id": i})
        std = float(np.concatenate(embs).std())
        clean_ev = c.request({"type": "prefill", "seq_id": 0, "prompt": prompt, "capture": ["inp_scaled", *layers],
                              "captureTokens": "all"})
        c.request({"type": "free", "seq_id": 0})
        clean = {k: C.decode(v).astype(np.float32) for k, v in clean_ev["capture"]["nodes"].items()}
        ask(c, 0, prompt, ans)
        p_clean = answer_prob(c, 0, ans)
        rng = np.random.default_rng(args.seed)
        noises = [rng.normal(scale=NOISE_TIMES_STD * std, size=(len(subj), clean["inp_scaled"].shape[1]))
                  .astype(np.float32) for _ in range(args.samples)]
        corrupt = [{"node": "inp_scaled", "positions": subj, "source": C.encode(z, "float32"), "mode": "add"}
                   for z in noises]

        def restore(il: int, p: int) -> dict:
            return {"node": layers[il], "positions": [p],
                    "source": C.encode(clean[layers[il]][p:p + 1], "float32")}

        cells = [(il, p, s) for il in range(n_layer) for p in range(n) for s in range(args.samples)]
        for s in range(args.samples):
            ask(c, s, prompt, ans, patch=[corrupt[s]])
        p_corrupt = float(np.mean([answer_prob(c, s, ans) for s in range(args.samples)]))

        def grid(batched: bool) -> tuple[np.ndarray, float]:
            out = np.zeros((n_layer, n, args.samples))
            t0 = time.perf_counter()
            rows = [[x for x in cells if x[0] == il] for il in range(n_layer)] if batched else [[x] for x in cells]
            for row in rows:
                for i, (il, p, s) in enumerate(row):
                    ask(c, i, prompt, ans, patch=[corrupt[s], restore(il, p)])
                for i, (il, p, s) in enumerate(row):
                    out[il, p, s] = answer_prob(c, i, ans)
            return out.mean(axis=2), time.perf_counter() - t0

        batched, t_batched = grid(True)
        report = {"prompt": prompt, "answer": answer, "subject_positions": subj, "tokens": pieces,
                  "noise_std": NOISE_TIMES_STD * std, "samples": args.samples, "p_clean": p_clean,
                  "p_corrupt": p_corrupt, "cells": len(cells), "batched_s": round(t_batched, 2),
                  "grid": np.round(batched.T, 5).tolist()}  # positions x layers
        if args.serial:
            serial, t_serial = grid(False)
            report.update(serial_s=round(t_serial, 2), speedup=round(t_serial / t_batched, 2),
                          max_abs_diff=float(np.abs(serial - batched).max()))
        print(json.dumps(report))
        if args.plot:
            plot(report, args.plot)
    finally:
        c.close()
    return 0


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = np.asarray(r["grid"])
    labels = [repr(t)[1:-1] + ("*" if i in r["subject_positions"] else "") for i, t in enumerate(r["tokens"])]
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(labels) + 1.6))
    im = ax.imshow(g, cmap="Purples", aspect="auto", vmin=min(r["p_corrupt"], g.min()), vmax=g.max())
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(g.shape[1]))
    ax.set_xlabel("layer whose output (l_out) is restored")
    ax.set_title(f"p({r['answer'].strip()!r}) with the clean state restored at one layer and token\n"
                 f"clean {r['p_clean']:.3f}, subject corrupted {r['p_corrupt']:.3f} "
                 f"({r['samples']} noise samples)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
