"""The `patch` field of infer / score / prefill, checked at the edge (wire/protocol/requests.py
declares it; docs/PROTOCOL.md "Activation patching").

`patch: [{node, positions, source, mode}]`: write `source`'s rows into graph node `node` at
the sequence's `positions` during its decodes (activations/patching.py), replacing the
computed rows (`mode` "replace", the default) or adding to them ("add"). `source` is what
capture gives: an inline payload `{"dtype", "shape", "data"}` (capture.encode), or a `.npy`
file the server wrote in the client's namespace (the `{"file": ...}` reference of a capture
event, or its path as a string), one row per position, in the order of `positions`.

Checked here: the form, the positions (distinct, >= 0), an inline source's shape against
the positions and its values (finite). The node against the model's graph, a file's rows and
the positions against the request's tokens are the handler's (engine/patches.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.fieldcheck import show
from .patching import MODES

MAX_PATCHES = 64  # entries in one request's patch
MAX_POSITIONS = 1 << 16  # positions in one entry
MAX_FILE_BYTES = 4096  # a source file's path


@dataclass(frozen=True)
class PatchSpec:
    """One entry: the rows inline (`rows`, float32 little-endian bytes, `shape`) or a file
    to read (`file`)."""

    node: str
    positions: tuple[int, ...]
    mode: str
    shape: tuple[int, ...] = ()
    rows: bytes | None = None
    file: str | None = None

    def values(self) -> np.ndarray:
        """The inline rows, float32 [positions, ...] (for a file: engine/patches.py)."""
        return np.frombuffer(self.rows, dtype="<f4").astype(np.float32).reshape(self.shape)


def patches(name: str, v: Any) -> tuple[PatchSpec, ...]:
    if not isinstance(v, list) or not v:
        raise ValueError(f"{name}: must be a non-empty list of {{node, positions, source, mode}}, got {show(v)}")
    if len(v) > MAX_PATCHES:
        raise ValueError(f"{name}: {len(v)} entries, the limit is {MAX_PATCHES}")
    return tuple(entry(f"{name}: [{i}]", e) for i, e in enumerate(v))


def entry(name: str, e: Any) -> PatchSpec:
    if not isinstance(e, dict):
        raise ValueError(f"{name}: must be an object {{node, positions, source, mode}}, got {show(e)}")
    extra = sorted(set(e) - {"node", "positions", "source", "mode"})
    if extra:
        raise ValueError(f"{name}: unknown field {extra[0]!r} (node, positions, source, mode)")
    for need in ("node", "positions", "source"):
        if need not in e:
            raise ValueError(f"{name}.{need}: required")
    node = e["node"]
    if not isinstance(node, str) or not node or len(node) > 128:
        raise ValueError(f"{name}.node: must be a graph node's name, got {show(node)}")
    mode = e.get("mode", "replace")
    if mode not in MODES:
        raise ValueError(f"{name}.mode: must be one of {list(MODES)}, got {show(mode)}")
    pos = e["positions"]
    if not (isinstance(pos, list) and pos and len(pos) <= MAX_POSITIONS
            and all(isinstance(p, int) and not isinstance(p, bool) for p in pos)):
        raise ValueError(f"{name}.positions: must be a non-empty list of at most {MAX_POSITIONS} "
                         f"token positions (integers), got {show(pos)}")
    if min(pos) < 0:
        raise ValueError(f"{name}.positions: position {min(pos)} is negative")
    if len(set(pos)) != len(pos):
        raise ValueError(f"{name}.positions: a position is given twice")
    src = e["source"]
    if isinstance(src, str) or (isinstance(src, dict) and "file" in src):
        path = src if isinstance(src, str) else src["file"]
        if not isinstance(path, str) or not path or len(path.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
            raise ValueError(f"{name}.source: a file is named by a non-empty path of at most {MAX_FILE_BYTES} bytes")
        return PatchSpec(node, tuple(pos), mode, file=path)
    arr = inline(f"{name}.source", src)
    if arr.shape[0] != len(pos):
        raise ValueError(f"{name}.source: {arr.shape[0]} rows for {len(pos)} positions (shape {list(arr.shape)}); "
                         "one row per position")
    return PatchSpec(node, tuple(pos), mode, tuple(arr.shape), arr.astype("<f4").tobytes())


def inline(name: str, v: Any) -> np.ndarray:
    """A capture payload's rows, float32, checked finite."""
    from .capture import DTYPES, decode

    if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data"} or v.get("dtype") not in DTYPES:
        raise ValueError(f"{name}: must be a capture payload {{\"dtype\": {' or '.join(map(repr, sorted(DTYPES)))}, "
                         "\"shape\", \"data\"}} or a file the server wrote ({\"file\": path} or the path)")
    shape = v["shape"]
    if not (isinstance(shape, list) and 2 <= len(shape) <= 4
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise ValueError(f"{name}: shape must be [positions, ...row] (2 to 4 dimensions), got {show(shape)}")
    try:
        arr = np.asarray(decode(v), dtype=np.float32)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: data does not decode to shape {shape}: {e}") from None
    return finite(name, arr)


def finite(name: str, arr: np.ndarray) -> np.ndarray:
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: values must be finite (NaN or infinity found)")
    return arr
