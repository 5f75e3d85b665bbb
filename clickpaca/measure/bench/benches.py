"""Every `clickpaca bench WHAT`: one row each, the one list of them.

The command line's choices and help, `bench all`'s set and its options, and the checks
made before any work (measure/checks.py) are read from these rows. A new bench is a
module with `run(args)` and its row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ...llama.cachetypes import STUDY_CACHE

__all__ = ["Bench", "BENCHES", "names", "get", "in_all"]


@dataclass(frozen=True)
class Bench:
    name: str
    #: module under clickpaca.measure.bench whose run(args) measures and emits
    module: str
    help: str
    #: `bench all`'s options for it (None: not in `bench all`); options the user gave win
    all: dict[str, Any] | None = None
    #: checks before any work (measure/checks.py CHECKS; `NAME if OPTION`)
    needs: tuple[str, ...] = field(default=())

    def run(self, args: Any) -> Any:
        return importlib.import_module(f"{__package__}.{self.module}").run(args)


#: In `bench all`'s order (make bench); the peer bench against llama-server is part of every
#: full run: the headline claim is measured again whenever the scheduler changes.
BENCHES: tuple[Bench, ...] = (
    Bench("sampler", "sampler", "microseconds per token per sequence of the sampler chain, each step "
          "beside llama.cpp's (--seqs: host time per tick beside the decode; --against REV: an earlier "
          "commit's sampling beside this tree's)",
          all={"repeats": 3}, needs=("model", "against if against")),
    Bench("decode", "decode", "single-sequence decode speed, server against llama-bench tg (--rpc: also on RPC workers)",
          all={"tokens": 64, "repeats": 3}, needs=("model", "llama-bench")),
    Bench("batch", "batch", "N sequences at once, server against llama-batched-bench (--against REV: an "
          "earlier commit's server as one more side of the same rounds)",
          all={"seqs": "1,8,64", "prompt_tokens": 32, "tokens": 32, "repeats": 2},
          needs=("chain if chain", "model", "llama-batched-bench", "center if center", "against if against")),
    Bench("grammar", "grammar", "constrained against unconstrained decoding (JSON schema, Lark, GBNF) at N sequences",
          all={"seqs": "1,8,64", "tokens": 32, "repeats": 3}, needs=("model",)),
    Bench("kv", "kv", "KV cache memory per cache type (--speed: also llama-bench pp/tg)",
          all={}, needs=("model", "cache", "llama-bench if speed")),
    Bench("state", "state", "time to first token over a long document, cold against held state, per cache type",
          all={"repeats": 3, "cache": STUDY_CACHE}, needs=("model", "cache", "text")),
    Bench("peer", "peer", "against llama-server on the same loads (needs `make peer`)",
          all={"repeats": 3}, needs=("loads if loads", "model", "llama-server")),
    Bench("schemas", "schemas", "a corpus of JSON schemas through clickpaca and llama-server",
          needs=("corpus", "model", "llama-server")),
)
_BY_NAME = {b.name: b for b in BENCHES}


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def get(name: str) -> Bench:
    return _BY_NAME[name]


def in_all() -> tuple[Bench, ...]:
    return tuple(b for b in BENCHES if b.all is not None)
