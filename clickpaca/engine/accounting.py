"""What the server holds that grows with the requests it has seen, and each bound.

The `stats` request answers with this: every cache that a request can add to, its
entries and its bytes now, and the most it can hold in both (docs/PROTOCOL.md, stats).
Bytes are what the entries' own data takes (texts, token pieces, the plan keys), not
the allocator's overhead; `rssBytes` beside them is the process as the kernel sees it.
Grammars also hold llguidance's compiled form outside Python: measured at about 30 KiB
for a small grammar, and counted per entry in `GRAMMAR_NATIVE_BYTES`.
"""

from __future__ import annotations

from typing import Any

from ..sampling import chain, dry

# Grammar ids one client may hold, and their texts' bytes together. Each compiled grammar
# costs memory (2,000 ids measured +60 MiB, ~30 KiB each); 1,024 lets a client give every
# one of 256 sequences its own schema several times over (64 stopped `bench peer`'s
# 64-request load with a schema registered per request).
MAX_GRAMMARS_PER_SESSION = 1024
MAX_GRAMMAR_TEXT_PER_SESSION = 16 << 20
GRAMMAR_NATIVE_BYTES = 30 << 10  # llguidance's compiled grammar, per small grammar (measured)
# The sampler plan cache (sampling/chain.py `steps_to_run`): keys are SamplerParams;
# params with more logit_bias entries than chain.PLAN_CACHE_MAX_BIAS are not cached.
# Measured with tracemalloc: 0.7 KiB per cached plan, 4.7 KiB with 64 logit_bias entries.
PLAN_ENTRY_BYTES = 1024 + 64 * chain.PLAN_CACHE_MAX_BIAS
PIECE_OVERHEAD = 33 + 28 + 8  # bytes object header, int key, dict slot (64-bit CPython)


def grammar_bytes(compiled: Any) -> int:
    """A compiled grammar's texts (its source and llguidance's serialized form)."""
    return len(compiled.source) + len(compiled.grammar)


def cache(entries: int, max_entries: int, n_bytes: int, max_bytes: int) -> dict:
    return {"entries": entries, "maxEntries": max_entries, "bytes": n_bytes, "maxBytes": max_bytes}


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def caches(rt: Any, sessions: list, session: Any) -> dict[str, dict]:
    """Every per-request cache of a running server (rt: engine/runtime.py Runtime)."""
    g = rt.grammars.cache_stats()
    info = chain.steps_to_run.cache_info()
    plans, max_plans = info.currsize, info.maxsize
    pieces = rt.model.piece_cache
    piece_bytes = sum(len(p) for p in list(pieces.values())) + PIECE_OVERHEAD * len(pieces)
    max_piece = rt.vocab.longest_text + PIECE_OVERHEAD  # a piece is never longer than its token's text
    mine = list(session.grammars.values())
    every = [c for s in sessions for c in list(s.grammars.values())]
    per_session_max = MAX_GRAMMAR_TEXT_PER_SESSION + MAX_GRAMMARS_PER_SESSION * GRAMMAR_NATIVE_BYTES
    return {
        "grammarCache": cache(g["entries"], g["maxEntries"], g["bytes"] + g["entries"] * GRAMMAR_NATIVE_BYTES,
                              g["maxBytes"] + g["maxEntries"] * GRAMMAR_NATIVE_BYTES),
        "sessionGrammars": cache(len(mine), MAX_GRAMMARS_PER_SESSION,
                                 sum(grammar_bytes(c) + GRAMMAR_NATIVE_BYTES for c in mine), per_session_max),
        "allSessionGrammars": {**cache(len(every), MAX_GRAMMARS_PER_SESSION * len(sessions),
                                       sum(grammar_bytes(c) + GRAMMAR_NATIVE_BYTES for c in every),
                                       per_session_max * len(sessions)), "sessions": len(sessions)},
        "samplerPlans": cache(plans, max_plans, plans * PLAN_ENTRY_BYTES, max_plans * PLAN_ENTRY_BYTES),
        "tokenPieces": cache(len(pieces), rt.model.n_vocab, piece_bytes, rt.model.n_vocab * max_piece),
        # DRY's breaker tables and the vocabulary index they are made from (estimated bytes)
        "dryBreakerSets": dry.held(rt.step_vocab, max_piece),
    }


def stats(rt: Any, sessions: list, session: Any, ticks: int, extra: dict | None = None) -> dict:
    rows = rt.ctx.rows_held
    out = {"ticks": ticks, "rssBytes": rss_bytes(), "caches": caches(rt, sessions, session),
           "logitsRows": {"held": rows, "bytes": rows * rt.model.n_vocab * 4}}
    if extra:
        out.update(extra)
    return out
