"""KV quantizers in numpy, applied to one layer's K or V rows as a cache would store them.

llama.cpp has one cache type for every layer and only the types it has kernels for. To test
why a type loses (K or V, which layers, which rotation) and to try types before writing C,
hook.py passes a decode's K and V through one of these quantize-dequantize round trips into
an f16 cache. A spec is `KIND[+MOD...]`:

* kinds: `f16`; `q8_0`, `q4_0` (ggml's, bit for bit); `lmB` / `lmBgG` (TurboQuant-mse:
  B-bit Lloyd-Max levels, one fp16 least-squares gain per G values; `lm4` on 128-value
  blocks is turbo4 bit for bit); `splitN:B` (the outlier split: the N channels of largest
  calibrated RMS at B+1 bits, the rest at B);
* modifiers: `+c` (subtract the layer's calibrated mean before quantizing, add it back:
  exact for attention), `+s` (random signs before the rotation), `+norot` (no rotation).

Rotation is mainline's (llama-kv-cache.cpp): K in one Hadamard group as wide as the largest
power of two dividing the head size, V in groups of 64. docs/KV-RESEARCH.md, "The reasons,
tested", has what they showed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ...llama import cachetypes
from ...llama import turboquant as tq


@dataclass(frozen=True)
class Spec:
    kind: str  # a REAL_KINDS name (a cache type's) | lm | split
    bits: int = 0
    group: int | None = None  # lm: values per gain
    n_out: int = 0  # split: outlier channels
    center: bool = False
    signs: bool = False
    rotate: bool = True
    text: str = field(default="", compare=False)


_LM = re.compile(r"^lm([1-8])(?:g(\d+))?$")
_SPLIT = re.compile(r"^split(\d+):([1-7])$")


def parse(text: str) -> Spec:
    """`lm4+c` -> Spec; ValueError naming the part that is not understood."""
    head, *mods = text.strip().split("+")
    opts = {"center": False, "signs": False, "rotate": True}
    for m in mods:
        if m == "c":
            opts["center"] = True
        elif m == "s":
            opts["signs"] = True
        elif m == "norot":
            opts["rotate"] = False
        else:
            raise ValueError(f"quantizer {text!r}: unknown modifier {m!r} (c, s, norot)")
    if head in REAL_KINDS:
        if head == cachetypes.DEFAULT and (opts["signs"] or not opts["rotate"] or opts["center"]):
            raise ValueError(f"quantizer {text!r}: {head} takes no modifier")
        return Spec(head, text=text, **opts)
    if (m := _LM.match(head)):
        return Spec("lm", int(m.group(1)), int(m.group(2)) if m.group(2) else None, text=text, **opts)
    if (m := _SPLIT.match(head)):
        return Spec("split", int(m.group(2)), n_out=int(m.group(1)), text=text, **opts)
    raise ValueError(f"quantizer {text!r}: unknown kind {head!r} ({', '.join(REAL_KINDS)}, lmB[gG], splitN:B)")


def bits_per_value(spec: Spec, head: int) -> float:
    """Everything stored, per value: indices, scales/gains (fp16). Centering stores one
    vector per layer and head (not per token): 0 per value. A real type's is its row's."""
    if spec.kind in REAL_KINDS:
        return cachetypes.get(spec.kind).bits
    if spec.kind == "lm":
        return spec.bits + 16 / lm_group(spec, head)
    n = spec.n_out
    return (n * (spec.bits + 1) + (head - n) * spec.bits + 32) / head


def lm_group(spec: Spec, head: int) -> int:
    return spec.group or min(128, head)


# ----------------------------------------------------------------- rotations


def k_group(head: int) -> int:
    """mainline's K rotation width: the largest power of two dividing the head size."""
    return head & -head


@lru_cache(maxsize=None)
def _signs(n: int) -> np.ndarray:
    return np.where(np.random.default_rng(1234 + n).random(n) < 0.5, -1.0, 1.0)


@lru_cache(maxsize=None)
def orthogonal(n: int) -> np.ndarray:
    """A fixed orthogonal matrix of any size: Hadamard for powers of two, else a seeded QR."""
    if n & (n - 1) == 0:
        return tq.hadamard(n)
    q, r = np.linalg.qr(np.random.default_rng(77 + n).standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def rotate(x: np.ndarray, group: int, signs: bool, inverse: bool = False) -> np.ndarray:
    """Rows of x (width a multiple of group) rotated per group by H (or D then H)."""
    h = tq.hadamard(group)
    s = _signs(group)
    xs = x.reshape(x.shape[0], -1, group)
    if not inverse:
        if signs:
            xs = xs * s
        return (xs @ h.T).reshape(x.shape)
    y = xs @ h  # H orthonormal: inverse = transpose
    if signs:
        y = y * s
    return y.reshape(x.shape)


# ----------------------------------------------------------------- block codes


def q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref then dequantize, on rows (width a multiple of 32)."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = amax / np.float32(127)
    idv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = b * idv[:, None]
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))  # roundf: ties away from zero
    # ggml stores q in an int8; where d underflows fp16 (amax < ~7.6e-6) 1/d overflows and q
    # is inf or nan, but d's fp16 is 0 and the value is 0 whatever q holds: keep q finite
    q = np.clip(np.nan_to_num(q, nan=0.0, posinf=127.0, neginf=-128.0), -128, 127)
    return (q * d.astype(np.float16).astype(np.float32)[:, None]).reshape(np.shape(x))


