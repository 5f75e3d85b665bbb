"""Arguments shared by the bench commands (threads, model, output folder)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def threads(args: Any) -> int:
    return int(getattr(args, "threads", None) or os.cpu_count() or 1)


def model_path(args: Any) -> str:
    from ..llama.models import resolve_model

    return str(resolve_model(getattr(args, "model", None)))


def out_dir(args: Any) -> str:
    return str(getattr(args, "out", None) or "bench-results")


def png(args: Any, name: str) -> Path:
    return Path(out_dir(args)) / f"{name}.png"


DEFAULTS = {"tokens": 64, "prompt_tokens": 32, "repeats": 3}


def with_defaults(args: Any, **defaults: Any) -> Any:
    """A copy of args where every option left at None takes the command's default."""
    import copy

    a = copy.copy(args)
    for k, v in {**DEFAULTS, **defaults}.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a
