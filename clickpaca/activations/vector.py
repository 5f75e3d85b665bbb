"""The context's control vector (init's `controlVector`) and each sequence's strength.

One set of directions per context, given once through llama_set_adapter_cvec. Where the
build has per-sequence strengths (features.py 'cvec-seq': the activations build,
native/activations), the directions go in unscaled and every sequence slot gets init's
`controlVectorStrength` through llama_set_adapter_cvec_seq; an infer's own strength
replaces its slot's while its job runs (jobs.InferJob begin / end), so sequences in one
batch are steered differently and a slot at strength 0 decodes exactly as without a
vector. Elsewhere the directions go in scaled by init's strength, the same for every
token (upstream's context-wide vector), and a per-request strength is refused, naming
the field and the build that has it.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from ..llama import features
from . import steer
from .wire import directions as directions_of
from .wire import values as check_values


class ContextVector:
    """The vector of one context; `set` / `reset` a slot's strength (per_seq builds only)."""

    def __init__(self, ctx: Any, vector: Any, layers: tuple[int, int] | None, strength: float) -> None:
        self.ctx, self.strength = ctx, strength
        self.per_seq = features.available(ctx.nat, "cvec-seq")
        self.layers = steer.layer_range(layers, ctx.model.n_layer)
        dirs = directions_of(vector) if isinstance(vector, tuple) else _read(vector)
        steer.apply(ctx, dirs, 1.0 if self.per_seq else strength, self.layers)
        self.n_layers = sum(self.layers[0] <= il <= self.layers[1] for il in dirs)
        if self.per_seq:
            for slot in range(ctx.n_seq_max):
                self.set(slot, strength)

    @classmethod
    def open(cls, ctx: Any, req: Any) -> "ContextVector | None":
        """The init request's vector on `ctx` (None without one); SteerError naming the field."""
        if req.controlVector is None:
            return None
        return cls(ctx, req.controlVector, req.controlVectorLayers, req.controlVectorStrength)

    def set(self, slot: int, strength: float) -> None:
        rc = self.ctx.nat.lib.llama_set_adapter_cvec_seq(self.ctx.ptr, slot, strength)
        if rc != 0:
            raise steer.SteerError("controlVectorStrength", f"llama.cpp refused slot {slot} "
                                   f"(llama_set_adapter_cvec_seq returned {rc})")

    def reset(self, slot: int) -> None:
        """The slot back to init's strength (its sequence ended or was freed)."""
        self.set(slot, self.strength)

    def ready(self) -> dict[str, Any]:
        """For the `ready` event."""
        return {"layers": list(self.layers), "nLayers": self.n_layers, "strength": self.strength,
                "perSequence": self.per_seq}


def for_request(cv: ContextVector | None, nat: Any, strength: float | None) -> ContextVector | None:
    """The vector an infer's controlVectorStrength steers with (None: it gives none);
    FeatureMissing or SteerError naming the field when it cannot."""
    if strength is None:
        return None
    missing = features.lacking("cvec-seq", features.for_native(nat))
    if missing:
        raise features.refusal("cvec-seq", missing, nat.name)
    if cv is None:
        raise steer.SteerError("controlVectorStrength", "this context has no control vector "
                               "(init's controlVector gives it one)")
    return cv


def _read(path: str) -> dict:
    return read_directions(path, "controlVector")


def read_directions(path: str, name: str) -> dict:
    """The GGUF's directions, each checked as directions given as data are (wire.values);
    SteerError naming `name` (init's controlVector, a vector request's vector)."""
    from .cvec import read_gguf

    shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise steer.SteerError(name, f"{shown}: not a regular file")
    except FileNotFoundError:
        raise steer.SteerError(name, f"{shown}: no such file") from None
    except (OSError, ValueError) as e:  # a name too long, a NUL, no permission
        raise steer.SteerError(name, f"{shown}: cannot be used "
                                                f"({getattr(e, 'strerror', None) or e})") from None
    try:
        dirs = read_gguf(path)
    except Exception as e:  # noqa: BLE001 - gguf's reader raises many kinds for a bad file
        raise steer.SteerError(name, f"{shown}: not a control-vector GGUF ({type(e).__name__}: {e})") from None
    try:
        return {il: check_values(f"{name}: layer {il}", v) for il, v in dirs.items()}
    except ValueError as e:
        raise steer.SteerError(name, f"{shown}: {str(e).removeprefix(f'{name}: ')}") from None
