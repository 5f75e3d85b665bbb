"""TurboQuant-mse KV-cache types (turbo2 / turbo3 / turbo4): codebooks and a numpy reference.

The native types live in the turboquant flavor of llama.cpp (native/turboquant/). This module
is their specification: it does to a block everything the C code does, with the same
floating-point operations in the same order, so the bytes of a quantized block and the floats
of its reconstruction are bit-for-bit those of the C path (tests/test_turboquant_native.py
checks it through the generated bindings), and experiments on codebooks, norms or signs can be
tried here first. It also generates the C tables (`emit_c_tables`). numpy only; no model.

A block is 128 values of mainline's Hadamard-rotated K or V: an fp16 gain and one index per
value into the Lloyd-Max codebook of N(0, 1/128). The block layout, the quantization rules
(NaN blocks, ties, saturation), the gain choices (`NORM_MODE`, `compare_norm_modes`), the
random-sign measurements (`compare_rotations`, `sign_flip_experiment`) and the packing of the
indices are in docs/KV-RESEARCH.md, "The turbo block format".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import cachetypes

QK = 128  # values per block = the rotation group the codebook is computed for
DIM = 128  # the codebooks are for N(0, 1/DIM)
FP16_MAX = 65504.0
NORM_MODE = "lsq"
NORM_MODES = ("plain", "preserve", "lsq")


@dataclass(frozen=True)
class TurboType:
    name: str
    bits: int
    type_size: int  # bytes per block of QK values

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.type_size / QK


#: The turboquant build's rows of the cache-type table: b index bits per value and an fp16
#: scale per block of QK (turbo2 2, turbo3 3, turbo4 4: the floor of the row's bits per value).
TYPES: dict[str, TurboType] = {
    r.name: TurboType(r.name, int(r.bits), 2 + QK * int(r.bits) // 8)
    for r in sorted(cachetypes.ROWS, key=lambda r: r.bits) if r.build == "turboquant" and r.block == QK
}


def get_type(t: str | TurboType) -> TurboType:
    if isinstance(t, TurboType):
        return t
    try:
        return TYPES[t]
    except KeyError:
        raise ValueError(f"unknown turbo type {t!r}; known: {sorted(TYPES)}") from None


# --------------------------------------------------------------------- codebooks

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _tail(x: float) -> float:
    """P(X > x) for X ~ N(0, 1), accurate in the upper tail."""
    return 0.0 if x == math.inf else 0.5 * math.erfc(x / _SQRT2)


def _cell_stats(a: float, b: float) -> tuple[float, float, float]:
    """(probability, conditional mean, E[X^2 ; cell]) of N(0, 1) on (a, b], 0 <= a < b."""
    p = _tail(a) - _tail(b)
    m1 = _pdf(a) - _pdf(b)  # E[X ; a < X <= b]
    # E[X^2 ; cell] = p + a*pdf(a) - b*pdf(b)
    m2 = p + (a * _pdf(a) if a != 0.0 else 0.0) - (b * _pdf(b) if not math.isinf(b) else 0.0)
    return p, m1 / p, m2


@functools.lru_cache(maxsize=None)
def lloyd_max_standard(bits: int, tol: float = 1e-15, max_iter: int = 200_000) -> tuple[float, ...]:
    """The symmetric Lloyd-Max quantizer of N(0, 1) with 2**bits levels, ascending.

    Our own fixed-point iteration on the positive half (0 is a decision boundary, so the
    levels come out exactly symmetric): boundaries are midpoints of adjacent levels, levels
    are the conditional means of their cells. Stops when no level moves by more than tol.
    """
    if bits < 1:
        raise ValueError("bits must be >= 1")
    half = 1 << (bits - 1)
    # Start from the quantiles' centres of a uniform split of the positive half.
    pos = [math.sqrt(2.0) * _erfinv_approx((i + 0.5) / half) for i in range(half)]
    for _ in range(max_iter):
        edges = [0.0] + [(pos[i] + pos[i + 1]) / 2 for i in range(half - 1)] + [math.inf]
        new = [_cell_stats(edges[i], edges[i + 1])[1] for i in range(half)]
        delta = max(abs(n - o) for n, o in zip(new, pos))
        pos = new
        if delta <= tol:
            break
    else:  # pragma: no cover - the iteration converges in a few thousand steps
        raise RuntimeError(f"Lloyd-Max iteration for {bits} bits did not converge")
    return tuple([-v for v in reversed(pos)] + pos)


def _erfinv_approx(y: float) -> float:
    """A rough erf^-1 for starting points only (bisection on math.erf)."""
    lo, hi = 0.0, 6.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.erf(mid) < y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def standard_mse(bits: int) -> float:
    """Theoretical MSE of the Lloyd-Max quantizer on N(0, 1): 1 - sum_i p_i c_i^2."""
    levels = lloyd_max_standard(bits)
    half = len(levels) // 2
    pos = levels[half:]
    edges = [0.0] + [(pos[i] + pos[i + 1]) / 2 for i in range(half - 1)] + [math.inf]
    total = 0.0
    for i in range(half):
        p, mean, m2 = _cell_stats(edges[i], edges[i + 1])
        total += m2 - 2 * pos[i] * mean * p + pos[i] ** 2 * p
    return 2 * total


def codebook(t: str | TurboType, dim: int = DIM) -> np.ndarray:
    """Lloyd-Max levels for N(0, 1/dim), float64, ascending."""
    return np.asarray(lloyd_max_standard(get_type(t).bits), dtype=np.float64) / math.sqrt(dim)


def codebook_f32(t: str | TurboType) -> np.ndarray:
    """The levels as the C code holds them (float32)."""
    return codebook(t).astype(np.float32)


def boundaries_f32(t: str | TurboType) -> np.ndarray:
    """Decision boundaries: midpoints of adjacent float32 levels, rounded to float32."""
    c = codebook_f32(t).astype(np.float64)
    return ((c[:-1] + c[1:]) / 2).astype(np.float32)


def theoretical_mse(t: str | TurboType) -> float:
    """Expected ||x - x_hat||^2 / ||x||^2 for a vector whose coordinates look N(0, 1/128)."""
    return standard_mse(get_type(t).bits)


# --------------------------------------------------------------------- packing


def pack_indices(idx: np.ndarray, t: str | TurboType) -> np.ndarray:
    """[nb, 128] indices -> [nb, type_size - 2] bytes in the layout described above."""
    tt = get_type(t)
    idx = np.asarray(idx, dtype=np.uint8).reshape(-1, QK)
    if idx.size and int(idx.max()) >= tt.levels:
        raise ValueError(f"index out of range for {tt.name}")
    nb = idx.shape[0]
    if tt.bits == 2:
        g = idx.reshape(nb, 4, 32)
        return (g[:, 0] | (g[:, 1] << 2) | (g[:, 2] << 4) | (g[:, 3] << 6)).astype(np.uint8)
    if tt.bits == 3:
        lo = (idx & 3).reshape(nb, 4, 32)
        qs = lo[:, 0] | (lo[:, 1] << 2) | (lo[:, 2] << 4) | (lo[:, 3] << 6)
        hi = (idx >> 2).reshape(nb, 8, 16)
        qh = np.zeros((nb, 16), dtype=np.uint8)
        for k in range(8):
            qh |= hi[:, k] << k
        return np.concatenate([qs.astype(np.uint8), qh], axis=1)
    if tt.bits == 4:
        g = idx.reshape(nb, 2, 64)
        return (g[:, 0] | (g[:, 1] << 4)).astype(np.uint8)
    raise AssertionError(tt)


def unpack_indices(packed: np.ndarray, t: str | TurboType) -> np.ndarray:
    """[nb, type_size - 2] bytes -> [nb, 128] indices (uint8)."""
    tt = get_type(t)
    p = np.asarray(packed, dtype=np.uint8).reshape(-1, tt.type_size - 2)
    nb = p.shape[0]
    if tt.bits == 2:
        return np.concatenate([(p >> (2 * k)) & 3 for k in range(4)], axis=1).reshape(nb, QK)
    if tt.bits == 3:
        qs, qh = p[:, :32], p[:, 32:48]
        lo = np.concatenate([(qs >> (2 * k)) & 3 for k in range(4)], axis=1)
        hi = np.concatenate([(qh >> k) & 1 for k in range(8)], axis=1)
        return (lo | (hi << 2)).astype(np.uint8)
    if tt.bits == 4:
        return np.concatenate([p & 15, p >> 4], axis=1).astype(np.uint8)
    raise AssertionError(tt)


# --------------------------------------------------------------------- quantize / dequantize

_F16_NAN = np.array([0x7E00], dtype=np.uint16).view(np.float16)[0]


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.size % QK:
        raise ValueError(f"the number of values ({x.size}) must be a multiple of {QK}")
    return x.reshape(-1, QK)


def choose_indices(u: np.ndarray, t: str | TurboType) -> np.ndarray:
    """Index of the nearest level for each float32 u: the number of boundaries strictly below
    u, so a value exactly on a boundary gets the lower level. NaN gets 0."""
    u = np.asarray(u, dtype=np.float32)
    idx = np.zeros(u.shape, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        for bi in boundaries_f32(t):
            idx += (u > bi)
    return idx


def quantize_blocks(x: np.ndarray, t: str | TurboType, norm_mode: str = NORM_MODE
                    ) -> tuple[np.ndarray, np.ndarray]:
    """float32 values -> (d as float16 [nb], indices uint8 [nb, 128]). See the module doc."""
    tt = get_type(t)
    if norm_mode not in NORM_MODES:
        raise ValueError(f"norm_mode must be one of {NORM_MODES}")
    xb = _blocks(x)
    nb = xb.shape[0]
    x64 = xb.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.cumsum(x64 * x64, axis=1)[:, -1] if nb else np.zeros(0)  # sequential, as in C
    bad = ~np.isfinite(s)
    s = np.where(bad, 0.0, s)
    n = np.sqrt(s)
    inv = np.where(n > 0, 1.0 / np.where(n > 0, n, 1.0), 0.0)  # double
    with np.errstate(invalid="ignore"):
        u = (x64 * inv[:, None]).astype(np.float32)  # double multiply, rounded once to float32
    idx = choose_indices(u, tt)
    with np.errstate(over="ignore"):
        n32 = np.minimum(n.astype(np.float32), np.float32(FP16_MAX))
    if norm_mode == "plain":
        dval = n32
    else:
        c64 = codebook_f32(tt).astype(np.float64)[idx]
        cc = np.cumsum(c64 * c64, axis=1)[:, -1]
        if norm_mode == "preserve":
            g = np.sqrt(cc)
            dval = np.where(g > 0, n / np.where(g > 0, g, 1.0), 0.0)
        else:  # lsq: <x, c> / <c, c> in the units of x
            # + 0.0: C starts its sum from +0.0, so an all-(-0.0) sum is +0.0 there too
            xc = np.cumsum(u.astype(np.float64) * c64, axis=1)[:, -1] + 0.0
            dval = np.where(cc > 0, n * xc / np.where(cc > 0, cc, 1.0), 0.0)
        with np.errstate(over="ignore"):
            dval = np.minimum(dval.astype(np.float32), np.float32(FP16_MAX))
    with np.errstate(over="ignore"):
        d = dval.astype(np.float16)
    d[bad] = _F16_NAN
    idx[bad] = 0
    return d, idx


def quantize(x: np.ndarray, t: str | TurboType, norm_mode: str = NORM_MODE) -> np.ndarray:
    """float32 values (a multiple of 128) -> the packed bytes, exactly as ggml_quantize_chunk."""
    tt = get_type(t)
    d, idx = quantize_blocks(x, tt, norm_mode)
    head = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return np.concatenate([head, pack_indices(idx, tt)], axis=1).reshape(-1)


def split_blocks(data: np.ndarray | bytes, t: str | TurboType) -> tuple[np.ndarray, np.ndarray]:
    """Packed bytes -> (d float16 [nb], indices [nb, 128])."""
    tt = get_type(t)
    raw = np.frombuffer(bytes(data), dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
        else np.asarray(data, dtype=np.uint8).reshape(-1)
    if raw.size % tt.type_size:
        raise ValueError(f"{raw.size} bytes is not a whole number of {tt.name} blocks")
    blocks = raw.reshape(-1, tt.type_size)
    d = np.ascontiguousarray(blocks[:, :2]).view("<f2").reshape(-1)
    return d, unpack_indices(blocks[:, 2:], tt)


def dequantize(data: np.ndarray | bytes, t: str | TurboType) -> np.ndarray:
    """Packed bytes -> float32 values: fp32(d) * c[idx], exactly as the C to_float."""
    tt = get_type(t)
    d, idx = split_blocks(data, tt)
    c = codebook_f32(tt)
    return (d.astype(np.float32)[:, None] * c[idx]).reshape(-1)


def vec_dot(data: np.ndarray | bytes, q: np.ndarray, t: str | TurboType) -> float:
    """Reference of the C vec_dot (float64): sum_b d_b * sum_j c[idx_bj] * q_bj."""
    tt = get_type(t)
    d, idx = split_blocks(data, tt)
    c = codebook_f32(tt).astype(np.float64)
    qb = np.asarray(q, dtype=np.float32).astype(np.float64).reshape(-1, QK)
    return float(np.sum(d.astype(np.float64) * np.sum(c[idx] * qb, axis=1)))


def round_trip(x: np.ndarray, t: str | TurboType, norm_mode: str = NORM_MODE) -> np.ndarray:
    return dequantize(quantize(x, t, norm_mode), t)


# --------------------------------------------------------------------- measurements


def relative_mse(x: np.ndarray, t: str | TurboType, norm_mode: str = NORM_MODE) -> float:
    """Mean over blocks of ||x - x_hat||^2 / ||x||^2."""
    xb = _blocks(x).astype(np.float64)
    y = round_trip(x, t, norm_mode).reshape(-1, QK).astype(np.float64)
    num = np.sum((xb - y) ** 2, axis=1)
    den = np.sum(xb * xb, axis=1)
    keep = den > 0
    return float(np.mean(num[keep] / den[keep]))


def random_rotated(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors uniform on the sphere of R^128 (what a rotation makes of any vector)."""
    g = rng.standard_normal((n_blocks, QK))
    return (g / np.linalg.norm(g, axis=1, keepdims=True)).astype(np.float32)


