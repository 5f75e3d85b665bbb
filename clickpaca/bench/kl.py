"""KL divergence and top-1 agreement between cache types, in-process (clickpaca.core).

The server's `score` returns only the NLL of each text token, not the full
distribution, so the comparison runs the same windows as `score` (scoring.windows_for:
llama-perplexity's chunks, second half of each window scored) through one Context per
cache type of one loaded model, chunk by chunk, and compares the log-softmax rows
position by position against the first cache type's:
  KL(P_ref || P_type) = sum_v p_ref(v) (log p_ref(v) - log p_type(v)),
  top-1 agreement = argmax_v p_ref == argmax_v p_type.
Only STEP rows per context are alive at a time (each row is 1 MiB at 262,144 tokens).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import core
from ..scoring import chunk_rows, log_softmax, windows_for
from .stats import progress

STEP = 64


def kl_rows(logp_ref: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) per row, in nats (float64 sums)."""
    p = np.exp(logp_ref)
    return (p * (logp_ref - logp)).sum(axis=1, dtype=np.float64)


def compare(model_path: str, pairs: list[tuple[str, str]], tokens: np.ndarray, window: int,
            build: str = "mainline", threads: int | None = None) -> dict[str, dict[str, Any]]:
    """Per cache pair 'k/v': ppl, nll, and (for all but the first) KL and top-1 vs the first;
    the per-position values under token_nll, token_kl, token_top1 (paired comparisons)."""
    model = core.Model(model_path, build=build)
    bos = model.bos if model.add_bos else None
    wins = windows_for(tokens, window, bos)
    ctxs = []
    try:
        for k, v in pairs:
            ctxs.append(core.Context(model, n_ctx=window, n_batch=STEP, n_ubatch=STEP, n_seq_max=1,
                                     type_k=k, type_v=v, n_threads=threads, flash_attn="on"))
        batch = core.Batch(model.nat, STEP)
        nll = [[] for _ in pairs]
        kl = [[] for _ in pairs]
        top1 = [[] for _ in pairs]
        for wi, (toks, first) in enumerate(wins):
            progress(f"kl: window {wi + 1}/{len(wins)}")
            for c in ctxs:
                c.clear()
            last_scored = len(toks) - 2
            for start in range(0, len(toks), STEP):
                chunk = toks[start:start + STEP]
                lo, n_out = chunk_rows(start, len(chunk), first, last_scored)
                batch.clear()
                batch.add(chunk, start, 0, output_last=False)
                if n_out:
                    batch.logits[lo - start: lo - start + n_out] = 1
                targets = toks[lo + 1: lo + 1 + n_out]
                ref = None
                for i, c in enumerate(ctxs):
                    rc = c.decode(batch)
                    if rc != 0:
                        raise RuntimeError(f"llama_decode returned {rc} for {pairs[i]}")
                    if not n_out:
                        continue
                    logp = log_softmax(c.logits())
                    nll[i].extend((-logp[np.arange(n_out), targets]).tolist())
                    if i == 0:
                        ref = logp
                    else:
                        kl[i].extend(kl_rows(ref, logp).tolist())
                        top1[i].extend((ref.argmax(axis=1) == logp.argmax(axis=1)).tolist())
    finally:
        for c in ctxs:
            c.close()
        model.close()
    out = {}
    for i, (k, v) in enumerate(pairs):
        n = np.asarray(nll[i])
        rec: dict[str, Any] = {"tokens": len(n), "nll": float(n.mean()), "ppl": float(np.exp(n.mean())),
                               "windows": len(wins), "token_nll": nll[i]}
        if i > 0:
            d = np.asarray(kl[i])
            rec.update({"kl_mean": float(d.mean()), "kl_median": float(np.median(d)),
                        "kl_p99": float(np.quantile(d, 0.99)), "kl_max": float(d.max()),
                        "top1_agreement": float(np.mean(top1[i])),
                        "token_kl": kl[i], "token_top1": [float(x) for x in top1[i]]})
        else:
            rec.update({"kl_mean": 0.0, "top1_agreement": 1.0})
        out[f"{k}/{v}"] = rec
    return out
