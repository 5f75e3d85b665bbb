"""The control-vector fields of the protocol, checked at the edge (wire/protocol/requests.py declares them).

- init `controlVector`: a control-vector GGUF path (llama.cpp's format: `clickpaca cvec`
  writes one, cvector-generator too), or the directions as data, `{layer: vector}`, each
  vector a list of n_embd numbers or a `capture` payload (`{"dtype", "shape", "data"}`,
  base64: capture.encode). Only the form is checked here; the sizes against the model at
  init (steer.flat).
- init `controlVectorLayers`: `[start, end]`, inclusive (llama.cpp's
  --control-vector-layer-range); the model's bound is checked at init.
- `controlVectorStrength`: on init every sequence's (default 1), on infer its own.

Directions as data become `((layer, float32 little-endian bytes), ...)`: requests are
frozen and compared field by field (a shared server compares init with what it runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.fieldcheck import show

MAX_LAYERS = 1024  # directions in one controlVector
MAX_EMBD = 1 << 16  # numbers in one direction
MAX_STRENGTH = 1e6  # |controlVectorStrength|: finite and bounded (a direction times it stays finite in f32)
#: |a direction's value|, from data or a GGUF: far above any residual stream's (Gemma 3
#: 270M's l_out rows stay within ~1e3), and with MAX_STRENGTH well inside float32, where
#: llama.cpp's RMS norm squares it (3e38 overflowed to inf, and no token could be sampled)
MAX_VALUE = 1e6
MAX_PATH_BYTES = 4096  # PATH_MAX: a longer controlVector path is refused here, not by the OS
MAX_LAYER_DIGITS = 4

Directions = tuple[tuple[int, bytes], ...]


def control_vector(name: str, v: Any) -> str | Directions:
    """A GGUF path (a non-empty string) or the directions as data."""
    if isinstance(v, str):
        if not v:
            raise ValueError(f"{name}: must not be empty")
        if len(v.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
            raise ValueError(f"{name}: a path of at most {MAX_PATH_BYTES} bytes, got {len(v.encode('utf-8', 'surrogatepass'))}")
        return v
    if not isinstance(v, dict) or not v:
        raise ValueError(f"{name}: must be a control-vector GGUF path or {{layer: vector}} "
                         f"(a non-empty object), got {type(v).__name__}")
    if len(v) > MAX_LAYERS:
        raise ValueError(f"{name}: {len(v)} layers, the limit is {MAX_LAYERS}")
    out = []
    for key, vec in v.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()) or len(key) > MAX_LAYER_DIGITS:
            raise ValueError(f"{name}: layer {show(key)} is not a layer number "
                             f"(at most {MAX_LAYER_DIGITS} digits)")
        il = int(key)
        if il < 1:
            raise ValueError(f"{name}: layer {il}: llama.cpp never steers layer 0")
        out.append((il, direction(f"{name}: layer {il}", vec).astype("<f4").tobytes()))
    sizes = {len(b) for _, b in out}
    if len(sizes) != 1:
        raise ValueError(f"{name}: the layers' vectors differ in length ({sorted(s // 4 for s in sizes)})")
    return tuple(sorted(out))


def direction(name: str, v: Any) -> np.ndarray:
    """One layer's vector: a list of finite numbers, or a capture payload of one row;
    `name` begins its errors ("controlVector: layer 3")."""
    if isinstance(v, dict):
        from .capture import DTYPES, decode

        if set(v) != {"dtype", "shape", "data"} or v["dtype"] not in DTYPES:
            raise ValueError(f"{name}: a payload is {{\"dtype\": {' or '.join(map(repr, sorted(DTYPES)))}, "
                             "\"shape\", \"data\"}} (what capture sends)")
        shape = v["shape"]
        if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                for n in shape)
                and 1 <= len(shape) <= 2 and (len(shape) == 1 or shape[0] == 1)):
            raise ValueError(f"{name}: shape must be [n_embd] or [1, n_embd], got {show(shape)}")
        try:
            arr = np.asarray(decode(v), dtype=np.float32).reshape(-1)
        except (ValueError, TypeError) as e:  # base64, or data that does not fill the shape
            raise ValueError(f"{name}: data does not decode to shape {shape}: {e}") from None
    elif isinstance(v, list):
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            raise ValueError(f"{name}: must be a list of numbers")
        arr = np.asarray(v, dtype=np.float32)
    else:
        raise ValueError(f"{name}: must be a list of numbers or a capture payload, got {type(v).__name__}")
    return values(name, arr)


def values(name: str, arr: np.ndarray) -> np.ndarray:
    """A direction's numbers, from data or from a GGUF (vector.py): 1..MAX_EMBD of them,
    finite in float32 and within +-MAX_VALUE."""
    if not 1 <= arr.size <= MAX_EMBD:
        raise ValueError(f"{name}: {arr.size} numbers, must be 1..{MAX_EMBD}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: must be finite numbers (float32)")
    if np.abs(arr).max() > MAX_VALUE:
        raise ValueError(f"{name}: values must be within +-{MAX_VALUE:g}, got {float(np.abs(arr).max()):g}")
    return arr


def layer_range(name: str, v: Any) -> tuple[int, int]:
    """[start, end], 1 <= start <= end."""
    if not (isinstance(v, list) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise ValueError(f"{name}: must be [start, end] (two layer numbers), got {show(v)}")
    start, end = v
    if not 1 <= start <= end:
        raise ValueError(f"{name}: [{start}, {end}]: need 1 <= start <= end (llama.cpp never steers layer 0)")
    return start, end


def strength(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}: must be a finite number, got {show(v)}")
    if abs(v) > MAX_STRENGTH:
        raise ValueError(f"{name}: must be within +-{MAX_STRENGTH:g}, got {v}")
    return float(v)


def directions(v: Directions) -> dict[int, np.ndarray]:
    """The data form back to {layer: float32 [n_embd]} (steer.apply takes it)."""
    return {il: np.frombuffer(b, dtype="<f4").astype(np.float32) for il, b in v}


# ---------------------------------------------------------------- steering slots (#vector, steer)

MAX_STEER = 16  # entries in one request's steer list
MAX_POSITION = 1 << 30  # a token index (from / until): far beyond any context
MAX_AFTER_BYTES = 256  # an `after` string


def vector_id(name: str, v: Any) -> str:
    """A vector's id: a string or an integer, as a grammar's id."""
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError(f"{name}: must be a string or an integer, got {show(v)}")
    v = str(v)
    if not 1 <= len(v) <= 128:
        raise ValueError(f"{name}: 1..128 characters, got {len(v)}")
    return v


def _position(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_POSITION:
        raise ValueError(f"{name}: must be a token index 0..{MAX_POSITION}, got {show(v)}")
    return v


def _threshold(name: str, v: Any) -> float:
    """A gate's threshold: a finite number, or "inf" / "-inf" (JSON has no infinities)."""
    if v in ("inf", "-inf"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}: must be a finite number, \"inf\" or \"-inf\", got {show(v)}")
    return float(v)


