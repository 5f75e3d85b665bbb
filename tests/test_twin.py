"""native/twin.py: a tensor's bytes depend on the seed and its index only; each block's
scale fields hold the tensor's float16 scale; F32 tensors sit around their centre."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "native"))
import twin  # noqa: E402


@pytest.mark.parametrize("kind", sorted(twin.LAYOUTS))
def test_a_quantized_tensor_is_the_same_bytes_for_the_same_seed_and_its_scales_are_set(kind):
    _, size, fields = twin.LAYOUTS[kind]
    t = {"type": kind, "bytes": size * 40, "scale": 1e-4}
    a, b = twin.fill(t, 3, 7), twin.fill(t, 3, 7)
    assert a.tobytes() == b.tobytes() and a.size == size * 40
    assert twin.fill(t, 4, 7).tobytes() != a.tobytes() and twin.fill(t, 3, 8).tobytes() != a.tobytes()
    blocks = a.reshape(-1, size)
    for off, which in fields.items():
        got = blocks[:, off:off + 2].copy().view("<f2").astype(np.float32)
        want = np.float16(1e-4 * (7.5 if which == "dmin" else 1.0))
        assert (got == np.float32(want)).all(), (kind, which)


def test_f32_tensors_sit_within_ten_percent_of_their_centre():
    vals = twin.fill({"type": "F32", "bytes": 4 * 1000, "scale": 8.0}, 0, 1).view("<f4")
    assert vals.min() >= 8.0 * 0.9 and vals.max() <= 8.0 * 1.1 and vals.std() > 0.1
    assert twin.norm_value("blk.0.post_ffw_norm.weight") == 8.0 and twin.norm_value("output_norm.weight") == 1.0
