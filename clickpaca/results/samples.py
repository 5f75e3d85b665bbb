"""The raw samples of a command's output, named so that two runs can be paired.

Two kinds:
- per-token series that a quality command (ppl) hands over under data["samples"]:
  {series name (cache type): {metric (token_nll, token_kl, token_top1, ...): values}};
- per-round speeds: every `stats.summary` dict ({"median", "min", "max", "samples"}) in
  the output, named by its place in it (e.g. `rows/seqs=8/server_wall_tps`, rows named
  by the fields that identify them), metric `rounds`.
"""

from __future__ import annotations

from typing import Any

#: Fields that identify a row of a bench table (in this order in the name).
ROW_KEYS = ("seqs", "grammar", "cache", "scenario", "name", "variant")


def _row_name(row: dict[str, Any], index: int) -> str:
    parts = [f"{k}={row[k]}" for k in ROW_KEYS if isinstance(row.get(k), (str, int))]
    return ",".join(parts) or str(index)


def _is_summary(v: Any) -> bool:
    return isinstance(v, dict) and "median" in v and isinstance(v.get("samples"), list)


def speed_rounds(data: Any, path: str = "") -> dict[str, list[float]]:
    """Every summary dict in the output: name -> its per-round values."""
    out: dict[str, list[float]] = {}
    if _is_summary(data):
        vals = [float(x) for x in data["samples"] if isinstance(x, (int, float))]
        if vals:
            out[path or "value"] = vals
        return out
    if isinstance(data, dict):
        for k, v in data.items():
            if k in ("samples", "params", "machine_start", "machine_end", "server_init"):
                continue
            out.update(speed_rounds(v, f"{path}/{k}" if path else str(k)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            name = _row_name(v, i) if isinstance(v, dict) else str(i)
            out.update(speed_rounds(v, f"{path}/{name}" if path else name))
    return out


def split_samples(data: dict[str, Any]) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    """(samples for the store, the output without its bulky per-token arrays)."""
    result = {k: v for k, v in data.items() if k != "samples"}
    samples: dict[str, dict[str, list[float]]] = {}
    for series, metrics in (data.get("samples") or {}).items():
        samples[str(series)] = {m: [float(x) for x in vals] for m, vals in metrics.items() if vals is not None}
    for name, vals in speed_rounds(result).items():
        samples.setdefault(name, {})["rounds"] = vals
    return samples, result