def empirical_mse(t: str | TurboType, n_blocks: int = 20_000, seed: int = 0,
                  norm_mode: str = NORM_MODE) -> float:
    return relative_mse(random_rotated(n_blocks, np.random.default_rng(seed)), t, norm_mode)


def compare_norm_modes(n_blocks: int = 20_000, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per type and norm mode: relative MSE, and the mean and spread of the relative error of
    inner products <x_hat, q> / <x, q> - 1 against random queries."""
    rng = np.random.default_rng(seed)
    x = random_rotated(n_blocks, rng)
    q = rng.standard_normal((n_blocks, QK)).astype(np.float32)
    ref = np.sum(x.astype(np.float64) * q, axis=1)
    out: dict[str, dict[str, float]] = {}
    for name in TYPES:
        for mode in NORM_MODES:
            y = round_trip(x, name, mode).reshape(-1, QK).astype(np.float64)
            err = np.sum(y * q, axis=1) - ref
            out[f"{name}/{mode}"] = {
                "mse": float(np.mean(np.sum((x - y) ** 2, axis=1))),
                "dot_bias": float(np.mean(err) / np.mean(np.abs(ref))),
                "dot_rmse": float(np.sqrt(np.mean(err ** 2)) / np.sqrt(np.mean(ref ** 2))),
                "length_ratio": float(np.mean(np.linalg.norm(y, axis=1))),
            }
    return out


# --------------------------------------------------------------------- rotation experiments


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix (n a power of two), as mainline's rotation."""
    if n < 1 or n & (n - 1):
        raise ValueError("n must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def rotate(x: np.ndarray, group: int, signs: np.ndarray | None = None) -> np.ndarray:
    """Rotate each row of x (width a multiple of group) by blocks: x -> H (D x) per group,
    D = diag(signs) if given. Mainline llama.cpp rotates K (and Q) with one group as wide as
    the largest power of two dividing the head size, and V with groups of 64."""
    x = np.asarray(x, dtype=np.float64)
    if signs is not None:
        x = x * signs
    h = hadamard(group)
    return (x.reshape(x.shape[0], -1, group) @ h.T).reshape(x.shape)


def synthetic_kv(kind: str, n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """K/V-like rows of width dim. Kinds: gaussian (isotropic); outliers (a few channels 20x
    larger, as in real K caches); offset (a large constant on every channel: maps to ONE
    Hadamard coordinate); mean (a large per-channel mean of random sign); lowrank (rank 8
    plus noise plus outlier channels); hadamard_sparse (sums of 2 Hadamard rows: the
    adversarial case of a fixed Hadamard rotation)."""
    g = rng.standard_normal((n, dim))
    if kind == "gaussian":
        return g
    if kind == "outliers":
        s = np.ones(dim)
        s[rng.choice(dim, 4, replace=False)] = 20.0
        return g * s
    if kind == "offset":
        return g + 4.0
    if kind == "mean":
        return g + 4.0 * rng.choice([-1.0, 1.0], dim)
    if kind == "lowrank":
        a = rng.standard_normal((8, dim))
        s = np.ones(dim)
        s[rng.choice(dim, 4, replace=False)] = 10.0
        return (rng.standard_normal((n, 8)) @ a + 0.3 * g) * s
    if kind == "hadamard_sparse":
        h = hadamard(dim) * math.sqrt(dim)
        rows = rng.integers(0, dim, (n, 2))
        return h[rows[:, 0]] + 0.5 * h[rows[:, 1]] + 0.05 * g
    raise ValueError(kind)


def compare_rotations(x: np.ndarray, group: int, signs: np.ndarray | None = None,
                      types: tuple[str, ...] = tuple(TYPES)) -> dict[str, float]:
    """Relative squared error (sum over rows, / sum ||x||^2) of each turbo type on rows x
    (e.g. K or V rows captured from a model, unrotated) with no rotation, mainline's
    Hadamard rotation by groups, and the Hadamard after the sign flip `signs` (random if
    None). Keys: type/rotation."""
    x = np.asarray(x, dtype=np.float64)
    if signs is None:
        signs = np.random.default_rng(0).choice([-1.0, 1.0], x.shape[1])
    den = float(np.sum(x * x))
    variants = {"none": x, "hadamard": rotate(x, group), "signs+hadamard": rotate(x, group, signs)}
    out = {}
    for name in types:
        for rot, xr in variants.items():
            y = round_trip(xr.astype(np.float32).reshape(-1), name).reshape(xr.shape)
            out[f"{name}/{rot}"] = float(np.sum((xr - y) ** 2) / den)
    return out


def sign_flip_experiment(n: int = 3000, dim: int = 256, seed: int = 0,
                         kinds: tuple[str, ...] = ("gaussian", "outliers", "offset", "mean",
                                                   "lowrank", "hadamard_sparse"),
                         groups: tuple[int, ...] = (256, 64)) -> dict[str, float]:
    """Relative MSE (over all rows) of turbo2/3/4 after: no rotation, mainline's Hadamard, and
    Hadamard after a fixed random +-1 sign flip. Keys: kind/group/type/rotation."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], dim)
    out: dict[str, float] = {}
    for kind in kinds:
        x = synthetic_kv(kind, n, dim, rng)
        for group in groups:
            for key, val in compare_rotations(x, group, signs).items():
                out[f"{kind}/{group}/{key}"] = val
    return out


# --------------------------------------------------------------------- C tables

C_TABLES_FILE = "ggml-turbo-tables.h"


def _c_float(v: np.float32) -> str:
    text = f"{float(v):.9e}f"
    assert np.float32(float(text[:-1])) == v  # 9 significant digits round-trip a float32
    return text


def emit_c_tables() -> str:
    """The text of native/turboquant/ggml-turbo-tables.h (levels and boundaries as float32)."""
    lines = [
        "// Generated by clickpaca/llama/turboquant.py (emit_c_tables). Do not edit by hand:",
        "// regenerate with `python -m clickpaca.llama.turboquant --c-tables > native/turboquant/"
        + C_TABLES_FILE + "`.",
        f"// Lloyd-Max levels for N(0, 1/{DIM}) (ascending, symmetric) and the decision",
        "// boundaries between them (midpoints of adjacent float32 levels, as float32).",
        "#pragma once",
        "",
    ]
    for name, tt in TYPES.items():
        c = codebook_f32(tt)
        b = boundaries_f32(tt)
        mse = theoretical_mse(tt)
        lines.append(f"// {name}: {tt.bits} bits, {tt.levels} levels, {tt.type_size} bytes per {QK} values; "
                     f"MSE on N(0,1) = {mse:.6g}")
        lines.append(f"static const float ggml_{name}_levels[{tt.levels}] = {{")
        for i in range(0, tt.levels, 4):
            lines.append("    " + ", ".join(_c_float(v) for v in c[i:i + 4]) + ",")
        lines.append("};")
        lines.append(f"static const float ggml_{name}_bounds[{tt.levels - 1}] = {{")
        for i in range(0, tt.levels - 1, 4):
            lines.append("    " + ", ".join(_c_float(v) for v in b[i:i + 4]) + ",")
        lines.append("};")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="TurboQuant codebooks and reference measurements")
    ap.add_argument("--c-tables", action="store_true", help="print the C header of the tables")
    ap.add_argument("--norm-modes", action="store_true", help="compare the norm modes (MSE, dot error)")
    ap.add_argument("--sign-flips", action="store_true", help="measure random signs on top of Hadamard")
    args = ap.parse_args(argv)
    if args.c_tables:
        print(emit_c_tables(), end="")
    elif args.norm_modes:
        print(json.dumps(compare_norm_modes(), indent=2))
    elif args.sign_flips:
        res = sign_flip_experiment()
        keys = sorted({k.rsplit("/", 1)[0] for k in res})
        for k in keys:
            row = "  ".join(f"{rot} {res[k + '/' + rot]:.4f}" for rot in ("none", "hadamard", "signs+hadamard")
                            if k + "/" + rot in res)
            print(f"{k:32s} {row}")
    else:
        for name, tt in TYPES.items():
            print(f"{name}: {tt.bits_per_value:.3f} bits/value, theory MSE {theoretical_mse(tt):.6f}, "
                  f"empirical {empirical_mse(tt):.6f}, levels {np.round(codebook(tt) * math.sqrt(DIM), 4)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
