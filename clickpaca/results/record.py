"""Recording a command's run in the results store: the one place commands call.

    with recording("bench decode", args):
        ...                       # the command; its report.emit() calls attach(name, data)

The run row is written as `running` before the command starts (with provenance) and
closed when it ends: `complete` with the emitted data and raw samples, or `failed`
with the error. attach() without an open recording (a bench called from Python)
records a run of its own. The store is checked before any measuring starts, so a
damaged database stops the command at once instead of after a long run.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..llama.cachetypes import build_for, parse_pair
from . import provenance as prov
from .samples import split_samples
from .store import ResultsStoreError, Store

_current: list[dict[str, Any]] = []

#: Options that change where output goes, not what is measured.
NOT_PARAMS = {"func", "command", "out", "plot", "run_group"}


def _params(args: Any) -> dict[str, Any]:
    d = vars(args) if hasattr(args, "__dict__") else dict(args or {})
    return {k: v for k, v in d.items() if k not in NOT_PARAMS and not callable(v)}


def _model_path(args: Any) -> str | None:
    try:
        from ..llama.models import resolve_model

        return str(resolve_model(getattr(args, "model", None)))
    except Exception:  # noqa: BLE001 - a command without a model still gets a record
        return None


def _builds_of(args: Any) -> list[str]:
    builds = {getattr(args, "build", None) or "mainline"}
    cache = getattr(args, "cache", None)
    if cache and builds == {"mainline"}:  # mainline picks the build per type (turbo types: turboquant)
        builds |= {build_for(*parse_pair(s)) for s in str(cache).split(",") if s.strip()}
    return sorted(builds)


def _builds_in(data: dict[str, Any]) -> list[str]:
    found = {r.get("build") for r in data.get("rows") or [] if isinstance(r, dict)}
    params = data.get("params") or {}
    found.add(params.get("build"))
    return sorted(b for b in found if isinstance(b, str))


def _say(msg: str) -> None:
    print(f"[results] {msg}", file=sys.stderr, flush=True)


@contextmanager
def recording(command: str, args: Any) -> Iterator[dict[str, Any]]:
    """Record the command run inside the block (see the module docstring)."""
    store = Store()  # a damaged or newer database raises here, before measuring
    try:
        p = prov.capture(_model_path(args), _builds_of(args))
        group = os.environ.get("CLICKPACA_RUN_GROUP") or getattr(args, "run_group", None)
        run_id = store.open_run(command, _params(args), p, run_group=group)
    except BaseException:
        store.close()
        raise
    _say(f"run {run_id} ({command}) recording in {store.path}")
    state: dict[str, Any] = {"id": run_id, "data": None, "name": None}
    _current.append(state)
    error = None
    try:
        yield state
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        _current.pop()
        data = state["data"]
        samples, result = split_samples(data) if data is not None else ({}, None)
        if data is None and error is None:
            error = "the command emitted no result"
        # what was asked, then what the command resolved (text path, threads, model, ...)
        params = {**_params(args), **((result or {}).get("params") or {})}
        try:
            store.close_run(run_id, result, samples, prov.finish(p, _builds_in(data or {})), error, params)
            _say(f"run {run_id} {'failed' if error else 'complete'}: `clickpaca results show {run_id}`")
        except (ResultsStoreError, sqlite3.Error) as e:
            _say(f"run {run_id} could NOT be closed (it stays incomplete): {e}")
            if error is None:  # never hide the command's own error behind this one
                raise
        finally:
            store.close()


def attach(name: str, data: dict[str, Any]) -> int | None:
    """Hand a command's output to the open recording, or record it as a run of its own.

    Returns the run id."""
    if _current:
        state = _current[-1]
        if state["data"] is not None:  # a second emit in one command: keep both
            state["data"] = {"parts": [state["data"], data]}
        else:
            state["data"] = data
        state["name"] = name
        return state["id"]
    import argparse

    params = argparse.Namespace(**dict(data.get("params") or {}))
    cmd = "ppl" if name == "ppl" else f"bench {name}"
    try:
        with recording(cmd, params) as state:
            state["data"] = data
        return state["id"]
    except ResultsStoreError as e:
        _say(f"NOT RECORDED: {e}")
        return None
