"""clickpaca: steer a language model one token at a time (llama.cpp in-process, NDJSON on stdio)."""

__version__ = "0.1.0"

from .client import Client, ServerError, ServerGone  # noqa: E402

_WORKBENCH = ("Workbench", "Generation", "Score")


def __getattr__(name: str):
    """clickpaca.Workbench & co. on first use: the server process never imports them."""
    if name in _WORKBENCH:
        from . import workbench

        return getattr(workbench, name)
    raise AttributeError(f"module 'clickpaca' has no attribute {name!r}")


__all__ = ["Client", "ServerError", "ServerGone", "Workbench", "Generation", "Score", "__version__"]
