"""What every step of the chain did to one sampled token (``trace: true`` on infer).

The trace reruns the chain's definitions over the whole candidate set (the fast chain
equals them: tests/test_sampling_chain.py) on copies of the sequence's step states
and random streams taken before the draw, so it reports what the real chain did and
changes nothing: the token, the states and the streams are those of an untraced run.
Per step that ran: the candidates left, the entropy of their distribution, the drawn
token's rank (0 = first in canonical order) and probability; and which step removed
the unsteered argmax (the raw row's top token), if one did. It costs a few full-row
passes per step (``clickpaca bench sampler`` measures it); with trace off nothing
here runs.
"""

from __future__ import annotations

import math

import numpy as np

from . import registry as R
from .bitmask import allowed_ids, allows
from .candidates import gather

__all__ = ["trace"]


def _stats(ids: np.ndarray, logits: np.ndarray, token: int) -> dict:
    """n, entropy (nats), the token's rank and probability in the set."""
    n = int(ids.size)
    m = float(logits.max()) if n else -math.inf
    if not m > -math.inf:
        return {"n": n, "entropy": None, "rank": None, "p": None}
    if m == math.inf:  # a tiny temperature overflowed: uniform over the +inf ones
        top = logits == m
        e = top.astype(np.float64)
    else:
        e = np.exp(logits - m)
    total = float(e.sum())
    prob = e / total
    nz = prob[prob > 0]
    ent = max(0.0, float(-(nz * np.log(nz)).sum()))
    hit = np.flatnonzero(ids == token)
    if hit.size == 0:
        return {"n": n, "entropy": ent, "rank": None, "p": 0.0}
    v = logits[hit[0]]
    rank = int(np.count_nonzero(logits > v) + np.count_nonzero((logits == v) & (ids < token)))
    return {"n": n, "entropy": ent, "rank": rank, "p": float(prob[hit[0]])}


def trace(row: np.ndarray, params, words: np.ndarray | None, ctx: R.StepContext, token: int) -> dict:
    """{"steps": [{"step", "n", "entropy", "rank", "p"}, ...], "argmax", "argmax_removed_by"}:
    first the model's raw distribution ("model"), then the grammar when there is one,
    then every step of ``params.samplers`` that is not off, in order."""
    n_vocab = row.shape[0]
    ids = np.arange(n_vocab, dtype=np.int32)
    logits = gather(row, ids)
    argmax = int(np.argmax(np.where(np.isnan(row), -np.inf, row)))
    out = [{"step": "model", **_stats(ids, logits, token)}]
    removed_by = None
    if words is not None:
        ids = allowed_ids(words, n_vocab)
        logits = gather(row, ids)
        out.append({"step": "grammar", **_stats(ids, logits, token)})
        if not allows(words, np.array([argmax]))[0]:
            removed_by = "grammar"
    has_hist = ctx.hist[0].size > 0
    for step in R.active(params, has_hist):
        ids, logits = step.run(ids, logits, params, ctx)
        out.append({"step": step.name, **_stats(ids, logits, token)})
        if removed_by is None and not (ids == argmax).any():
            removed_by = step.name
        if ids.size == 0:
            break
    return {"steps": out, "argmax": argmax, "argmax_removed_by": removed_by}
