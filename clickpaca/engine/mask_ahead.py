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
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable, Sequence

import numpy as np

from ..grammar.grammars import Matcher, fill_masks

#: Set CLICKPACA_MASK_AHEAD=0 to compute masks after the decode instead (for comparison).
ENABLED = os.environ.get("CLICKPACA_MASK_AHEAD", "1") != "0"


class MaskJob:
    """Masks of some matchers, filled into rows 0.. of ``bitmask``, row i for key i."""

    def __init__(self, keys: Sequence[Hashable], matchers: Sequence[Matcher], bitmask: np.ndarray,
                 pool: ThreadPoolExecutor | None) -> None:
        self.rows = {k: i for i, k in enumerate(keys)}
        self.bitmask = bitmask
        self._future: Future | None = None
        if not matchers:
            return
        if pool is None:
            fill_masks(list(matchers), bitmask[:len(matchers)])
        else:
            self._future = pool.submit(fill_masks, list(matchers), bitmask[:len(matchers)])

    def wait(self) -> None:
        """Block until the masks are filled; re-raises what the worker raised."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()

    def row(self, key: Hashable) -> np.ndarray | None:
        """The filled mask row of ``key`` (call `wait` first), None if it has none."""
        i = self.rows.get(key)
        return None if i is None else self.bitmask[i]


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
