"""Scoring text without generating: windows like llama-perplexity, NLL per token.

A text of at most `window` tokens is one window, and every token after the first is
scored. A longer text is cut into floor(n / window) windows of exactly `window` tokens
(the remainder is dropped); each window starts with BOS (when the model uses one) and
only its second half is scored, each token seeing at least window/2 tokens of context.
That is what llama-perplexity does with `-c window`, so the two give comparable numbers.
`score_last` N moves the first scored row to window - N (N = window/2 is the default):
the tail of a long window, where attention reaches thousands of tokens back.
"""

from __future__ import annotations

import numpy as np


#: The shortest scored tail: its first row predicts the last token but one.
SCORE_LAST_MIN = 2


def check_score_last(score_last: int | None, window: int, field: str = "score_last") -> None:
    """The one rule for a scored tail (None: the default half): SCORE_LAST_MIN <=
    score_last < window; a ValueError naming the caller's `field` (the protocol's
    scoreLast, the CLI's --score-last)."""
    if score_last is not None and not SCORE_LAST_MIN <= score_last < window:
        raise ValueError(f"{field}: must be {SCORE_LAST_MIN} to window - 1 ({window - 1}), got {score_last}")


def windows_for(tokens: np.ndarray, window: int, bos: int | None,
                score_last: int | None = None, field: str = "score_last") -> list[tuple[np.ndarray, int]]:
    """(window tokens, first scored row) pairs; the row at p predicts token p + 1.

    score_last: with windows, the first scored row is window - score_last (default
    window // 2); check_score_last's rule, its error naming `field`."""
    check_score_last(score_last, window, field)
    first = window // 2 if score_last is None else window - score_last
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
        out.append((chunk, first))
    return out


def chunk_rows(pos: int, count: int, first: int, last: int) -> tuple[int, int]:
    """Of the positions pos .. pos + count - 1 a decode feeds, those within first .. last:
    (the first of them, how many). Their logits rows are the ones asked for (a window's
    scored positions; for the engine's planner also a prompt's last position)."""
    lo, hi = max(first, pos), min(pos + count - 1, last)
    return lo, max(0, hi - lo + 1)


def _log_sum(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows as float32, row max m, rows - m, log of the sum of exp(rows - m) in float64),
    the last three with a kept row axis: the stable log-sum-exp both functions below use."""
    rows = np.asarray(rows, dtype=np.float32)
    m = rows.max(axis=1, keepdims=True)
    z = rows - m
    return rows, m, z, np.log(np.exp(z).sum(axis=1, keepdims=True, dtype=np.float64))


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Log-probabilities of each logits row (float32; the sums in float64)."""
    _, _, z, log_sum = _log_sum(rows)
    return z - log_sum.astype(np.float32)


def score_rows(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (nats, float64) of each target under its logits row."""
    rows, m, _, log_sum = _log_sum(rows)
    lse = (log_sum + m)[:, 0]
    picked = rows[np.arange(len(rows)), np.asarray(targets, dtype=np.int64)]
    return lse - picked.astype(np.float64)
