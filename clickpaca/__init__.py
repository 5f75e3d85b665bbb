"""clickpaca: steer a language model one token at a time (llama.cpp in-process, NDJSON on stdio)."""

__version__ = "0.1.0"

