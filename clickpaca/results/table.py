"""Markdown tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(v: Any, digits: int = 3) -> str:
    """A cell: None -> '-', floats with `digits` significant decimals, bools as yes/no."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:  # NaN
            return "nan"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1 or a == 0:
            return f"{v:.{max(0, digits - 1)}f}"
        return f"{v:.{digits}g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table. align: one char per column, 'l' or 'r' (default: text
    columns left, numeric columns right)."""
    cells = [[fmt(v) for v in row] for row in rows]
    if align is None:
        align = "".join(
            "r" if rows and all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) else "l"
            for i in range(len(headers)))
    widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals):
        parts = [v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(vals, widths, align)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line([str(h) for h in headers]), sep] + [line(r) for r in cells])
