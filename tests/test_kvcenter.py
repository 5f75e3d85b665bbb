"""llama/kvcenter.py, the center file: what is written is read back to every bit with its
digest, and a file that is not a center, a damaged one or one of another format is refused
with a message saying why (init's kvCenter reports it). No model: the native side is
tests/test_kvcenter_native.py, the server's tests/test_kvcenter_server.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.llama import kvcenter


def _center(shapes, seed=0) -> kvcenter.Center:
    rng = np.random.default_rng(seed)
    return kvcenter.Center.from_means({il: rng.normal(size=s).astype(np.float32) for il, s in enumerate(shapes)},
                                      len(shapes), {"model": "m.gguf", "tokens": 7})


@settings(max_examples=30, deadline=None)
@given(heads=st.lists(st.integers(1, 4), min_size=1, max_size=6), head=st.sampled_from([1, 8, 64, 256]),
       seed=st.integers(0, 2**32 - 1))
def test_round_trip_every_bit(tmp_path_factory, heads, head, seed):
    c = _center([(h, head) for h in heads], seed)
    path = tmp_path_factory.mktemp("c") / "c.npz"
    c.save(path)
    got = kvcenter.read(path)
    assert got.digest == c.digest
    assert len(got.layers) == len(heads)
    for a, b in zip(got.layers, c.layers):
        assert a.shape == b.shape and a.dtype == np.float32 and a.tobytes() == b.tobytes()
    assert got.meta == {"format": kvcenter.FORMAT, "model": "m.gguf", "tokens": 7}
    assert got.flat.size == sum(heads) * head


def test_digest_depends_on_values_and_layout():
    a = _center([(1, 8), (1, 8)])
    b = kvcenter.Center(tuple(x.copy() for x in a.layers))
    assert a.digest == b.digest
    b.layers[1][0, 3] = np.nextafter(b.layers[1][0, 3], np.float32(np.inf))
    assert a.digest != b.digest
    merged = kvcenter.Center((np.concatenate([x.reshape(-1) for x in a.layers]).reshape(1, 16),))
    assert merged.flat.tobytes() == a.flat.tobytes() and merged.digest != a.digest


def test_every_layer_needs_a_mean():
    with pytest.raises(kvcenter.CenterError, match=r"layer\(s\) \[1\]"):
        kvcenter.Center.from_means({0: np.zeros((1, 4)), 2: np.zeros((1, 4))}, 3)


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def test_refusals_say_why(tmp_path):
    good = _center([(1, 4), (1, 4)])
    cases = {
        "missing.npz": (None, "no such file"),
        "text.npz": (b"not numpy", "not a center file"),
        "other.npz": (dict(x=np.zeros(3)), "not a center file"),
    }
    (tmp_path / "text.npz").write_bytes(b"not numpy")
    _write(tmp_path / "other.npz", x=np.zeros(3))
    base = dict(center=good.flat, sizes=good.sizes, heads=np.array([1, 1]),
                meta=np.asarray(json.dumps({"format": kvcenter.FORMAT, "digest": good.digest})))
    variants = {
        "format.npz": (dict(base, meta=np.asarray(json.dumps({"format": "v0"}))), "format 'v0'"),
        "sizes.npz": (dict(base, sizes=np.array([4, 5])), "inconsistent arrays"),
        "dtype.npz": (dict(base, center=good.flat.astype(np.float64)), "inconsistent arrays"),
        "nan.npz": (dict(base, center=np.where(np.arange(8) == 2, np.nan, good.flat).astype(np.float32)),
                    "non-finite"),
        "damaged.npz": (dict(base, center=good.flat + np.float32(1)), "do not match its digest"),
    }
    for name, (arrays, _) in variants.items():
        _write(tmp_path / name, **arrays)
    cases.update(variants)
    for name, (_, why) in cases.items():
        with pytest.raises(kvcenter.CenterError, match=why):
            kvcenter.read(tmp_path / name)
    _write(tmp_path / "ok.npz", **base)
    assert kvcenter.read(tmp_path / "ok.npz").digest == good.digest


def test_ready_shows_the_calibration():
    c = _center([(1, 4)])
    r = c.ready("/x/c.npz")
    assert r == {"path": "/x/c.npz", "digest": c.digest, "layers": 1,
                 "calibration": {"model": "m.gguf", "tokens": 7}}


def test_a_centered_pair_loads_the_build_with_the_subtraction():
    assert kvcenter.build_for_centered("q4_0", "q4_0") == "kvcenter"  # mainline's types: the patched build
    assert kvcenter.build_for_centered("q5_0", "turbo3") == "turboquant"  # the same build, by its types' name
