"""clickpaca: steer a language model one token at a time (llama.cpp in-process, NDJSON on stdio).

The layers, each importing only those before it (tests/test_layers.py holds the order):
base (imports nothing of clickpaca) -> llama (llama.cpp access) -> rpc (RPC workers) ->
activations (capture and steering) -> sampling (the sampler chain, user steps) ->
grammar -> wire (protocol and client) -> engine -> serve (stdio and socket servers) ->
results (the store and what a run writes) -> measure (bench, ppl, kv-retrieval) ->
workbench (experiments over the client, demo) -> cli.py.
"""

__version__ = "0.1.0"

from .wire.client import Client, ServerError, ServerGone  # noqa: E402

_WORKBENCH = ("Workbench", "Generation", "Score")


def __getattr__(name: str):
    """clickpaca.Workbench & co. on first use: the server process never imports them."""
    if name in _WORKBENCH:
        from . import workbench

        return getattr(workbench, name)
    raise AttributeError(f"module 'clickpaca' has no attribute {name!r}")


__all__ = ["Client", "ServerError", "ServerGone", "Workbench", "Generation", "Score", "__version__"]
