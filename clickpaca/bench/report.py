"""What every bench command writes: a JSON file, a markdown table, optional PNG plots."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .stats import progress


def machine() -> dict[str, Any]:
    """Where and when the numbers were measured (load average: the machine may be shared)."""
    cpu = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": mem_gib, "accelerator": None,
            "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": list(os.getloadavg()),
            "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def write_json(out_dir: str | os.PathLike, name: str, data: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"bench": name, "machine_end": machine(), **data}
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    progress(f"wrote {path}")
    return path


def emit(out_dir: str, name: str, data: dict[str, Any], table: str, title: str) -> None:
    """Print the table (stdout), record the run in the results store, write the JSON (the
    latest run's export; per-token samples stay in the store)."""
    from ..results import attach

    data = dict(data)
    data["table_markdown"] = table
    print(f"\n### {title}\n")
    print(table)
    notes = data.get("notes") or []
    for n in notes:
        print(f"\n- {n}")
    problems = list(dict.fromkeys(data.get("server_problems") or []))  # once each, in order
    data["server_problems"] = problems
    for p in problems:
        print(f"\n- SERVER PROBLEM: {p}")
    print()
    data["results_run"] = attach(name, data)
    write_json(out_dir, name, {k: v for k, v in data.items() if k != "samples"})


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str | os.PathLike, series: dict[str, tuple[Sequence[float], Sequence[float | None]]],
               xlabel: str, ylabel: str, title: str, logx: bool = False,
               bands: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> Path:
    """One line per series: name -> (x values, y values); bands: name -> (lows, highs) at
    the same x values, drawn shaded around the line (an interval, so the noise is in the figure)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for name, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            if bands and name in bands:
                ax.fill_between(xs, *bands[name], color=line.get_color(), alpha=0.15, linewidth=0)
    if logx:
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    return _save(plt, fig, ax, path, xlabel, ylabel, title)


def plot_points(path: str | os.PathLike, points: list[tuple[str, float, float]], xlabel: str,
                ylabel: str, title: str, logy: bool = False) -> Path:
    """Labelled scatter: (label, x, y)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, x, y in points:
        if x is None or y is None:
            continue
        ax.scatter([x], [y])
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if logy:
        ax.set_yscale("symlog", linthresh=1e-4)
    return _save(plt, fig, ax, path, xlabel, ylabel, title)


def _save(plt, fig, ax, path: str | os.PathLike, xlabel: str, ylabel: str, title: str) -> Path:
    """Label, grid and write one figure to a PNG (parent folders created), then close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    progress(f"wrote {p}")
    return p
