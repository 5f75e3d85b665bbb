"""What every measurement writes: its record in the results store, a JSON file, a markdown
table, optional PNG plots (kv-retrieval's figure too, drawn again by `results plot`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..results.provenance import machine
from ..results.record import attach
from .stats import progress


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
    data = dict(data)
    data["table_markdown"] = table
    print(f"\n### {title}\n")
    print(table)
    notes = data.get("notes") or []
    for n in notes:
        print(f"\n- {n}")
    for line in problem_lines(data):
        print(f"\n- {line}")
    print()
    data["results_run"] = attach(name, data)
    write_json(out_dir, name, {k: v for k, v in data.items() if k != "samples"})


def problem(source: str, message: str) -> dict[str, str]:
    """A problem that is not a server's (those go to "server_problems" as plain strings), under
    "problems": ``source`` says where it happened, e.g. IN_PROCESS."""
    return {"source": source, "message": message}


#: The source of a problem met in this process (clickpaca.llama.core, not a spawned server).
IN_PROCESS = "in-process run"


def problem_lines(data: dict[str, Any]) -> list[str]:
    """The report's lines for the problems in ``data``, each labelled by its source: the
    spawned servers' ("server_problems", strings) as SERVER PROBLEM, the others ("problems",
    made by ``problem``) as PROBLEM (their source). Each is kept once, in order, and ``data``
    is left holding the deduplicated lists."""
    server = list(dict.fromkeys(data.get("server_problems") or []))  # once each, in order
    data["server_problems"] = server
    lines = [f"SERVER PROBLEM: {p}" for p in server]
    if "problems" in data:
        other = list({(p["source"], p["message"]): p for p in data["problems"] or []}.values())
        data["problems"] = other
        lines += [f"PROBLEM ({p['source']}): {p['message']}" for p in other]
    return lines


def load_pyplot():
    """matplotlib's pyplot on the Agg backend (imported on first use: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str | os.PathLike, series: dict[str, tuple[Sequence[float], Sequence[float | None]]],
               xlabel: str, ylabel: str, title: str, logx: bool = False,
               bands: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> Path:
    """One line per series: name -> (x values, y values); bands: name -> (lows, highs) at
    the same x values, drawn shaded around the line (an interval, so the noise is in the figure)."""
    plt = load_pyplot()
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
    return save_figure(plt, fig, ax, path, xlabel, ylabel, title)


def plot_points(path: str | os.PathLike, points: list[tuple[str, float, float]], xlabel: str,
                ylabel: str, title: str, logy: bool = False) -> Path:
    """Labelled scatter: (label, x, y)."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, x, y in points:
        if x is None or y is None:
            continue
        ax.scatter([x], [y])
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if logy:
        ax.set_yscale("symlog", linthresh=1e-4)
    return save_figure(plt, fig, ax, path, xlabel, ylabel, title)


def save_figure(plt, fig, ax, path: str | os.PathLike, xlabel: str, ylabel: str, title: str) -> Path:
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


#: The measures a kv-retrieval plot can show: row key -> (file name, axis label).
RETRIEVAL_PLOTS = {"accuracy": ("kv-retrieval-accuracy", "exact-match accuracy"),
                   "answer_logp": ("kv-retrieval-logp", "answer log-probability (nats)"),
                   "dlogp": ("kv-retrieval-dlogp", "Δ answer log-prob vs f16 (nats, paired)")}


def draw_retrieval(out: dict[str, Any], key: str, path: Any) -> None:
    """A kv-retrieval run's figure (`kv-retrieval --plot`, `results plot RUN --measure KEY`):
    one measure against haystack length, a line per setup run at every length, its
    bootstrap interval across needles shaded.
    dlogp is paired with f16 needle by needle, so its band is the one that separates the types."""
    if key not in RETRIEVAL_PLOTS:
        raise ValueError(f"--measure: a retrieval run plots {', '.join(RETRIEVAL_PLOTS)}, not {key!r}")
    lengths = out["params"]["lengths"]
    series: dict[str, tuple[list, list]] = {}
    bands: dict[str, tuple[list, list]] = {}
    for r in out["rows"]:
        if r["length"] == "all" or not r.get(key):
            continue
        xs, ys = series.setdefault(r["cache"], ([], []))
        lo, hi = bands.setdefault(r["cache"], ([], []))
        xs.append(r["length"])
        ys.append(r[key]["mean"])
        lo.append(r[key]["ci"][0])
        hi.append(r[key]["ci"][1])
    label = RETRIEVAL_PLOTS[key][1]
    plot_lines(path, {k: v for k, v in series.items() if len(v[0]) == len(lengths)},
               "haystack length (tokens)", label,
               f"Retrieval: {label} per cache type\n(shaded: 95% bootstrap interval across needles)",
               logx=True, bands=bands)
