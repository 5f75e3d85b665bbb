"""The progress bar of long runs, on stderr (stdout stays the caller's).

tqdm: well kept, pure Python with no dependencies of its own, and it already does what a
bar on a shared terminal needs (rate and time left, redraws throttled, no bar when
stderr is not a terminal unless asked, safe from several threads).
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """A bar over `total` requests; `show` None: only on a terminal, and only for runs of
    at least MIN_TOTAL requests. Counts failed requests in its postfix."""

    MIN_TOTAL = 8

    def __init__(self, total: int, what: str, show: bool | None = None) -> None:
        if show is None:
            show = sys.stderr.isatty() and total >= self.MIN_TOTAL
        self.errors = 0
        self.bar = tqdm(total=total, desc=what, unit="req", file=sys.stderr, disable=not show,
                        leave=False, dynamic_ncols=True)

    def update(self, result: Any) -> None:
        if getattr(result, "error", None) is not None:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
