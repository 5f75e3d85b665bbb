"""Deterministic mode: the settings under which a sequence's logits depend only on its
own tokens, not on what else is decoded with it or where its KV cells sit.

Measured with opdump/opdiff (docs/DETERMINISM.md) on this CPU build, each of these is a
kernel path that changes a token's result with the batch shape or cell placement:
- repacked weights (llama_model_params.use_extra_bufts): a GEMM kernel for blocks of rows,
  a GEMV kernel for the rest;
- the tiled K-quant matmul (GGML_CPU_TILED_MM, read once per process): taken from 8 rows;
- flash attention: a tiled path for many query rows, a split-KV path for one query row
  over 512 cells or more, a one-by-one path otherwise;
- one KV buffer for all sequences: attention sums over cells in SIMD lanes by cell index,
  so where a sequence's cells sit (after other sequences', after a fork's shared cells)
  changes the rounding.
The mode turns each off: weights in file layout, tiled matmul off, flash attention off,
one KV stream per sequence (its cells at 0..n-1 of its own stream).

What the mode sets for each cache type is in its row (cachetypes.py: det_flash_attn,
det_ubatch). An unquantized K/V takes attention without flash attention. A turbo K/V
cache needs flash attention (llama.cpp: a quantized V), and the turboquant patch sends it
down flash attention's tiled path from FA_TILE_ROWS query rows of a stream in one
micro-batch; the split-KV path takes only f16/f32 K/V. With micro-batches below that (the
row's det_ubatch), every row goes row by row and the logits do not depend on the batch
shape (tests/test_turbo_deterministic.py). `init` with both K and V of such types
therefore sets flash attention on and those micro-batches (required(), ubatch()). Other
types (a quantized K alone takes other matmul kernels, not measured for this) and mixed
pairs are refused (type_problem()).
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
