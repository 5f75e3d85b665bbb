"""The numpy reference of the turbo2/3/4 KV-cache types (clickpaca/llama/turboquant.py). Pure numpy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clickpaca.llama import turboquant as tq

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(tq.TYPES)

# Lloyd-Max levels for N(0, 1) as tabulated by Max (1960), positive half, 4 decimals.
PUBLISHED_LEVELS = {
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3440, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326],
}
PUBLISHED_MSE = {2: 0.1175, 3: 0.03455, 4: 0.009497}

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gauss_cell_mean(a: float, b: float) -> float:
    """Conditional mean of N(0, 1) on (a, b) by brute numerical integration (independent of
    the closed form the module uses)."""
    lo, hi = max(a, -12.0), min(b, 12.0)
    x = np.linspace(lo, hi, 100_001)
    w = np.exp(-0.5 * x * x)
    return float(np.trapezoid(x * w, x) / np.trapezoid(w, x))


# --------------------------------------------------------------------------- codebooks


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_levels_symmetric_sorted(bits):
    c = np.array(tq.lloyd_max_standard(bits))
    assert len(c) == 1 << bits
    assert np.all(np.diff(c) > 0)
    assert np.array_equal(c, -c[::-1])  # exactly symmetric
    c32 = tq.codebook_f32(f"turbo{bits}")
    assert np.array_equal(c32, -c32[::-1])
    b = tq.boundaries_f32(f"turbo{bits}")
    assert b[len(b) // 2] == 0.0 and np.array_equal(b, -b[::-1])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_levels_are_lloyd_max_fixed_point(bits):
    c = np.array(tq.lloyd_max_standard(bits))
    edges = np.concatenate([[-np.inf], (c[:-1] + c[1:]) / 2, [np.inf]])
    means = np.array([_gauss_cell_mean(edges[i], edges[i + 1]) for i in range(len(c))])
    np.testing.assert_allclose(means, c, atol=2e-9)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_levels_match_published_tables(bits):
    c = np.array(tq.lloyd_max_standard(bits))
    np.testing.assert_allclose(c[len(c) // 2:], PUBLISHED_LEVELS[bits], atol=1.5e-4)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_theoretical_mse(bits):
    assert tq.standard_mse(bits) == pytest.approx(PUBLISHED_MSE[bits], rel=2e-3)
    # Lloyd-Max is a local optimum: nudging the levels can only raise the MSE
    c = np.array(tq.lloyd_max_standard(bits))
    rng = np.random.default_rng(bits)
    g = rng.standard_normal(400_000)
    def mse(levels):
        b = (levels[:-1] + levels[1:]) / 2
        return float(np.mean((g - levels[np.searchsorted(b, g)]) ** 2))
    base = mse(c)
    assert base == pytest.approx(tq.standard_mse(bits), rel=0.02)
    for scale in (0.97, 1.03):
        assert mse(c * scale) > base


def test_codebook_scale():
    for name in NAMES:
        c = tq.codebook(name)
        np.testing.assert_allclose(c * math.sqrt(128), tq.lloyd_max_standard(tq.TYPES[name].bits))


# --------------------------------------------------------------------------- MSE


@pytest.mark.parametrize("name", NAMES)
def test_empirical_mse_matches_theory(name):
    theory = tq.theoretical_mse(name)
    plain = tq.empirical_mse(name, n_blocks=8000, norm_mode="plain")
    lsq = tq.empirical_mse(name, n_blocks=8000, norm_mode="lsq")
    # A rotated unit vector's coordinates are slightly lighter-tailed than N(0, 1/128): the
    # measured error is a little below the Gaussian theory, never far from it.
    assert 0.95 * theory < plain < 1.01 * theory
    assert lsq <= plain
    # Gaussian data (not normalised) sees the same numbers.
    g = np.random.default_rng(3).standard_normal((8000, 128)).astype(np.float32) * 0.37
    assert tq.relative_mse(g, name, "plain") == pytest.approx(theory, rel=0.05)


def test_more_bits_less_error():
    m = [tq.empirical_mse(n, n_blocks=4000) for n in ("turbo2", "turbo3", "turbo4")]
    assert m[0] > 3 * m[1] > 9 * m[2]


def test_type_sizes():
    assert {n: t.type_size for n, t in tq.TYPES.items()} == {"turbo2": 34, "turbo3": 50, "turbo4": 66}
    x = np.random.default_rng(0).standard_normal(128 * 5).astype(np.float32)
    for name, t in tq.TYPES.items():
        assert tq.quantize(x, name).nbytes == 5 * t.type_size


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_pack_round_trip(name, data):
    t = tq.TYPES[name]
    nb = data.draw(st.integers(1, 4))
    idx = data.draw(hnp.arrays(np.uint8, (nb, 128), elements=st.integers(0, t.levels - 1)))
    packed = tq.pack_indices(idx, name)
    assert packed.shape == (nb, t.type_size - 2)
    assert np.array_equal(tq.unpack_indices(packed, name), idx)
    raw = data.draw(hnp.arrays(np.uint8, (nb, t.type_size - 2)))
    assert np.array_equal(tq.pack_indices(tq.unpack_indices(raw, name), name), raw)


def test_packing_layout_examples():
    idx = np.zeros((1, 128), np.uint8)
    idx[0, 33] = 3                     # turbo2: byte 1, bits 2-3
    assert tq.pack_indices(idx, "turbo2")[0, 1] == 3 << 2
    idx = np.zeros((1, 128), np.uint8)
    idx[0, 100] = 7                    # turbo3: qs[4] bits 6-7 = 3, qh[4] bit 6
    p = tq.pack_indices(idx, "turbo3")[0]
    assert p[4] == 3 << 6 and p[32 + 4] == 1 << 6 and int(p.astype(int).sum()) == int(p[4]) + int(p[36])
    idx = np.zeros((1, 128), np.uint8)
    idx[0, 70] = 9                     # turbo4: byte 6, high nibble
    assert tq.pack_indices(idx, "turbo4")[0, 6] == 9 << 4


# --------------------------------------------------------------------------- quantize


finite_blocks = hnp.arrays(
    np.float32, st.integers(1, 3).map(lambda n: n * 128),
    elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False))


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=finite_blocks)
def test_round_trip_properties(name, x):
    data = tq.quantize(x, name)
    assert data.dtype == np.uint8 and data.size == x.size // 128 * tq.TYPES[name].type_size
    y = tq.dequantize(data, name)
    assert y.shape == x.shape and np.all(np.isfinite(y))
    xb, yb = x.reshape(-1, 128).astype(np.float64), y.reshape(-1, 128).astype(np.float64)
    nx = np.sum(xb * xb, axis=1)
    err = np.sum((xb - yb) ** 2, axis=1)
    # the least-squares gain never does worse than reconstructing zero (slack: fp16 gain)
    assert np.all(err <= nx * 1.002 + 1e-30)
    # signs are kept wherever the normalised value is not 0 and the gain is not 0
    d, idx = tq.split_blocks(data, name)
    n = np.sqrt(nx)[:, None]
    u = (xb * np.divide(1.0, n, out=np.zeros_like(n), where=n > 0)).astype(np.float32)
    u_nonzero = (u != 0) & (d.astype(np.float32)[:, None] > 0)
    assert np.all(np.sign(yb[u_nonzero]) == np.sign(xb[u_nonzero]))
    # the same bytes again (deterministic)
    assert np.array_equal(tq.quantize(x, name), data)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=finite_blocks, k=st.integers(-8, 8))
def test_power_of_two_scaling(name, x, k):
    """Scaling a block by 2**k leaves the indices alone and scales d exactly (while d stays a
    normal fp16 number)."""
    d0, i0 = tq.quantize_blocks(x, name)
    d1, i1 = tq.quantize_blocks(x * np.float32(2.0 ** k), name)
    ok = (np.abs(d0.astype(np.float64)) * 2.0 ** min(k, 0) >= 2 ** -14) & \
         (np.abs(d0.astype(np.float64)) * 2.0 ** max(k, 0) <= 60000)
    u_ok = np.all(np.abs(x.reshape(-1, 128)) * np.float32(2.0 ** k) > 1e-37, axis=1) | \
        np.all(x.reshape(-1, 128) == 0, axis=1)
    sel = ok & u_ok
    assert np.array_equal(i0[sel], i1[sel])
    assert np.array_equal(d0[sel].astype(np.float64) * 2.0 ** k, d1[sel].astype(np.float64))


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=finite_blocks)
def test_mirror_symmetry(name, x):
    """-x gets the mirrored indices (L-1-idx) wherever x is not 0 and not on a boundary."""
    t = tq.TYPES[name]
    d0, i0 = tq.quantize_blocks(x, name)
    d1, i1 = tq.quantize_blocks(-x, name)
    xb = x.reshape(-1, 128).astype(np.float64)
    n = np.sqrt(np.sum(xb * xb, axis=1, keepdims=True))
    u = np.divide(xb, n, out=np.zeros_like(xb), where=n > 0)
    b = tq.boundaries_f32(name).astype(np.float64)
    near = np.min(np.abs(u[..., None] - b), axis=-1) < 1e-6
    sel = (xb != 0) & ~near
    assert np.array_equal(i1[sel], (t.levels - 1 - i0)[sel])
    assert np.array_equal(d0, d1)


@pytest.mark.parametrize("name", NAMES)
def test_nearest_level_and_ties(name):
    c = tq.codebook_f32(name)
    b = tq.boundaries_f32(name)
    # exactly on a boundary -> the lower level; just above -> the upper one
    assert np.array_equal(tq.choose_indices(b, name), np.arange(len(b)))
    up = np.nextafter(b, np.float32(np.inf))
    assert np.array_equal(tq.choose_indices(up, name), np.arange(1, len(b) + 1))
    assert tq.choose_indices(np.float32(np.nan), name) == 0
    # random values: nearest level
    u = np.random.default_rng(5).standard_normal(100_000).astype(np.float32) * 0.15
    idx = tq.choose_indices(u, name)
    dist = np.abs(u.astype(np.float64)[:, None] - c.astype(np.float64)[None, :])
    best = np.argmin(dist, axis=1)
    tie = np.abs(dist[np.arange(len(u)), idx] - dist[np.arange(len(u)), best]) < 1e-9
    assert np.all((idx == best) | tie)


@pytest.mark.parametrize("name", NAMES)
def test_zero_block(name):
    t = tq.TYPES[name]
    d, idx = tq.quantize_blocks(np.zeros(128, np.float32), name)
    assert d[0] == 0 and np.all(idx == t.levels // 2 - 1)
    assert np.array_equal(tq.round_trip(np.zeros(256, np.float32), name), np.zeros(256, np.float32))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("a", [1.0, -3.5, 1e-3, 700.0])
def test_one_hot(name, a):
    x = np.zeros(128, np.float32)
    x[17] = a
    y = tq.round_trip(x, name)
    assert np.sign(y[17]) == np.sign(a)
    assert np.argmax(np.abs(y)) == 17
    assert np.linalg.norm(x - y) <= abs(a)  # no worse than zero (least-squares gain)


@pytest.mark.parametrize("name", NAMES)
def test_huge_values_saturate(name):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(256) * 1e30).astype(np.float32)
    x[128:] = np.float32(3.0e38)  # the largest floats: the sum of squares must not overflow
    d, idx = tq.quantize_blocks(x, name)
    assert np.all(d.astype(np.float32) == np.float32(65504))
    y = tq.round_trip(x, name)
    assert np.all(np.isfinite(y))
    # the direction is still coded
    d_small, idx_small = tq.quantize_blocks(x * np.float32(1e-30), name)
    assert np.array_equal(idx[0], idx_small[0])


@pytest.mark.parametrize("name", NAMES)
def test_tiny_values(name):
    """Denormal-sized blocks quantize like any other block (the gain underflows to 0)."""
    x = np.random.default_rng(2).standard_normal(128).astype(np.float32)
    tiny = x * np.float32(1e-40)  # denormal floats
    d, idx = tq.quantize_blocks(tiny, name)
    _, idx_ref = tq.quantize_blocks(x, name)
    assert d[0] == 0
    agree = np.mean(idx[0] == idx_ref[0])
    assert agree > 0.9  # denormals lose mantissa bits, so a few indices may move
    assert np.all(tq.round_trip(tiny, name) == 0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block(name, bad):
    x = np.random.default_rng(4).standard_normal(384).astype(np.float32)
    x[130] = bad
    d, idx = tq.quantize_blocks(x, name)
    assert np.isnan(d[1]) and d.view(np.uint16)[1] == 0x7E00
    assert np.all(idx[1] == 0)
    y = tq.round_trip(x, name)
    assert np.all(np.isnan(y[128:256]))
    assert np.all(np.isfinite(y[:128])) and np.all(np.isfinite(y[256:]))
    # the good blocks are exactly what they would be alone
    assert np.array_equal(tq.quantize(x[:128], name), tq.quantize(x, name)[:tq.TYPES[name].type_size])


def test_rejects_bad_length_and_type():
    with pytest.raises(ValueError):
        tq.quantize(np.zeros(100, np.float32), "turbo3")
    with pytest.raises(ValueError):
        tq.quantize(np.zeros(128, np.float32), "turbo5")


@pytest.mark.parametrize("name", NAMES)
def test_vec_dot_reference(name):
    rng = np.random.default_rng(6)
    x = rng.standard_normal(128 * 6).astype(np.float32)
    q = rng.standard_normal(128 * 6).astype(np.float32)
    data = tq.quantize(x, name)
    y = tq.dequantize(data, name).astype(np.float64)
    assert tq.vec_dot(data, q, name) == pytest.approx(float(np.dot(y, q)), rel=1e-5)


def test_norm_modes():
    r = tq.compare_norm_modes(n_blocks=4000)
    for name in NAMES:
        assert r[f"{name}/lsq"]["mse"] <= r[f"{name}/plain"]["mse"]
        assert r[f"{name}/preserve"]["length_ratio"] == pytest.approx(1.0, abs=1e-3)
    x = tq.random_rotated(100, np.random.default_rng(0))
    for mode in tq.NORM_MODES:
        y = tq.round_trip(x, "turbo3", mode)
        assert np.all(np.isfinite(y))


# --------------------------------------------------------------------------- C tables


def test_c_tables_match_native_tree():
    carried = (ROOT / "native" / "turboquant" / tq.C_TABLES_FILE).read_text()
    assert carried == tq.emit_c_tables(), (
        "native/turboquant/ggml-turbo-tables.h is stale: regenerate it with "
        "`python -m clickpaca.llama.turboquant --c-tables > native/turboquant/ggml-turbo-tables.h`")


def test_c_table_literals_round_trip():
    import re
    text = tq.emit_c_tables()
    for name in NAMES:
        for kind, ref in (("levels", tq.codebook_f32(name)), ("bounds", tq.boundaries_f32(name))):
            m = re.search(rf"ggml_{name}_{kind}\[\d+\] = \{{(.*?)\}};", text, re.S)
            vals = np.array([float(v.strip().rstrip("f")) for v in m.group(1).split(",") if v.strip()],
                            dtype=np.float32)
            assert np.array_equal(vals.view(np.uint32), ref.view(np.uint32))


# --------------------------------------------------------------------------- rotations


def test_hadamard_orthonormal():
    for n in (64, 128, 256):
        h = tq.hadamard(n)
        np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-12)
    x = np.random.default_rng(7).standard_normal((5, 256))
    np.testing.assert_allclose(np.linalg.norm(tq.rotate(x, 64), axis=1), np.linalg.norm(x, axis=1))


def test_sign_flips_matter_only_for_hadamard_aligned_structure():
    rng = np.random.default_rng(8)
    signs = rng.choice([-1.0, 1.0], 256)
    r = tq.compare_rotations(tq.synthetic_kv("offset", 300, 256, rng), 256, signs, types=("turbo3",))
    assert r["turbo3/hadamard"] > 5 * r["turbo3/signs+hadamard"]  # DC lands on one coordinate
    r = tq.compare_rotations(tq.synthetic_kv("outliers", 300, 256, rng), 256, signs, types=("turbo3",))
    assert r["turbo3/none"] > 5 * r["turbo3/hadamard"]  # the rotation spreads outlier channels
    assert r["turbo3/signs+hadamard"] == pytest.approx(r["turbo3/hadamard"], rel=0.05)
