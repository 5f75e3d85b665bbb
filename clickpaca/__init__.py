"""clickpaca: steer a language model one token at a time (llama.cpp in-process, NDJSON on stdio)."""

__version__ = "0.1.0"

from .client import Client, ServerError, ServerGone  # noqa: E402

__all__ = ["Client", "ServerError", "ServerGone", "__version__"]
