"""measure/kvsim/quant.py: the simulated KV types, against ggml's own quantizers and turbo's
numpy reference (itself bit-exact with the C path), and the properties the study relies on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clickpaca.llama import native
from clickpaca.llama import turboquant as tq
from clickpaca.measure.kvsim import quant

FINITE = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def test_parse_names_what_it_does_not_understand():
    assert quant.parse("lm4g32+c+s") == quant.Spec("lm", 4, 32, center=True, signs=True)
    assert quant.parse("split32:3").n_out == 32
    with pytest.raises(ValueError, match="modifier 'x'"):
        quant.parse("q4_0+x")
    with pytest.raises(ValueError, match="kind 'q3_0'"):
        quant.parse("q3_0")
    with pytest.raises(ValueError, match="f16 takes no modifier"):
        quant.parse("f16+c")


def test_bits_count_everything_stored():
    assert quant.bits_per_value(quant.parse("lm4"), 256) == tq.TYPES["turbo4"].bits_per_value == 4.125
    assert quant.bits_per_value(quant.parse("lm4"), 64) == 4.25  # one gain per 64-value head
    assert quant.bits_per_value(quant.parse("lm4g32"), 256) == 4.5
    assert quant.bits_per_value(quant.parse("q4_0+c"), 64) == 4.5
    assert quant.bits_per_value(quant.parse("split32:3"), 128) == (32 * 4 + 96 * 3 + 32) / 128


@pytest.fixture(scope="module")
def nat():
    if not (native.build_dir("mainline") / "build-info.json").exists():
        pytest.skip("builds/mainline does not exist (make mainline)")
    return native.load("mainline")


def ggml_round_trip(nat, name: str, x: np.ndarray) -> np.ndarray:
    ffi, lib = nat.ffi, nat.lib
    t = getattr(lib, f"GGML_TYPE_{name.upper()}")
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros(int(lib.ggml_row_size(t, x.size)), np.uint8)
    lib.ggml_quantize_chunk(t, ffi.from_buffer("float[]", x), ffi.from_buffer(out), 0, 1, x.size, ffi.NULL)
    y = np.zeros(x.size, np.float32)
    lib.ggml_get_type_traits(t).to_float(ffi.from_buffer(out), ffi.from_buffer("float[]", y), x.size)
    return y


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([32, 64, 256]), elements=FINITE))
@example(np.full(32, 1.1754944e-38, np.float32))  # d underflows fp16: 1/d is inf, the value 0
def test_q4_0_and_q8_0_are_ggmls_bit_for_bit(nat, x):
    for name, fn in (("q4_0", quant.q4_0), ("q8_0", quant.q8_0)):
        assert np.array_equal(fn(x), ggml_round_trip(nat, name, x)), name


def test_q8_0_rounds_ties_away_from_zero(nat):
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 127.0, 2.5, -2.5  # d = 1: 2.5 -> 3, -2.5 -> -3 (roundf)
    assert np.array_equal(quant.q8_0(x), ggml_round_trip(nat, "q8_0", x))
    assert quant.q8_0(x)[1] == 3 and quant.q8_0(x)[2] == -3


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_any_is_turbo_up_to_rounding(bits):
    x = tq.random_rotated(2000, np.random.default_rng(bits)) * 3.0
    ref = tq.round_trip(x.reshape(-1), f"turbo{bits}").reshape(x.shape)
    got = quant.lloyd_max_any(x, bits, 128)
    assert np.mean(np.isclose(got, ref, rtol=2e-3, atol=1e-6)) > 0.999
    err = lambda y: float(np.mean((y - x) ** 2))  # noqa: E731
    assert err(got) == pytest.approx(err(ref), rel=1e-3)
    assert quant.lloyd_max(x, bits, 128) is not None and np.array_equal(quant.lloyd_max(x, bits, 128), ref)


@pytest.mark.parametrize("bits,mse", [(2, 0.1175), (3, 0.03454), (4, 0.009497), (5, 0.002499)])
def test_lloyd_max_error_is_the_gaussian_quantizers(bits, mse):
    """On rotated (Gaussian-like) blocks the relative error is the Lloyd-Max MSE of N(0,1)."""
    x = tq.random_rotated(4000, np.random.default_rng(0)).astype(np.float32)
    got = quant.lloyd_max_any(x, bits, 128)
    rel = float(np.mean(np.sum((got - x) ** 2, axis=1) / np.sum(x * x, axis=1)))
    assert rel == pytest.approx(tq.standard_mse(bits), rel=0.08)
    assert rel == pytest.approx(mse, rel=0.1)


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, (3, 2, 64), elements=FINITE), st.booleans())
def test_rotation_round_trips(x, signs):
    r = quant.rotate(x.reshape(6, 64), 64, signs)
    back = quant.rotate(r, 64, signs, inverse=True)
    assert np.allclose(back, x.reshape(6, 64), atol=1e-3 * (1 + np.abs(x).max()))
    assert np.allclose(np.linalg.norm(r, axis=1), np.linalg.norm(x.reshape(6, 64), axis=1),
                       rtol=1e-6, atol=1e-3)


def test_apply_f16_is_the_identity_and_q8_0_is_close():
    x = np.random.default_rng(1).standard_normal((5, 3, 64)).astype(np.float32)
    assert quant.apply(quant.parse("f16"), x, True) is x
    y = quant.apply(quant.parse("q8_0"), x, True)
    assert y.shape == x.shape and 0 < np.abs(y - x).max() < 0.05


def test_centering_adds_the_mean_back_and_removes_its_cost():
    """A large shared offset is what centering is for: without it the offset takes the
    codes' range; with the calibrated mean it costs nothing."""
    rng = np.random.default_rng(2)
    offset = rng.standard_normal(64).astype(np.float32) * 10
    x = (rng.standard_normal((200, 1, 64)) + offset).astype(np.float32)
    calib = quant.Calib(mean=offset[None].copy(), rms=np.ones((1, 64), np.float32))
    plain = quant.apply(quant.parse("lm3"), x, True, calib)
    cent = quant.apply(quant.parse("lm3+c"), x, True, calib)
    err = lambda y: float(np.mean((y - x) ** 2))  # noqa: E731
    assert err(cent) < err(plain) / 20
    with pytest.raises(ValueError, match="calibration"):
        quant.apply(quant.parse("lm3+c"), x, True, None)


