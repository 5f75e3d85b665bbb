"""The turbo2/3/4 C path of builds/turboquant against the numpy reference (clickpaca/llama/turboquant.py).

Goes through the generated bindings (clickpaca.llama.native.load("turboquant")): quantization
through ggml_quantize_chunk and the type traits must give the reference's bytes exactly,
to_float the reference's floats exactly, and the CPU vec_dot the reference dot product
within float rounding. Skipped only when builds/turboquant does not exist.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clickpaca.llama import native
from clickpaca.llama import turboquant as tq

pytestmark = pytest.mark.turboquant

if not (native.build_dir("turboquant") / "build-info.json").exists():
    pytest.skip("builds/turboquant does not exist: build it with `make turboquant` "
                "(python3 native/build.py turboquant)", allow_module_level=True)

NAMES = sorted(tq.TYPES)
# The library reads GGML_TURBO_NORM once per process; compare against the same mode.
MODE = os.environ.get("GGML_TURBO_NORM", "lsq")
MODE = MODE if MODE in tq.NORM_MODES else "lsq"
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def nat():
    return native.load("turboquant")


def type_id(nat, name: str) -> int:
    return getattr(nat.lib, f"GGML_TYPE_{name.upper()}")


def c_quantize(nat, name: str, x: np.ndarray, n_per_row: int | None = None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = n_per_row or x.size
    nrows = x.size // n_per_row
    out = np.zeros(x.size // tq.QK * tq.TYPES[name].type_size, np.uint8)
    ffi, lib = nat.ffi, nat.lib
    written = lib.ggml_quantize_chunk(type_id(nat, name), ffi.from_buffer("float[]", x),
                                      ffi.from_buffer(out), 0, nrows, n_per_row, ffi.NULL)
    assert written == out.nbytes
    return out


def c_to_float(nat, name: str, data: np.ndarray) -> np.ndarray:
    n = data.size // tq.TYPES[name].type_size * tq.QK
    y = np.zeros(n, np.float32)
    tr = nat.lib.ggml_get_type_traits(type_id(nat, name))
    tr.to_float(nat.ffi.from_buffer(data), nat.ffi.from_buffer("float[]", y), n)
    return y


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, except that any NaN equals any NaN."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


def adversarial(rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = 128 * 4
    cases = {
        "gaussian": rng.standard_normal(n).astype(np.float32),
        "zeros": np.zeros(n, np.float32),
        "tiny": (rng.standard_normal(n) * 1e-40).astype(np.float32),
        "huge": (rng.standard_normal(n) * 1e30).astype(np.float32),
        "max": np.full(n, 3.0e38, np.float32),
        "heavy": rng.standard_t(1.5, n).astype(np.float32),
        "small_ints": rng.integers(-3, 4, n).astype(np.float32),
    }
    one_hot = np.zeros(n, np.float32)
    one_hot[[3, 130, 300, 511]] = [1.0, -2.0, 1e-3, 5e4]
    cases["one_hot"] = one_hot
    bad = rng.standard_normal(n).astype(np.float32)
    bad[5], bad[200], bad[400] = np.nan, np.inf, -np.inf
    cases["non_finite"] = bad
    # sparse and constant blocks: many equal values, exact norms (3-4-5), u exactly 0
    sparse = np.zeros(128, np.float32)
    sparse[:2] = [3.0, 4.0]
    cases["sparse"] = np.concatenate([sparse, sparse * 0.5, -sparse, np.ones(128, np.float32)])
    return cases


def test_types_registered(nat):
    lib, ffi = nat.lib, nat.ffi
    assert (lib.GGML_TYPE_TURBO2, lib.GGML_TYPE_TURBO3, lib.GGML_TYPE_TURBO4) == (43, 44, 45)
    assert lib.GGML_TYPE_COUNT == 46
    for name, t in tq.TYPES.items():
        tid = type_id(nat, name)
        assert ffi.string(lib.ggml_type_name(tid)).decode() == name
        assert lib.ggml_blck_size(tid) == tq.QK
        assert lib.ggml_type_size(tid) == t.type_size
        assert lib.ggml_is_quantized(tid)
        assert lib.ggml_row_size(tid, 256) == 2 * t.type_size
        cpu = lib.ggml_get_type_traits_cpu(tid)
        assert cpu.vec_dot_type == lib.GGML_TYPE_F32
        assert cpu.from_float != ffi.NULL and cpu.vec_dot != ffi.NULL


@pytest.mark.parametrize("name", NAMES)
def test_quantize_bit_exact_adversarial(nat, name):
    for label, x in adversarial(np.random.default_rng(11)).items():
        c = c_quantize(nat, name, x)
        ref = tq.quantize(x, name, MODE)
        assert np.array_equal(c, ref), f"{name} {label}: C bytes differ from the numpy reference"
        assert same_floats(c_to_float(nat, name, c), tq.dequantize(ref, name)), f"{name} {label}: to_float"


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 4).map(lambda n: n * 128),
                    elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_quantize_bit_exact_any_floats(nat, name, x):
    c = c_quantize(nat, name, x)
    assert np.array_equal(c, tq.quantize(x, name, MODE))
    assert same_floats(c_to_float(nat, name, c), tq.dequantize(c, name))


@pytest.mark.parametrize("name", NAMES)
def test_rows_and_traits_agree(nat, name):
    """Several rows through ggml_quantize_chunk, the reference from_float_ref and the CPU
    from_float all give the same bytes."""
    ffi, lib = nat.ffi, nat.lib
    x = np.random.default_rng(12).standard_normal(256 * 6).astype(np.float32) * 3
    rows = c_quantize(nat, name, x, n_per_row=256)
    assert np.array_equal(rows, tq.quantize(x, name, MODE))
    tid = type_id(nat, name)
    for fn in (lib.ggml_get_type_traits(tid).from_float_ref, lib.ggml_get_type_traits_cpu(tid).from_float):
        out = np.zeros_like(rows)
        fn(ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size)
        assert np.array_equal(out, rows)


@pytest.mark.parametrize("name", NAMES)
def test_vec_dot_matches_reference(nat, name):
    ffi, lib = nat.ffi, nat.lib
    vec_dot = lib.ggml_get_type_traits_cpu(type_id(nat, name)).vec_dot
    rng = np.random.default_rng(13)
    s = ffi.new("float *")
    for nblocks in (1, 2, 3, 8):
        for scale in (1.0, 1e-3, 1e3):
            x = (rng.standard_normal(128 * nblocks) * scale).astype(np.float32)
            q = rng.standard_normal(128 * nblocks).astype(np.float32)
            data = tq.quantize(x, name, MODE)
            vec_dot(x.size, s, 0, ffi.from_buffer(data), 0, ffi.from_buffer("float[]", q), 0, 1)
            ref = tq.vec_dot(data, q, name)
            mag = float(np.sum(np.abs(tq.dequantize(data, name).astype(np.float64) * q)))
            assert abs(s[0] - ref) <= 1e-5 * mag + 1e-30, (name, nblocks, scale, s[0], ref)


def test_cache_type_names_parse(nat):
    """The tools accept the names: ggml_type_name round trips through the type table."""
    names = {nat.ffi.string(nat.lib.ggml_type_name(t)).decode() for t in range(nat.lib.GGML_TYPE_COUNT)
             if nat.lib.ggml_get_type_traits(t).blck_size > 0}
    assert {"turbo2", "turbo3", "turbo4"} <= names


def _flash_attn(nat, name: str, qx: np.ndarray, kb: np.ndarray, vb: np.ndarray, nkv: int) -> np.ndarray:
    ffi, lib = nat.ffi, nat.lib
    dk, nq = qx.shape[1], qx.shape[0]
    p = ffi.new("struct ggml_init_params *")
    p.mem_size, p.mem_buffer, p.no_alloc = 32 << 20, ffi.NULL, False
    ctx = lib.ggml_init(p[0])
    try:
        t = type_id(nat, name)
        q = lib.ggml_new_tensor_3d(ctx, lib.GGML_TYPE_F32, dk, nq, 1)
        k = lib.ggml_new_tensor_3d(ctx, t, dk, nkv, 1)
        v = lib.ggml_new_tensor_3d(ctx, t, dk, nkv, 1)
        for tensor, arr in ((q, qx), (k, kb), (v, vb)):
            ffi.memmove(tensor.data, np.ascontiguousarray(arr).tobytes(), arr.nbytes)
        out = lib.ggml_flash_attn_ext(ctx, q, k, v, ffi.NULL, 1.0 / 16, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
        gf = lib.ggml_new_graph(ctx)
        lib.ggml_build_forward_expand(gf, out)
        lib.ggml_graph_compute_with_ctx(ctx, gf, 2)
        return np.frombuffer(ffi.buffer(ffi.cast("float *", out.data), dk * nq * 4), np.float32).reshape(nq, dk).copy()
    finally:
        lib.ggml_free(ctx)


@pytest.mark.parametrize("name", NAMES)
def test_flash_attention_cpu(nat, name):
    """ggml_flash_attn_ext on CPU with turbo K and V equals softmax(q k_hat^T / 16) v_hat from
    the reference dequantization, on both CPU paths: 64 queries take the tiled (GEMM) path
    the patch set enables, single queries the per-row path (vec_dot + to_float)."""
    rng = np.random.default_rng(14)
    dk, nkv = 256, 96
    kb = tq.quantize(rng.standard_normal((nkv, dk)).astype(np.float32), name, MODE)
    vb = tq.quantize(rng.standard_normal((nkv, dk)).astype(np.float32), name, MODE)
    qx = rng.standard_normal((64, dk)).astype(np.float32)
    kh = tq.dequantize(kb, name).reshape(nkv, dk).astype(np.float64)
    vh = tq.dequantize(vb, name).reshape(nkv, dk).astype(np.float64)
    s = qx.astype(np.float64) @ kh.T / 16
    w = np.exp(s - s.max(axis=1, keepdims=True))
    ref = (w / w.sum(axis=1, keepdims=True)) @ vh
    tiled = _flash_attn(nat, name, qx, kb, vb, nkv)
    np.testing.assert_allclose(tiled, ref, atol=2e-5)
    for i in (0, 17, 63):
        single = _flash_attn(nat, name, qx[i:i + 1], kb, vb, nkv)
        np.testing.assert_allclose(single[0], ref[i], atol=2e-5)