def q4_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref then dequantize: d = (signed max) / -8, 16 levels."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    i = np.abs(b).argmax(axis=1)
    mx = b[np.arange(len(b)), i]
    d = mx / np.float32(-8)
    idv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, (b * idv[:, None] + np.float32(8.5)).astype(np.int8)).astype(np.float32)
    return ((q - 8) * d.astype(np.float16).astype(np.float32)[:, None]).reshape(np.shape(x))


@lru_cache(maxsize=None)
def levels(bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max levels of N(0, 1/group) and their decision boundaries (float32)."""
    c = (np.asarray(tq.lloyd_max_standard(bits)) / math.sqrt(group)).astype(np.float32)
    return c, ((c[1:] + c[:-1]) / 2).astype(np.float32)


def lloyd_max(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """TurboQuant-mse round trip with one fp16 least-squares gain per `group` values; for
    group 128 and 2-4 bits this is `turboquant.round_trip` (turbo2/3/4) itself."""
    x = np.asarray(x, np.float32)
    if group == tq.QK and bits in (2, 3, 4):
        return tq.round_trip(x.reshape(-1), f"turbo{bits}").reshape(x.shape)
    return lloyd_max_any(x, bits, group)


def lloyd_max_any(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """`lloyd_max` for any bits and group, in float64 with one rounding of u to float32 (not
    the C path's exact order of operations; tests bound the difference from turbo's)."""
    x = np.asarray(x, np.float32)
    b = x.reshape(-1, group).astype(np.float64)
    n = np.sqrt((b * b).sum(axis=1))
    u = (b / np.where(n > 0, n, 1)[:, None]).astype(np.float32)
    c, edges = levels(bits, group)
    idx = np.searchsorted(edges, u, side="left")  # ties to the lower level, as turbo
    cv = c[idx].astype(np.float64)
    cc = (cv * cv).sum(axis=1)
    g = np.where(cc > 0, n * (u * cv).sum(axis=1) / np.where(cc > 0, cc, 1), 0)
    g = np.minimum(g, tq.FP16_MAX).astype(np.float16).astype(np.float32)
    return (g[:, None] * c[idx]).reshape(x.shape)


#: The real cache types reproduced by ggml's reference quantizers (each function is named
#: after its type's row), and every real kind a spec may name: those and the f16 cache the
#: hook writes into (cachetypes.DEFAULT), which needs no round trip.
REFERENCE = {f.__name__: f for f in (q8_0, q4_0)}
REAL_KINDS = (cachetypes.DEFAULT, *REFERENCE)


def _code(spec: Spec, x: np.ndarray, head: int) -> np.ndarray:
    if spec.kind in REFERENCE:
        return REFERENCE[spec.kind](x)
    return lloyd_max(x, spec.bits, lm_group(spec, head))


# ----------------------------------------------------------------- one layer's rows


@dataclass
class Calib:
    """Per layer, per head: the mean row and the per-channel RMS, unrotated (from
    `hook.Recorder` over a calibration text not scored)."""

    mean: np.ndarray  # [heads, head]
    rms: np.ndarray  # [heads, head]


def apply(spec: Spec, x: np.ndarray, is_k: bool, calib: Calib | None = None) -> np.ndarray:
    """Round trip of rows x [tokens, heads, head] (float32) as the spec stores them."""
    if spec.kind == cachetypes.DEFAULT:
        return x
    t, heads, head = x.shape
    y = x.astype(np.float32)
    if spec.center:
        if calib is None:
            raise ValueError(f"{spec.text}: centering needs calibration")
        y = y - calib.mean[None]
    if spec.kind == "split":
        out = _split(spec, y, calib)
    else:
        group = k_group(head) if is_k else 64
        rot = spec.rotate and head % 64 == 0
        r = rotate(y.reshape(t * heads, head), group, spec.signs) if rot else y.reshape(t * heads, head)
        r = _code(spec, r.astype(np.float32), head)
        out = (rotate(r, group, spec.signs, inverse=True) if rot else r).reshape(t, heads, head)
    if spec.center:
        out = out + calib.mean[None]
    return out.astype(np.float32)


def _split(spec: Spec, y: np.ndarray, calib: Calib | None) -> np.ndarray:
    """Outlier channels (largest calibrated RMS) at bits+1, the rest at bits, per head."""
    if calib is None:
        raise ValueError(f"{spec.text}: the outlier split needs calibration")
    t, heads, head = y.shape
    out = np.empty_like(y)
    for h in range(heads):
        order = np.argsort(-calib.rms[h], kind="stable")
        for idx, bits in ((order[:spec.n_out], spec.bits + 1), (order[spec.n_out:], spec.bits)):
            n = len(idx)
            if n == 0:
                continue
            q = orthogonal(n)
            part = y[:, h, idx].astype(np.float64) @ q.T
            coded = lloyd_max(part.astype(np.float32), bits, n).astype(np.float64)
            out[:, h, idx] = coded @ q
    return out
