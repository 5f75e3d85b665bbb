"""Scoring text without generating: windows like llama-perplexity, NLL per token.

A text of at most `window` tokens is one window, and every token after the first is
scored. A longer text is cut into floor(n / window) windows of exactly `window` tokens
(the remainder is dropped); each window starts with BOS (when the model uses one) and
only its second half is scored, each token seeing at least window/2 tokens of context.
That is what llama-perplexity does with `-c window`, so the two give comparable numbers.
"""

from __future__ import annotations

import numpy as np


def windows_for(tokens: np.ndarray, window: int, bos: int | None) -> list[tuple[np.ndarray, int]]:
    """(window tokens, first scored row) pairs; the row at p predicts token p + 1."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if len(tokens) < 2:
        return []
    if len(tokens) <= window:
        return [(tokens.copy(), 0)]
    out = []
    for j in range(len(tokens) // window):
        chunk = tokens[j * window:(j + 1) * window].copy()
        if bos is not None:
            chunk[0] = bos
        out.append((chunk, window // 2))
    return out


def score_rows(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (nats) of each target under its logits row."""
    rows = np.asarray(rows, dtype=np.float32)
    m = rows.max(axis=1)
    lse = np.log(np.exp(rows - m[:, None]).sum(axis=1, dtype=np.float64)) + m
    picked = rows[np.arange(len(rows)), np.asarray(targets, dtype=np.int64)]
    return lse - picked.astype(np.float64)
