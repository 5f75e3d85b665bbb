"""Key centering: a calibrated mean key per layer, subtracted in the graph before the cache.

Why: docs/KV-RESEARCH.md ("Centering with the real kernels") measured that quantizing
k - mean instead of k takes a 4.5-bit K cache's KL on Gemma 3 270M to 0.47-0.61x (iq4_nl,
q4_0), and is exact: q.(k - c) differs from q.k by one constant per query, which softmax
removes.
The kvcenter patch (native/kvcenter/apply.py) adds `llama_set_kv_center`; this module
is the center's file (written by `clickpaca kv-center`, read by init's `kvCenter`) and
its application to a context.

A center file is an .npz (numpy, no pickle): `center` float32, every layer's
[n_head_kv, n_embd_head_k] mean key flattened in layer order (llama.cpp's layout: one
[n_embd_head_k, n_head_kv] tensor per layer); `sizes` int64, the floats of each layer;
`meta`, a JSON string (format, the model it was calibrated on, the text, the tokens).
Its identity is `digest` (sha256 of sizes and values): a KV state saved under one center
is refused under another (engine/kvstate.py), since its stored keys are k - c.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import features
from .cachetypes import MAINLINE, build_for, get

FORMAT = "clickpaca-kv-center-1"
MAX_FILE_BYTES = 1 << 30  # far above any model's layers x KV heads x head size x 4 bytes


class CenterError(ValueError):
    """A center file that cannot be used, or llama.cpp refusing it; the message says why."""


@dataclass(frozen=True)
class Center:
    """One mean key per layer and KV head: `layers[il]` is [n_head_kv, n_embd_head_k]."""

    layers: tuple[np.ndarray, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def flat(self) -> np.ndarray:
        return np.concatenate([a.reshape(-1) for a in self.layers]).astype(np.float32, copy=False)

    @property
    def sizes(self) -> np.ndarray:
        return np.asarray([a.size for a in self.layers], dtype=np.int64)

    @property
    def digest(self) -> str:
        h = hashlib.sha256(self.sizes.astype("<i8").tobytes())
        h.update(self.flat.astype("<f4").tobytes())
        return h.hexdigest()

    @classmethod
    def from_means(cls, means: dict[int, np.ndarray], n_layer: int, meta: dict | None = None) -> "Center":
        """From per-layer means ({layer: [heads, head]}, as hook.Recorder calibrates)."""
        missing = [il for il in range(n_layer) if il not in means]
        if missing:
            raise CenterError(f"no mean key for layer(s) {missing[:8]}: every layer needs one")
        return cls(tuple(np.ascontiguousarray(means[il], dtype=np.float32) for il in range(n_layer)),
                   dict(meta or {}))

    def save(self, path: str | os.PathLike) -> None:
        meta = {"format": FORMAT, **self.meta, "digest": self.digest}
        heads = np.asarray([a.shape[0] for a in self.layers], dtype=np.int64)
        with open(path, "wb") as f:  # np.savez on a name would append .npz to it
            np.savez(f, center=self.flat, sizes=self.sizes, heads=heads, meta=np.asarray(json.dumps(meta)))

    def ready(self, path: str) -> dict[str, Any]:
        """What the ready event shows."""
        return {"path": path, "digest": self.digest, "layers": len(self.layers),
                "calibration": {k: v for k, v in self.meta.items() if k not in ("format", "digest")}}


def build_for_centered(*types: str) -> str:
    """The build for these cache types with keys centered: the types' own (build_for), or
    where that is mainline, the patched build that has llama_set_kv_center (it offers every
    mainline type)."""
    build = build_for(*types)
    return features.BY_NAME["kv-center"].build if build == MAINLINE else build


def parse_pair(text: str, option: str) -> tuple[str, str, bool]:
    """A cache pair with K optionally centered, as the studies write it: `q4_0` -> (q4_0,
    q4_0, False); `q5_0+c/turbo3` -> (q5_0, turbo3, True). Only K takes `+c` (a V shifted by
    its mean is not exact: the mean would have to be added back to the attention output).
    ValueError naming `option` (UnknownCacheType for a name that is no cache type)."""
    k, sep, v = text.strip().partition("/")
    center = k.endswith("+c")
    k = k.removesuffix("+c")
    if not sep:
        if center:
            raise ValueError(f"{option} {text!r}: write K+c/V, e.g. q4_0+c/q4_0")
        v = k
    if "+" in k or "+" in v:
        raise ValueError(f"{option} {text!r}: only K takes a modifier, and only +c (centering)")
    get(k, f"{option} {text!r}: K"), get(v, f"{option} {text!r}: V")
    return k, v, center


def read(path: str | os.PathLike) -> Center:
    """A center file, checked for form (the sizes against a model: `apply`)."""
    shown = os.fspath(path)
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise CenterError(f"{shown}: larger than {MAX_FILE_BYTES} bytes, not a center file")
        with np.load(path, allow_pickle=False) as z:
            if not {"center", "sizes", "heads", "meta"} <= set(z.files):
                raise CenterError(f"{shown}: not a center file (arrays {sorted(z.files)}; "
                                  "`clickpaca kv-center` writes one)")
            flat, sizes, heads = z["center"], z["sizes"], z["heads"]
            meta = json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise CenterError(f"{shown}: no such file") from None
    except (OSError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, CenterError):
            raise
        raise CenterError(f"{shown}: not a center file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise CenterError(f"{shown}: format {meta.get('format')!r}, this version reads {FORMAT!r}")
    if (flat.dtype != np.float32 or flat.ndim != 1 or sizes.ndim != 1 or heads.shape != sizes.shape
            or sizes.dtype.kind != "i" or heads.dtype.kind != "i" or (sizes <= 0).any() or (heads <= 0).any()
            or (sizes % heads).any() or int(sizes.sum()) != flat.size):
        raise CenterError(f"{shown}: inconsistent arrays (center {flat.dtype} {list(flat.shape)}, "
                          f"sizes {list(sizes)})")
    if not np.isfinite(flat).all():
        raise CenterError(f"{shown}: the center holds non-finite values")
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    center = Center(tuple(p.reshape(int(h), -1) for p, h in zip(parts, heads)),
                    {k: v for k, v in meta.items() if k != "digest"})
    if meta.get("digest") not in (None, center.digest):
        raise CenterError(f"{shown}: its values do not match its digest (a damaged file)")
    return center


def apply(ctx: Any, center: Center | None) -> None:
    """Set `center` on a core.Context (None clears it); ctx.k_center becomes its digest.
    FeatureMissing on a build without the kvcenter patch, CenterError where the sizes are
    not the model's."""
    features.require(ctx.nat, "kv-center")
    lib, ffi = ctx.nat.lib, ctx.nat.ffi
    if center is None:
        lib.llama_set_kv_center(ctx.ptr, ffi.NULL, 0)
        ctx.k_center = None
        return
    if len(center.layers) != ctx.model.n_layer:
        raise CenterError(f"the center has {len(center.layers)} layers, the model {ctx.model.n_layer}")
    data = np.ascontiguousarray(center.flat, dtype=np.float32)
    rc = lib.llama_set_kv_center(ctx.ptr, ffi.from_buffer("float[]", data), data.size)
    if rc != 0:
        raise CenterError(f"llama.cpp refused the center ({data.size} floats in layers of "
                          f"{sorted(set(center.sizes.tolist()))}: not the model's keys per layer)")
    ctx.k_center = center.digest
