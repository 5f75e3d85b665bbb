"""Deterministic mode: the settings under which a sequence's logits depend only on its
own tokens, not on what else is decoded with it or where its KV cells sit.

opdump/opdiff (docs/DETERMINISM.md) found four kernel paths that change a token's result
with the batch shape or cell placement: repacked weights (GEMM for blocks of rows, GEMV for
the rest), the tiled K-quant matmul (from 8 rows), flash attention's tiled and split-KV
paths, and one KV buffer for all sequences (sums over cells by cell index). The mode turns
each off: weights in file layout, tiled matmul off, flash attention off, one KV stream per
sequence. What it sets per cache type is that type's row (cachetypes.py: det_flash_attn,
det_ubatch): turbo K and V need flash attention, and micro-batches below FA_TILE_ROWS keep
every row on the row-by-row path (tests/test_turbo_deterministic.py); other quantized types
and mixed pairs are refused (type_problem()).
"""

from __future__ import annotations

import os

from . import cachetypes

TILED_ENV = "GGML_CPU_TILED_MM"

#: init field -> the value deterministic mode needs; an explicit other value is an error
#: (flashAttn: the cache types' det_flash_attn, required()).
REQUIRED = {"flashAttn": "off", "kvUnified": False}


def _modes(types: tuple[str, str]) -> list[str | None]:
    return [r.det_flash_attn if (r := cachetypes.find(t)) is not None else None for t in types]


def type_problem(types: tuple[str, str]) -> tuple[int, str] | None:
    """Why deterministic mode refuses this K/V pair: (0 for K, 1 for V; the reason), or None."""
    modes = _modes(types)
    on, off = cachetypes.names(det_flash_attn="on"), cachetypes.names(det_flash_attn="off")
    if "on" in modes and modes != ["on", "on"]:
        return (modes.index("on") ^ 1, f"deterministic mode takes {', '.join(on)} for both K and V or for "
                "neither (the mixed pairs were not measured)")
    for i, m in enumerate(modes):
        if m is None:
            return (i, f"deterministic mode computes attention without flash attention, which takes only "
                    f"{', '.join(off)} (or {', '.join(on)} for both K and V) here")
    return None


def required(types: tuple[str, str]) -> dict:
    """The init fields deterministic mode sets for these K/V cache types."""
    return {**REQUIRED, "flashAttn": "on"} if _modes(types) == ["on", "on"] else REQUIRED

#: ggml-cpu's GGML_FA_TILE_Q: flash attention's tiled path from this many query rows.
FA_TILE_ROWS = 64


def ubatch(types: tuple[str, str], n_batch: int) -> int | None:
    """n_ubatch that keeps flash attention row by row for these K/V types (None: n_batch's)."""
    caps = [r.det_ubatch for t in types if (r := cachetypes.find(t)) is not None and r.det_ubatch]
    return min(n_batch, *caps) if caps else None


def apply_process_settings() -> None:
    """Turn the tiled K-quant matmul off. ggml reads the variable once per process, at
    the first graph it plans, so this must run before the first context is created (the
    server has one init per process)."""
    os.environ[TILED_ENV] = "0"


def tiled_matmul() -> bool:
    """Whether the tiled K-quant matmul is on in this process (ggml's reading of it)."""
    v = os.environ.get(TILED_ENV)
    try:
        return v is None or int(v) != 0
    except ValueError:
        return False
