"""A tick's grammar masks, computed on a worker thread while llama_decode runs.

The mask a sequence samples with after the decode of tick t depends only on the tokens
its matcher has consumed, all of them known before that decode starts. llguidance and
llama_decode both release the GIL, so the two can run at the same time; llguidance's
own advice is to compute the mask while the logits are being computed, because one mask
can take milliseconds (a Lark grammar whose frequent tokens cross lexeme boundaries:
~2.8 ms per mask at Gemma's 262,144-token vocabulary, docs/GRAMMARS.md).

The scheduler starts a `MaskJob` right after it has planned the batch and waits for it
just before sampling. Until then nobody else touches those matchers: requests are
applied between ticks only, and a decode that fails waits for the job before it ends
any sequence.

A failure stays with its matcher: when the tick's fill fails as a whole, each mask is
filled alone and a key whose own fill fails gets its exception from `row` (the
scheduler ends that sequence only). The scheduler's keys are its sequences, whose
seq_id the test hook (faults.py, stage `mask`) reads.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable, Sequence

import numpy as np

from ..grammar.grammars import Matcher, fill_masks
from . import faults

#: Set CLICKPACA_MASK_AHEAD=0 to compute masks after the decode instead (for comparison).
ENABLED = os.environ.get("CLICKPACA_MASK_AHEAD", "1") != "0"


class MaskJob:
    """Masks of some matchers, filled into rows 0.. of ``bitmask``, row i for key i."""

    def __init__(self, keys: Sequence[Hashable], matchers: Sequence[Matcher], bitmask: np.ndarray,
                 pool: ThreadPoolExecutor | None) -> None:
        self.rows = {k: i for i, k in enumerate(keys)}
        self.bitmask = bitmask
        self.errors: dict[Hashable, Exception] = {}  # key -> why its own mask could not be filled
        self._future: Future | None = None
        if not matchers:
            return
        if pool is None:
            self.errors = _fill(list(keys), list(matchers), bitmask)
        else:
            self._future = pool.submit(_fill, list(keys), list(matchers), bitmask)

    def wait(self) -> None:
        """Block until the masks are filled (a mask's own failure is kept for `row`)."""
        if self._future is not None:
            future, self._future = self._future, None
            self.errors = future.result()

    def row(self, key: Hashable) -> np.ndarray | None:
        """The filled mask row of ``key`` (call `wait` first), None if it has none;
        raises the exception its own fill raised."""
        if key in self.errors:
            raise self.errors[key]
        i = self.rows.get(key)
        return None if i is None else self.bitmask[i]


def _fill(keys: list, matchers: list[Matcher], bitmask: np.ndarray) -> dict[Hashable, Exception]:
    """Fill every mask in one call; if that fails, each alone (faults.each): {key: its exception}."""
    got = faults.each("mask", range(len(keys)),
                      lambda i: fill_masks([matchers[i]], bitmask[i:i + 1]),
                      lambda _: fill_masks(matchers, bitmask[:len(matchers)]) or [None] * len(matchers),
                      seq_ids=[getattr(k, "seq_id", None) for k in keys])
    return {k: e for k, e in zip(keys, got) if isinstance(e, Exception)}


class MaskAhead:
    """Starts one `MaskJob` per tick on a single worker thread."""

    def __init__(self, bitmask: np.ndarray, enabled: bool = ENABLED) -> None:
        self.bitmask = bitmask
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="masks") if enabled else None

    def start(self, pairs: Sequence[tuple[Hashable, Matcher]]) -> MaskJob:
        """Fill the masks of (key, matcher) pairs; in the background when enabled."""
        return MaskJob([k for k, _ in pairs], [m for _, m in pairs], self.bitmask, self._pool)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
