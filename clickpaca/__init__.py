"""clickpaca: steer a language model one token at a time (llama.cpp in-process, NDJSON on stdio)."""

__version__ = "0.1.0"

from .client import Client, ServerError  # noqa: E402

__all__ = ["Client", "ServerError", "__version__"]
