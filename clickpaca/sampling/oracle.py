"""llama.cpp's own C samplers, run through the generated bindings on a candidate set.

The reference our steps are tested against (tests/test_sampling_oracle.py) and timed
against (``clickpaca bench sampler``): a ``llama_token_data_array`` built with cffi
over the same (ids, logits), a sampler from ``llama_sampler_init_*``, then
``llama_sampler_apply``. llama.cpp works in float32, so the logits go in as float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

__all__ = ["CResult", "CSampler", "TOKEN_DATA"]

#: numpy view of llama_token_data {int32 id; float logit; float p}
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


@dataclass
class CResult:
    """What a C sampler left: the candidates (in llama.cpp's order), their logits and p,
    and the selected index (-1 unless the sampler picks a token, as mirostat does)."""

    ids: np.ndarray
    logits: np.ndarray
    p: np.ndarray
    selected: int

    def survivors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logits) of the candidates that can still be drawn: llama.cpp marks some
        removals with a -inf logit (top-n-sigma, greedy temperature) instead of
        shrinking the array."""
        keep = self.logits > -np.inf
        return self.ids[keep], self.logits[keep].astype(np.float64)


class CSampler:
    """One llama.cpp sampler (freed on close / exit of a with block)."""

    def __init__(self, nat: Any, init: str, *args: Any):
        self.nat = nat
        self.ptr = getattr(nat.lib, f"llama_sampler_init_{init}")(*args)
        if self.ptr == nat.ffi.NULL:
            raise ValueError(f"llama_sampler_init_{init}{args} returned NULL")

    def accept(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.nat.lib.llama_sampler_accept(self.ptr, int(t))

    def apply(self, ids: np.ndarray, logits: np.ndarray) -> CResult:
        ffi = self.nat.ffi
        n = int(ids.size)
        buf = ffi.new("llama_token_data[]", max(n, 1))
        view = np.frombuffer(ffi.buffer(buf, n * TOKEN_DATA.itemsize), TOKEN_DATA)
        view["id"], view["logit"], view["p"] = ids, logits, 0.0
        arr = ffi.new("llama_token_data_array *", {"data": buf, "size": n, "selected": -1, "sorted": False})
        self.nat.lib.llama_sampler_apply(self.ptr, arr)
        m = int(arr.size)  # XTC moves arr.data forward instead of copying
        out = np.frombuffer(ffi.buffer(arr.data, m * TOKEN_DATA.itemsize), TOKEN_DATA).copy()
        return CResult(out["id"].copy(), out["logit"].copy(), out["p"].copy(), int(arr.selected))

    def close(self) -> None:
        if self.ptr is not None:
            self.nat.lib.llama_sampler_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> "CSampler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
