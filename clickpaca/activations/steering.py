"""Each request's own steering vectors, in the activations build's K slots (native/activations:
llama_steer_*).

A context holds up to `init.vectorSlots` resident direction sets (slots.py keeps the books).
After layer il the graph adds dirs_il [n_embd, K] x s [K, n_tokens]: one small product per
layer, where s is a graph input filled at every decode from a host table of entries
(sequence, slot, positions [from, until), layers, strength, gated). So slot contents,
strengths and triggers are data: the graph is reused. Two things re-reserve it, each once
per context: the first `vector` (the K slots are made) and the first request with a
`when` (the gate's nodes join the graph); `reserves` in vector_ready counts them.

Triggers resolve here, on the host, to positions (a token's index in its sequence):
`from` "prompt" is 0, "generated" the sequence's length when the request starts, an
index itself; `after` one past the first place the string (or token id) ends in the
sequence, looked for again as tokens are accepted, and never until found. A `when`
gate is decided in the graph: the residual after the gate's layer, projected on the
gate vector's direction there, above its threshold; the host never reads it
(`steer_proj-L` / `steer_gate-L` are the graph nodes a capture reads for the trace).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..llama import features
from . import wire
from .slots import SlotBook, SlotsFull
from .steer import SteerError

NEVER = (1 << 31) - 1  # a position no token reaches
ENTRY_INTS = 7  # seq, slot, pos_from, pos_until, il_start, il_end, gated (llama_steer_set_table)


@dataclass
class Resolved:
    """One steer entry against the context: its slot, layers and trigger."""

    slot: int
    strength: float
    lo: int
    hi: int
    start: int | str  # a position, "generated" until the request starts
    until: int
    after: str | int | None
    gated: bool
    found: int | None = None  # the `after` trigger's position, once seen


@dataclass(eq=False)
class RequestSteer:
    """A running request's steering: its entries and gate, for one sequence slot."""

    owner: Steering
    entries: list[Resolved]
    gate: tuple[int, int, float] | None  # (slot, layer, above)
    text_of: Callable[[list[int]], str]
    seq_slot: int | None = None
    n_start: int = 0  # the sequence's length when the request started

    def slots(self) -> list[int]:
        used = [e.slot for e in self.entries] + ([self.gate[0]] if self.gate is not None else [])
        return sorted(set(used))

    def begin(self, seq_slot: int, tokens: list[int]) -> None:
        self.seq_slot, self.n_start = seq_slot, len(tokens)
        self.owner.start(self)
        self.seen(tokens)

    def end(self) -> None:
        self.owner.stop(self)

    def seen(self, tokens: list[int]) -> None:
        """The sequence's tokens so far: an `after` trigger found now starts one past it."""
        changed = False
        for e in self.entries:
            if e.after is None or e.found is not None:
                continue
            at = _ends_at(tokens, e.after, self.text_of)
            if at is not None:
                e.found, changed = at + 1, True
        if changed:
            self.owner.upload()

    def rows(self) -> list[tuple[list[int], float]]:
        out = []
        for e in self.entries:
            start = {"prompt": 0, "generated": self.n_start}.get(e.start, e.start)
            if e.after is not None:
                start = max(start, e.found) if e.found is not None else NEVER
            out.append(([self.seq_slot, e.slot, start, e.until, e.lo, e.hi, int(e.gated)], e.strength))
        return out


