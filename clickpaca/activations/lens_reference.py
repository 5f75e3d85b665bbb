"""The logit lens in numpy, the graph's (lens.py) check: the output matrix dequantized by
ggml's own `to_float` (through the bindings) a slab of the vocabulary at a time, the
final RMS norm and the head's product in float64.

ggml's CPU kernel for a quantized head multiplies the quantized weights by the activations
quantized to the type's `vec_dot_type` (Q8_0 for a Q8_0 head): with ``as_kernel`` the
normed row (rounded as ggml's CPU op rounds it) goes through that same quantization (ggml's `from_float`, then `to_float`)
before the product, so the reference differs from the graph only by summation order;
without it the row stays float, which shows what that quantization alone moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .lens import Lens, LensRows

#: vocabulary rows dequantized at once (float32: SLAB x n_embd x 4 bytes)
SLAB = 16384


def dequantize(lens: Lens, first: int, count: int) -> np.ndarray:
    """[count, n_embd] float32: vocabulary rows first.. of the head, by ggml's to_float."""
    lib, ffi = lens.nat.lib, lens.nat.ffi
    t = lens.head
    src = ffi.cast("char *", t.data) + first * int(t.nb[1])
    out = np.empty((count, lens.n_embd), np.float32)
    lib.ggml_get_type_traits(t.type).to_float(src, ffi.cast("float *", ffi.from_buffer(out)), out.size)
    return out


def norm_weight(lens: Lens) -> np.ndarray:
    ffi = lens.nat.ffi
    return np.frombuffer(ffi.buffer(lens.norm.data, lens.n_embd * 4), np.float32).copy()


def as_vec_dot(lens: Lens, x: np.ndarray) -> np.ndarray:
    """float32 rows [m, n_embd] after ggml's quantization to the head's vec_dot_type and
    back (what the CPU kernel multiplies the weights by); unchanged for a float type."""
    lib, ffi = lens.nat.lib, lens.nat.ffi
    vt = lib.ggml_get_type_traits_cpu(lens.head.type).vec_dot_type
    if vt == lib.GGML_TYPE_F32:
        return x
    x = np.ascontiguousarray(x, np.float32)
    n = lens.n_embd
    q = np.empty(int(lib.ggml_row_size(vt, n)), np.uint8)
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        lib.ggml_get_type_traits_cpu(vt).from_float(ffi.cast("float *", ffi.from_buffer(x[i])),
                                                    ffi.cast("void *", ffi.from_buffer(q)), n)
        lib.ggml_get_type_traits(vt).to_float(ffi.cast("void *", ffi.from_buffer(q)),
                                              ffi.cast("float *", ffi.from_buffer(out[i])), n)
    return out


def rms_norm_f32(lens: Lens, rows: np.ndarray) -> np.ndarray:
    """The final norm as ggml's CPU op rounds it: float32 squares summed in float64, the
    mean and the scale 1 / sqrt(mean + eps) in float32, then x * scale * w in float32 (one
    ulp here can move a value across a rounding step of the vec_dot quantization)."""
    x = np.asarray(rows, np.float32)
    mean = ((x * x).astype(np.float64).sum(axis=1) / x.shape[1]).astype(np.float32)
    scale = (np.float32(1.0) / np.sqrt(mean + np.float32(lens.eps))).astype(np.float32)
    return (x * scale[:, None]) * norm_weight(lens)


def logits(lens: Lens, rows: np.ndarray, as_kernel: bool = True) -> np.ndarray:
    """[m, n_vocab] float64 logits of residual rows [m, n_embd]."""
    if as_kernel:
        xn = as_vec_dot(lens, rms_norm_f32(lens, rows))
    else:
        x = np.asarray(rows, np.float64)
        xn = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + lens.eps) * norm_weight(lens)
    xn = xn.astype(np.float64)
    out = np.empty((xn.shape[0], lens.n_vocab))
    for v0 in range(0, lens.n_vocab, SLAB):
        w = dequantize(lens, v0, min(SLAB, lens.n_vocab - v0))
        out[:, v0:v0 + w.shape[0]] = xn @ w.T.astype(np.float64)
    if lens.softcap:
        out = np.tanh(out / lens.softcap) * lens.softcap
    return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    mx = z.max(axis=1, keepdims=True)
    return z - mx - np.log(np.exp(z - mx).sum(axis=1, keepdims=True))


def apply(lens: Lens, rows: np.ndarray, top: int, as_kernel: bool = True) -> tuple[LensRows, np.ndarray]:
    """The reference LensRows (float64 values) and the whole log-softmax [m, n_vocab]."""
    lp = log_softmax(logits(lens, rows, as_kernel))
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :top].astype(np.int32)
    ent = -(np.exp(lp) * lp).sum(axis=1)
    return LensRows(ids, np.take_along_axis(lp, ids, 1), ent), lp


def main(argv: list[str] | None = None) -> int:
    """Per layer, the largest |log-probability| difference between the graph and this
    reference over the top 10 of a prompt's last three positions (docs/ACTIVATIONS.md)."""
    import argparse

    from ..llama import core
    from ..llama.models import resolve_model
    from .capture import Capture

    ap = argparse.ArgumentParser(prog="python -m clickpaca.activations.lens_reference")
    ap.add_argument("--model", default=None, help="a path or registry name (default: the default model)")
    ap.add_argument("--build", default="mainline")
    ap.add_argument("--float", action="store_true", help="the row not quantized to the kernel's vec_dot type")
    a = ap.parse_args(argv)
    path = resolve_model(a.model)
    m = core.Model(path, build=a.build, n_gpu_layers=0)
    cap = Capture(m.nat)
    toks = m.tokenize("The capital of France is Paris, and the capital of Germany is")
    ctx = core.Context(m, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2, eval_callback=cap.callback)
    b = core.Batch(m.nat, 64)
    b.add(toks, 0, 0, output_all=True)
    n_layer = int(m.n_layer)
    cap.arm([f"l_out-{i}" for i in range(n_layer)], {0: list(range(len(toks)))}, b)
    if ctx.decode(b) != 0:
        raise RuntimeError("llama_decode failed")
    got = cap.take()[0]
    logits = ctx.logits().copy()
    lens = Lens(m.nat, path, n_threads=2)
    print(f"{path.name}: {lens.arch}, head {'token_embd (tied)' if lens.tied else 'output'} {lens.head_type}, "
          f"last layer == logits bit for bit: {np.array_equal(lens.logits(got[f'l_out-{n_layer - 1}']), logits)}")
    for i in range(n_layer):
        x = got[f"l_out-{i}"][-3:]
        r = lens.apply(x, 10)
        ref, lp = apply(lens, x, 10, as_kernel=not a.float)
        d = np.abs(np.take_along_axis(lp, r.ids.astype(np.int64), 1) - r.logprobs).max()
        print(f"layer {i:2d}  max |d logprob| {d:.2e}  max |d entropy| {np.abs(ref.entropy - r.entropy).max():.2e}"
              f"  same top-10 ids {bool((ref.ids == r.ids).all())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