def test_split_gives_the_outlier_channels_more_bits():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 1, 64)).astype(np.float32)
    x[:, 0, :8] *= 20  # 8 outlier channels
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(axis=0)).astype(np.float32)
    calib = quant.Calib(mean=np.zeros((1, 64), np.float32), rms=rms)
    err = lambda y: float(np.mean((y - x) ** 2))  # noqa: E731
    split = quant.apply(quant.parse("split8:3"), x, True, calib)
    assert err(split) < err(quant.apply(quant.parse("lm3+norot"), x, True, calib))
    assert quant.bits_per_value(quant.parse("split8:3"), 64) == (8 * 4 + 56 * 3 + 32) / 64


def test_mse_measures_the_error_and_the_means_share():
    from clickpaca.measure.kvsim import mse

    rng = np.random.default_rng(4)
    mean = np.full((1, 64), 2.0, np.float32)
    x = (rng.standard_normal((400, 1, 64)) + mean).astype(np.float32)
    calib = quant.Calib(mean=mean, rms=np.ones((1, 64), np.float32))
    assert mse.mean_energy(x, calib) == pytest.approx(4 / 5, rel=0.03)  # 4 of 1 + 4 per channel
    assert mse.relative_error("f16", x, True, calib) == 0
    assert mse.relative_error("q8_0", x, True, calib) < mse.relative_error("q4_0", x, True, calib)
    assert mse.relative_error("lm4+c", x, True, calib) < mse.relative_error("lm4", x, True, calib) / 3