def _ends_at(tokens: list[int], after: str | int, text_of: Callable[[list[int]], str]) -> int | None:
    """The index of the token where `after` first ends in `tokens` (None: not there)."""
    if isinstance(after, int):
        return tokens.index(after) if after in tokens else None
    text = text_of(tokens)
    at = text.find(after)
    if at < 0:
        return None
    end = at + len(after)
    # the shortest prefix of tokens whose text holds the whole string
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(text_of(tokens[:mid + 1])) >= end and after in text_of(tokens[:mid + 1]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class Steering:
    """A context's slots: registrations, the running requests' entries, the native table."""

    def __init__(self, ctx: Any, k: int) -> None:
        self.ctx, self.k = ctx, k
        self.book = SlotBook(k)
        self.made = False
        self.gates = False
        self.live: list[RequestSteer] = []
        self.norms: dict[int, dict[int, float]] = {}  # slot -> {layer: norm}

    @classmethod
    def open(cls, ctx: Any, k: int) -> "Steering | None":
        return cls(ctx, k) if features.available(ctx.nat, "steer-slots") else None

    # ------------------------------------------------------------ native

    def _lib(self) -> Any:
        return self.ctx.nat.lib

    def _slots(self, gates: bool) -> None:
        rc = self._lib().llama_steer_set_slots(self.ctx.ptr, self.k, gates)
        if rc != 0:
            raise SteerError("vectorSlots", f"llama.cpp could not make {self.k} slots (llama_steer_set_slots {rc})")
        self.made, self.gates = True, gates

    def _fill(self, slot: int, flat: np.ndarray | None) -> None:
        nat, model = self.ctx.nat, self.ctx.model
        buf = nat.ffi.from_buffer("float[]", flat) if flat is not None else nat.ffi.NULL
        n = flat.size if flat is not None else 0
        rc = self._lib().llama_steer_set_slot(self.ctx.ptr, slot, buf, n, model.n_embd)
        if rc != 0:
            raise SteerError("vector", f"llama.cpp refused slot {slot} (llama_steer_set_slot {rc})")

    def reserves(self) -> int:
        return int(self._lib().llama_steer_n_reserve(self.ctx.ptr))

    def upload(self) -> None:
        rows = [r for rs in self.live for r in rs.rows()]
        ints = np.array([x for r, _ in rows for x in r], dtype=np.int32)
        vals = np.array([s for _, s in rows], dtype=np.float32)
        ffi = self.ctx.nat.ffi
        rc = self._lib().llama_steer_set_table(self.ctx.ptr, ffi.from_buffer("int32_t[]", ints) if rows else ffi.NULL,
                                               ffi.from_buffer("float[]", vals) if rows else ffi.NULL, len(rows))
        assert rc == 0, rc

    # ------------------------------------------------------------ vectors

    def register(self, owner: Any, vid: str, vector: Any) -> dict:
        """The `vector` request: its directions in a free slot; vector_ready's fields.
        SteerError naming the field, SlotsFull, KeyError (the id is taken)."""
        model = self.ctx.model
        dirs = _directions(vector)
        if len(dirs) > model.n_layer - 1:
            raise SteerError("vector", f"{len(dirs)} layers, the model has {model.n_layer - 1} that can be steered")
        for il, v in dirs.items():
            if not 1 <= il < model.n_layer:
                raise SteerError("vector", f"layer {il}: unknown, the model's are 1..{model.n_layer - 1}")
            if v.shape != (model.n_embd,):
                raise SteerError("vector", f"layer {il}: shape [{v.size}], the model needs n_embd [{model.n_embd}]")
        slot = self.book.register(owner, vid)
        try:
            if not self.made:
                self._slots(False)
            flat = np.zeros((model.n_layer - 1, model.n_embd), dtype=np.float32)
            for il, v in dirs.items():
                flat[il - 1] = v
            self._fill(slot, flat.reshape(-1))
        except Exception:
            self.book.free(owner, vid)
            raise
        self.norms[slot] = {il: float(np.linalg.norm(v)) for il, v in sorted(dirs.items())}
        return {"slot": slot, "layers": sorted(dirs), "norms": {str(il): n for il, n in self.norms[slot].items()},
                "reserves": self.reserves()}

    def free(self, owner: Any, vid: str) -> bool:
        if self.book.slot(owner, vid) is None:
            return False
        cleared = self.book.free(owner, vid)
        if cleared is not None:
            self._clear(cleared)
        return True

    def close(self, owner: Any) -> None:
        for s in self.book.close(owner):
            self._clear(s)

    def _clear(self, slot: int) -> None:
        self._fill(slot, None)
        self.norms.pop(slot, None)

    # ------------------------------------------------------------ requests

    def for_request(self, owner: Any, entries: tuple, text_of: Callable[[list[int]], str]) -> RequestSteer:
        """A request's `steer` against the registered vectors; SteerError naming the entry's field."""
        n_layer = self.ctx.model.n_layer
        gate = None
        out = []
        for i, e in enumerate(entries):
            slot = self.book.slot(owner, e.vector)
            if slot is None:
                raise SteerError("steer", f"[{i}].vector: unknown vector {e.vector!r} (send a vector request first)")
            lo, hi = e.layers if e.layers is not None else (1, n_layer - 1)
            if hi >= n_layer:
                raise SteerError("steer", f"[{i}].layers: {lo}-{hi} outside 1..{n_layer - 1}")
            if e.when is not None and gate is None:
                g = self.book.slot(owner, e.when.vector)
                if g is None:
                    raise SteerError("steer", f"[{i}].when.vector: unknown vector {e.when.vector!r}")
                if e.when.layer >= n_layer:
                    raise SteerError("steer", f"[{i}].when.layer: {e.when.layer} outside 1..{n_layer - 1}")
                gate = (g, e.when.layer, e.when.above)
            out.append(Resolved(slot, e.strength, lo, hi, e.start, e.until if e.until is not None else NEVER,
                                e.after, e.when is not None))
        return RequestSteer(self, out, gate, text_of)

    def start(self, rs: RequestSteer) -> None:
        self.book.acquire(rs.slots())
        if rs.gate is not None:
            if not self.gates:
                self._slots(True)
            rc = self._lib().llama_steer_set_gate(self.ctx.ptr, rs.seq_slot, rs.gate[0], rs.gate[1], rs.gate[2])
            assert rc == 0, rc
        self.live.append(rs)
        self.upload()

    def stop(self, rs: RequestSteer) -> None:
        if rs not in self.live:
            return
        self.live.remove(rs)
        if rs.gate is not None:
            self._lib().llama_steer_set_gate(self.ctx.ptr, rs.seq_slot, -1, 0, 0.0)
        self.upload()
        for s in self.book.release(rs.slots()):
            self._clear(s)


def _directions(vector: Any) -> dict[int, np.ndarray]:
    """The request's `vector`: a GGUF path or the data form (wire.control_vector)."""
    from .vector import read_directions

    return wire.directions(vector) if isinstance(vector, tuple) else read_directions(vector, "vector")


__all__ = ["RequestSteer", "Steering", "SlotsFull"]
