"""Small statistics helpers: medians, ratios, and alternating compared runs."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def median(values: Iterable[float | None]) -> float | None:
    """Median of the finite values (None when there are none)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def spread(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """(min, max) of the finite values."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return (min(vals), max(vals)) if vals else (None, None)


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    lo, hi = spread(values)
    return {"median": median(values), "min": lo, "max": hi, "samples": list(values)}


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def alternate(sides: dict[str, Callable[[int], Any]], repeats: int,
              label: str = "") -> dict[str, list[Any]]:
    """Run each side once per round, `repeats` rounds, the order turned by one each round
    (A B C, B C A, C A B, ...). Returns the results per side, in round order.

    Alternation spreads slow phases of a shared machine over both sides instead of
    penalising whichever ran during the busy minute; turning the order keeps a side from
    always running first (cold caches) or always right after the same neighbour.
    """
    names = list(sides)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            progress(f"{label} round {r + 1}/{repeats}: {name}")
            out[name].append(sides[name](r))
    return out


def parse_list(text: str | None, cast: Callable[[str], Any] = int) -> list:
    if not text:
        return []
    return [cast(x.strip()) for x in str(text).split(",") if x.strip()]
