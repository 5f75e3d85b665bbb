"""`bench decode --rpc ...` and `bench batch --rpc ...`: the same load on the local model,
on one RPC worker and on two, side by side in one run.

`--rpc loopback` starts two workers of the build on 127.0.0.1 (rpc/worker.py);
`--rpc host:port,host:port` uses running ones. Sides: "local" (no worker), then "1
worker" (the first endpoint), "2 workers" (the first two), ... with every layer on the
workers (nGpuLayers 99, split evenly). A worker serves one client at a time, so each
side gets a server of its own for each round, started and closed in turn: the rounds
alternate the sides (stats.alternate) and start-up is not measured.

Bytes crossing the network per token: the kernel's counters of the server's
connections to the workers (`ss -ti`: bytes_sent, bytes_received), read before and
after each measured run, over the tokens that run generated (prompts included in the
bytes: the figure is what generating a token costs all in).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from contextlib import contextmanager
from typing import Any, Iterator

from ...rpc.wire import parse_endpoint
from ...results.stats import progress
from ...results.table import markdown

LOOPBACK = "loopback"


def sides(endpoints: list[str]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("local", {})]
    for k in range(1, len(endpoints) + 1):
        out.append((f"{k} worker{'s' if k > 1 else ''}",
                    {"rpcServers": endpoints[:k], "nGpuLayers": 99, "tensorSplit": [1.0] * k}))
    return out


@contextmanager
def workers(spec: str, build: str, threads: int) -> Iterator[list[str]]:
    """The endpoints of --rpc: two loopback workers started here (stopped at the end), or
    the given list."""
    if spec.strip() == LOOPBACK:
        from ...rpc.worker import start_local

        progress(f"rpc: starting 2 loopback workers ({build}, {threads} threads each)")
        started = start_local(2, build, threads)
        try:
            yield [w.text for w in started]
        finally:
            for w in started:
                w.stop()
        return
    eps = [e.strip() for e in spec.split(",") if e.strip()]
    for e in eps:
        parse_endpoint(e)  # ValueError names the bad one
    yield eps


_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


def traffic(endpoints: list[str]) -> dict[str, dict[str, int]] | None:
    """Per endpoint, bytes sent to and received from it over this machine's established
    TCP connections to it (`ss`); None when ss is not available."""
    if shutil.which("ss") is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for e in endpoints:
        ep = parse_endpoint(e)
        proc = subprocess.run(["ss", "-tinH", "state", "established", f"( dport = :{ep.port} )"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        totals = {"sent": 0, "received": 0}
        for k, v in _SS_BYTES.findall(proc.stdout):
            totals[k] += int(v)
        out[e] = totals
    return out


def delta(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """Bytes sent and received over all workers between two `traffic` readings."""
    if before is None or after is None:
        return None
    return {k: sum(after[e][k] - before[e][k] for e in after) for k in ("sent", "received")}


def per_token(d: dict[str, int] | None, tokens: int) -> dict[str, float] | None:
    if d is None or tokens <= 0:
        return None
    return {"sent": round(d["sent"] / tokens, 1), "received": round(d["received"] / tokens, 1),
            "total": round((d["sent"] + d["received"]) / tokens, 1)}


def side_servers(base: dict[str, Any], endpoints: list[str], layers: int,
                 output_local: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(side name, the server's init) for every side, with nGpuLayers (and outputLocal)
    for the RPC ones."""
    out = []
    for name, extra in sides(endpoints):
        init = {**base, **extra}
        if "rpcServers" in extra:
            init["nGpuLayers"] = layers
            init["outputLocal"] = output_local
        out.append((name, init))
    return out


def where(ready: dict[str, Any]) -> list[dict[str, Any]]:
    """What each device held in a side's server (from its ready event)."""
    return [{k: d.get(k) for k in ("name", "endpoint", "layers", "modelMiB", "kvMiB")}
            for d in ready.get("devices", [])]


def table(names: list[str], rows: list[tuple[Any, dict[str, dict[str, Any]]]], label: str) -> str:
    """One row per load, one column pair per side: tok/s (median) and bytes per token."""
    head = [label] + [f"{n} tok/s" for n in names] + [f"{n} / local" for n in names[1:]] \
        + [f"{n} bytes/token" for n in names[1:]]
    body = []
    for key, per_side in rows:
        local = per_side[names[0]]["tps"]["median"]
        tps = [per_side[n]["tps"]["median"] for n in names]
        rel = [round(per_side[n]["tps"]["median"] / local, 3) if local and per_side[n]["tps"]["median"] else None
               for n in names[1:]]
        bpt = [(per_side[n].get("bytes_per_token") or {}).get("total") for n in names[1:]]
        body.append((key, *tps, *rel, *bpt))
    return markdown(head, body)
