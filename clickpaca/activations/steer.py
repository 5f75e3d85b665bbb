"""A control vector applied to a whole context through llama.cpp's own adapter.

`llama_set_adapter_cvec` adds one direction per layer to the residual stream after layer
il (the graph's `build_cvec`, just before the node named `l_out-il`), for every token of
every sequence in the context: the context-wide vector. Per-sequence strengths need the
activations build (native/activations/; vector.py uses them).

Directions are {layer: [n_embd] float32}; llama.cpp never steers layer 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..llama import features


class SteerError(ValueError):
    """A vector that does not fit the model, or llama.cpp refused it; `field` to blame."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def flat(directions: dict[int, np.ndarray], n_layer: int, n_embd: int,
         strength: float = 1.0) -> np.ndarray:
    """llama.cpp's buffer: n_embd floats per layer from layer 1, scaled by `strength`."""
    out = np.zeros((n_layer - 1, n_embd), dtype=np.float32)
    for il, v in directions.items():
        v = np.asarray(v, dtype=np.float32)
        if not 1 <= il < n_layer:
            raise SteerError("controlVector", f"layer {il} outside 1..{n_layer - 1} (llama.cpp never steers layer 0)")
        if v.shape != (n_embd,):
            raise SteerError("controlVector", f"layer {il}: shape {list(v.shape)}, the model needs [{n_embd}]")
        out[il - 1] = v * np.float32(strength)
    return out.reshape(-1)


def layer_range(layers: tuple[int, int] | None, n_layer: int) -> tuple[int, int]:
    """(start, end) inclusive, as llama.cpp's --control-vector-layer-range; None: all."""
    if layers is None:
        return 1, n_layer - 1
    start, end = int(layers[0]), int(layers[1])
    if not 1 <= start <= end < n_layer:
        raise SteerError("controlVectorLayers", f"[{start}, {end}] outside 1..{n_layer - 1} or reversed")
    return start, end


def apply(ctx: Any, vector: dict[int, np.ndarray] | str | Path, strength: float = 1.0,
          layers: tuple[int, int] | None = None) -> None:
    """Steer every token of `ctx` (a core.Context) with `vector` (directions, or a
    control-vector GGUF) scaled by `strength`, on layers start..end inclusive."""
    set_cvec = _setter(ctx.nat)
    from .cvec import read_gguf

    model = ctx.model
    directions = read_gguf(vector) if isinstance(vector, (str, Path)) else vector
    data = flat(directions, model.n_layer, model.n_embd, strength)
    start, end = layer_range(layers, model.n_layer)
    buf = ctx.nat.ffi.from_buffer("float[]", data)
    rc = set_cvec(ctx.ptr, buf, data.size, model.n_embd, start, end)
    if rc != 0:
        raise SteerError("controlVector", f"llama.cpp refused the vector (llama_set_adapter_cvec returned {rc})")


def clear(ctx: Any) -> None:
    """No vector on the context (llama.cpp keeps the buffers for the next one)."""
    _setter(ctx.nat)(ctx.ptr, ctx.nat.ffi.NULL, 0, ctx.model.n_embd, -1, -1)


def _setter(nat: Any) -> Any:
    """llama_set_adapter_cvec, or its earlier name where the build predates it (features.py
    'cvec'); FeatureMissing where it has neither."""
    if features.available(nat, "cvec"):
        return nat.lib.llama_set_adapter_cvec
    have = features.for_native(nat)
    for name in features.BY_NAME["cvec"].fallback:  # the same signature under each name
        if have(name):
            return getattr(nat.lib, name)
    raise features.FeatureMissing("controlVector", f"build {nat.name!r} lacks llama_set_adapter_cvec "
                                                   f"and its earlier names, so a control vector is refused there")
