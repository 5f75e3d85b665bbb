"""An eval callback that rewrites each layer's new K and V rows before the cache stores them.

llama.cpp's eval callback (`cb_eval`) can ask for any graph node: the scheduler computes up
to it, hands it over, and only then computes what reads it. K is asked at the node named
`Kcur-L` that RoPE produced, V at the view `Vcur-L` of its projection (the names the
model's graph gives them; K and V of one layer, for every model whose graph names them so).
Writing a quantize-dequantize round trip (quant.py) into that buffer makes the cache
(f16) store, and attention read, exactly what the simulated type would give back, with
the rest of the model computed as usual. Everything else is untouched: with the spec `f16`
for both (the identity) the logits are bit for bit those without the callback (tested).

`Recorder` asks for the same nodes and only sums them (calibration: mean and RMS per
layer, head and channel, unrotated). `Center` only subtracts the calibrated mean key from K
(no numpy quantization): under a real quantized cache type the type's own kernels then
quantize the centered keys ("real type with K centered", study.py's `--real K+c/V`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ...llama.cachetypes import DEFAULT
from ...llama.native import Native
from . import quant

_NAME = re.compile(rb"^(K|V)cur-(\d+)$")


class _Base:
    """The node selection; subclasses get (is_k, layer, rows [tokens, heads, head])."""

    def __init__(self, nat: Native) -> None:
        self.nat = nat
        self.errors: list[str] = []
        self.calls = 0
        self.head = 0  # the head size seen (for bits per value)
        self._f32 = int(nat.lib.GGML_TYPE_F32)
        self._rope = int(nat.lib.GGML_OP_ROPE)
        self._reshape = int(nat.lib.GGML_OP_RESHAPE)
        self.callback = nat.ffi.callback("ggml_backend_sched_eval_callback", self._cb)

    def wants(self, is_k: bool, layer: int) -> bool:
        return True

    def _cb(self, t: Any, ask: bool, user_data: Any) -> bool:
        ffi = self.nat.ffi
        m = _NAME.match(ffi.string(t.name))
        if m is None or not self.wants(m.group(1) == b"K", int(m.group(2))):
            return False if ask else True
        if ask:
            return True
        is_k = m.group(1) == b"K"
        if int(t.op) != (self._rope if is_k else self._reshape):
            return True  # the projection or its reshape: not yet the row the cache takes
        try:
            if int(t.type) != self._f32:
                raise ValueError(f"{ffi.string(t.name).decode()}: type {int(t.type)}, not f32")
            if t.buffer != ffi.NULL and not self.nat.lib.ggml_backend_buffer_is_host(t.buffer):
                # the rows are read and written in place: only where they are host memory
                raise ValueError(f"{ffi.string(t.name).decode()}: in device memory (these hooks run "
                                 "on the CPU: load the model with no GPU layers)")
            head, heads, tokens = int(t.ne[0]), int(t.ne[1]), int(t.ne[2])
            if int(t.nb[1]) != 4 * head or int(t.nb[2]) != 4 * head * heads:
                raise ValueError(f"{ffi.string(t.name).decode()}: not contiguous")
            buf = ffi.buffer(ffi.cast("char *", t.data), 4 * head * heads * tokens)
            rows = np.frombuffer(buf, dtype=np.float32).reshape(tokens, heads, head)
            self.calls += 1
            self.head = head
            self.rows(is_k, int(m.group(2)), rows)
        except Exception as e:  # noqa: BLE001 - never raise into C; checked after the run
            self.errors.append(repr(e))
        return True

    def rows(self, is_k: bool, layer: int, rows: np.ndarray) -> None:
        raise NotImplementedError


class FakeQuant(_Base):
    """K and V of the chosen layers (None: all) through quant.apply, in place."""

    def __init__(self, nat: Native, k: str, v: str, layers: frozenset[int] | None = None,
                 calib: dict[tuple[bool, int], quant.Calib] | None = None) -> None:
        super().__init__(nat)
        self.k, self.v = quant.parse(k), quant.parse(v)
        self.layers = layers
        self.calib = calib or {}

    def wants(self, is_k: bool, layer: int) -> bool:
        spec = self.k if is_k else self.v
        return spec.kind != DEFAULT and (self.layers is None or layer in self.layers)

    def rows(self, is_k: bool, layer: int, rows: np.ndarray) -> None:
        spec = self.k if is_k else self.v
        rows[...] = quant.apply(spec, rows, is_k, self.calib.get((is_k, layer)))


class Center(_Base):
    """K of every calibrated layer minus its calibrated mean key per KV head, in place; V and
    the cache type untouched. Exact for attention up to rounding: q.(k - m) differs from q.k
    by one constant per query, which softmax removes (no attention logit softcap here)."""

    def __init__(self, nat: Native, calib: dict[tuple[bool, int], quant.Calib]) -> None:
        super().__init__(nat)
        self.mean = {layer: c.mean.astype(np.float32) for (is_k, layer), c in calib.items() if is_k}
        if not self.mean:
            raise ValueError("centering needs the calibrated K means (hook.Recorder)")

    def wants(self, is_k: bool, layer: int) -> bool:
        return is_k and layer in self.mean

    def rows(self, is_k: bool, layer: int, rows: np.ndarray) -> None:
        rows -= self.mean[layer][None]


class Recorder(_Base):
    """Sums of K and V rows per layer (float64) for `calib()`."""

    def __init__(self, nat: Native) -> None:
        super().__init__(nat)
        self.n: dict[tuple[bool, int], int] = {}
        self.s: dict[tuple[bool, int], np.ndarray] = {}
        self.s2: dict[tuple[bool, int], np.ndarray] = {}
        self.samples: dict[tuple[bool, int], list[np.ndarray]] = {}

    def rows(self, is_k: bool, layer: int, rows: np.ndarray) -> None:
        key = (is_k, layer)
        r = rows.astype(np.float64)
        self.n[key] = self.n.get(key, 0) + len(r)
        self.s[key] = self.s.get(key, 0) + r.sum(axis=0)
        self.s2[key] = self.s2.get(key, 0) + (r * r).sum(axis=0)
        self.samples.setdefault(key, []).append(rows.copy())

    def calib(self) -> dict[tuple[bool, int], quant.Calib]:
        return {k: quant.Calib(mean=(self.s[k] / n).astype(np.float32),
                               rms=np.sqrt(self.s2[k] / n).astype(np.float32))
                for k, n in self.n.items()}
