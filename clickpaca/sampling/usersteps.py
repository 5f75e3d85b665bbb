"""Sampler steps written by the user, and `clickpaca serve --steps FILE_OR_MODULE`.

    # my_steps.py
    from clickpaca.sampling.usersteps import step, param, real

    @step("shift", params=[param("shiftBy", 0.0, real(-10, 10), "added to every candidate")])
    def shift(ids, logits, p, ctx):
        return ids, logits + p.shift_by

`step` registers the function as one row of the step registry (sampling/registry.py), so its
parameters get the built-in steps' checks, defaults and errors. It gets the candidate set
(int32 ids and their logits), the SamplerParams and a StepContext, and returns the (ids,
logits) to keep, a subset of its ids. It runs on the engine thread; an exception or a result
that is not a subset ends that sequence alone with an `error` naming the step. Its thread
CPU time per request is `done.steps_ms`. docs/EXPERIMENTS.md has an example.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from . import table as _builtin_rows  # noqa: F401  (the built-in rows come first in the order)
from .registry import (ELEMENTWISE, GENERAL, KINDS, SCALE, TRUNCATION, Param, Step, choice_strings, integer,
                       real, register, steps)

__all__ = ["step", "param", "real", "integer", "choice_strings", "load", "StepFailed", "StepLoadError",
           "step_ms", "GENERAL", "ELEMENTWISE", "TRUNCATION", "SCALE"]

#: Where a sequence's step states keep the user steps' CPU time (ns by step name).
TIME_KEY = "__user_step_ns__"


class StepFailed(RuntimeError):
    """A user step raised (or returned something unusable): ends that sequence only."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"step {name!r} failed: {reason}")
        self.step = name


class StepLoadError(RuntimeError):
    """A --steps file or module could not be loaded, or registered no step."""


def _snake(wire: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", wire).lower()


def param(wire: str, default: Any, check: Callable[[str, Any], Any], doc: str = "",
          field: str | None = None) -> Param:
    """A step parameter: its protocol name, default, check (real(), integer(),
    choice_strings(), or any (name, value) -> value raising SamplerParamError) and meaning.
    The step reads it as the snake_case attribute (`shiftBy` -> `p.shift_by`)."""
    return Param(field or _snake(wire), wire, default, check, (), doc)


def _at_defaults(params: tuple[Param, ...]) -> Callable[[Any, bool], bool]:
    def off(p: Any, has_hist: bool) -> bool:
        return all(getattr(p, q.field) == q.default for q in params)
    return off


def _guard(name: str, fn: Callable) -> Callable:
    """The registered run: the user's function, timed, with its failures named."""
    def run(ids: np.ndarray, logits: np.ndarray, p: Any, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.thread_time_ns()
        try:
            out = fn(ids, logits, p, ctx)
            if not isinstance(out, tuple) or len(out) != 2:
                raise StepFailed(name, f"must return (ids, logits), returned {type(out).__name__}")
            new_ids, new_logits = np.asarray(out[0]), np.asarray(out[1], dtype=np.float64)
            if new_ids.ndim != 1 or new_ids.shape != new_logits.shape:
                raise StepFailed(name, f"returned ids of shape {new_ids.shape} and logits of shape "
                                       f"{new_logits.shape}; both must be 1-D and of one length")
            if new_ids.dtype.kind not in "iu":
                raise StepFailed(name, f"returned ids of dtype {new_ids.dtype}, not integers")
            if out[0] is not ids and new_ids.size and not np.isin(new_ids, ids).all():
                raise StepFailed(name, "returned token ids that were not among its candidates")
            return new_ids.astype(np.int32, copy=False), new_logits
        except StepFailed:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the user's code raises ends its sequence
            raise StepFailed(name, f"{type(e).__name__}: {e}") from e
        finally:
            times = ctx.states.setdefault(TIME_KEY, {})
            times[name] = times.get(name, 0) + time.thread_time_ns() - t0
    run.__wrapped__ = fn
    return run


def step(name: str, kind: str = GENERAL, params: Iterable[Param] = (), *,
         off: Callable[[Any, bool], bool] | None = None,
         touches: Callable[[Any, Any], np.ndarray] | None = None,
         truncates: Callable[[Any, int], bool] | None = None,
         before: str | None = None, doc: str = "") -> Callable[[Callable], Callable]:
    """Register the decorated function as sampler step `name` (see the module docstring).

    kind: GENERAL (default: may use or change any candidate), ELEMENTWISE (changes the
      logits of the tokens `touches(p, ctx)` returns, sorted int32 ids), TRUNCATION (keeps
      an upper set) or SCALE.
    off(p, has_hist): when the step is an identity. Default: when every parameter is at
      its default, so a step that requests do not ask for costs nothing in the default
      chain (which holds every registered step, in order). A step without parameters
      must say when it is off.
    before: its place in the default order (default: after every other step).
    """
    params = tuple(params)
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if off is None:
        if not params:
            raise ValueError(f"{name}: a step without parameters must say when it is off (off=...)")
        off = _at_defaults(params)

    def deco(fn: Callable) -> Callable:
        extra: dict[str, Any] = {}
        if truncates is not None:
            extra["truncates"] = truncates
        elif kind == TRUNCATION:
            extra["truncates"] = lambda p, n_allowed: True
        # shared_state: the user's code may read anything (it was written for the engine
        # thread), so its chains are never sampled on a worker thread (sampling/batch.py)
        row = Step(name, kind, run=_guard(name, fn), off=off, params=params, touches=touches,
                   doc=doc or (fn.__doc__ or "").strip().split("\n")[0], shared_state=True, **extra)
        register(row, before=before)
        fn.step = row
        return fn
    return deco


def step_ms(states: dict) -> dict[str, float] | None:
    """The user steps' CPU time (ms by step name) that a sequence's sampler accumulated
    since the last call, or None when none ran (the times are taken out)."""
    ns = states.pop(TIME_KEY, None)
    return {k: round(v / 1e6, 3) for k, v in ns.items()} if ns else None


def load(spec: str) -> list[str]:
    """Import a file (path) or module (dotted name) that registers steps; their names."""
    before = {s.name for s in steps()}
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.exists():
            if not path.is_file():
                raise StepLoadError(f"{spec}: no such file")
            modname = f"clickpaca_user_steps_{re.sub(r'[^0-9A-Za-z_]', '_', path.resolve().stem)}"
            mspec = importlib.util.spec_from_file_location(modname, path.resolve())
            if mspec is None or mspec.loader is None:
                raise StepLoadError(f"{spec}: not a Python file")
            mod = importlib.util.module_from_spec(mspec)
            sys.modules[modname] = mod
            mspec.loader.exec_module(mod)
        else:
            importlib.import_module(spec)
    except StepLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module: report what it raised
        raise StepLoadError(f"{spec}: {type(e).__name__}: {e}") from e
    new = [s.name for s in steps() if s.name not in before]
    if not new:
        raise StepLoadError(f"{spec}: registered no step (decorate a function with clickpaca.sampling.usersteps.step)")
    return new  # requests may now carry their parameters: the protocol reads the live registry