def _layers_text(name: str, v: Any) -> tuple[int, int]:
    """"a-b" or "a" (inclusive), or [a, b]; the model's bound is checked by the engine."""
    if isinstance(v, str):
        parts = v.split("-")
        if len(parts) in (1, 2) and all(p.isdigit() and p.isascii() and len(p) <= MAX_LAYER_DIGITS for p in parts):
            a, b = int(parts[0]), int(parts[-1])
            if 1 <= a <= b:
                return a, b
        raise ValueError(f"{name}: must be \"a-b\" or \"a\" with 1 <= a <= b, got {show(v)}")
    return layer_range(name, v)


@dataclass(frozen=True)
class Gate:
    """`when`: steer only where the residual after `layer`, projected on `vector`'s
    direction there, exceeds `above` (computed in the graph)."""

    vector: str
    layer: int
    above: float


@dataclass(frozen=True)
class SteerEntry:
    """One entry of a request's `steer`: which vector, how strong, on which layers, and
    when (`start`: "prompt", "generated" or a token index; `until`: a token index;
    `after`: a string or a token id; `when`: a Gate)."""

    vector: str
    strength: float
    layers: tuple[int, int] | None = None
    start: str | int = "prompt"
    until: int | None = None
    after: str | int | None = None
    when: Gate | None = None


_ENTRY_FIELDS = {"vector", "strength", "layers", "from", "until", "after", "when"}


def steer_list(name: str, v: Any) -> tuple[SteerEntry, ...]:
    """A request's `steer`: a list of 1..MAX_STEER entries; one `when` per request (its
    gated entries share it)."""
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_STEER:
        raise ValueError(f"{name}: must be a list of 1..{MAX_STEER} entries, got {show(v)}")
    out = []
    for i, e in enumerate(v):
        at = f"{name}: [{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{at}: must be an object {{vector, strength, ...}}, got {show(e)}")
        extra = sorted(set(e) - _ENTRY_FIELDS)
        if extra:
            raise ValueError(f"{at}.{extra[0]}: unknown field (known: {', '.join(sorted(_ENTRY_FIELDS))})")
        if "vector" not in e or "strength" not in e:
            raise ValueError(f"{at}.{'vector' if 'vector' not in e else 'strength'}: missing")
        start = e.get("from", "prompt")
        if start not in ("prompt", "generated"):
            start = _position(f"{at}.from", start)
        after = e.get("after")
        if after is not None:
            if isinstance(after, str):
                if not after or len(after.encode("utf-8", "surrogatepass")) > MAX_AFTER_BYTES:
                    raise ValueError(f"{at}.after: a string of 1..{MAX_AFTER_BYTES} bytes or a token id")
            elif isinstance(after, bool) or not isinstance(after, int) or not 0 <= after < (1 << 31):
                raise ValueError(f"{at}.after: must be a string or a token id, got {show(after)}")
        when = e.get("when")
        if when is not None:
            if not isinstance(when, dict) or set(when) != {"vector", "layer", "above"}:
                raise ValueError(f"{at}.when: must be {{\"vector\", \"layer\", \"above\"}}, got {show(when)}")
            lay = when["layer"]
            if isinstance(lay, bool) or not isinstance(lay, int) or lay < 1:
                raise ValueError(f"{at}.when.layer: must be a layer number >= 1, got {show(lay)}")
            when = Gate(vector_id(f"{at}.when.vector", when["vector"]), lay,
                        _threshold(f"{at}.when.above", when["above"]))
        until = e.get("until")
        out.append(SteerEntry(vector_id(f"{at}.vector", e["vector"]), strength(f"{at}.strength", e["strength"]),
                              _layers_text(f"{at}.layers", e["layers"]) if e.get("layers") is not None else None,
                              start, _position(f"{at}.until", until) if until is not None else None, after, when))
    gates = {x.when for x in out if x.when is not None}
    if len(gates) > 1:
        raise ValueError(f"{name}: one `when` per request (its gated entries share it), got {len(gates)}")
    return tuple(out)
