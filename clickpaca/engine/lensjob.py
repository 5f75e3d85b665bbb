"""One request's logit lens: the `l_out-L` rows its capture takes each tick go through
the model's final norm and head (activations/lens.py) at once, and what is kept is the top
k and the entropy per layer, in the shape the events carry (docs/PROTOCOL.md, "lens"):
an infer's token event holds the lens of the row its token was sampled from, a score's
end event the lens of every position it fed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..activations.lens import Lens


def node(layer: int) -> str:
    """The graph node a layer's lens reads: the residual stream after the layer (llama.cpp
    names it l_out, after any control vector is added)."""
    return f"l_out-{layer}"


@dataclass(eq=False)
class JobLens:
    """What one request's lens reads and has computed (see the module doc)."""

    lens: Lens
    layers: list[int]
    top: int
    piece: Callable[[int], str]
    positions: list[int] = field(default_factory=list)
    rows: deque = field(default_factory=deque)  # one per position read: its event form

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node(i) for i in self.layers)

    def took(self, positions: list[int], got: dict[str, np.ndarray]) -> None:
        """This tick's rows ([len(positions), n_embd] per node, in position order): every
        layer's rows through the lens in one call."""
        if not positions:
            return
        x = np.concatenate([got[node(i)] for i in self.layers])  # layer-major
        r = self.lens.apply(x, self.top)
        n = len(positions)
        for j, pos in enumerate(positions):
            at = range(j, len(self.layers) * n, n)
            self.positions.append(pos)
            self.rows.append({
                "top": [[{"token": int(t), "piece": self.piece(int(t)), "logprob": float(lp)}
                         for t, lp in zip(r.ids[k], r.logprobs[k])] for k in at],
                "entropy": [float(r.entropy[k]) for k in at]})

    def next_token(self) -> dict | None:
        """A token event's `lens`: the oldest row not yet sent (the row its token was
        sampled from), or None when none was read."""
        if not self.rows:
            return None
        return {"layers": list(self.layers), **self.rows.popleft()}

    def event_field(self) -> dict:
        """A score's end event `lens`: every position read, in order."""
        rows = list(self.rows)
        return {"layers": list(self.layers), "positions": list(self.positions),
                "top": [r["top"] for r in rows], "entropy": [r["entropy"] for r in rows]}


def for_request(head: Lens, spec: Any, n_layer: int, piece: Callable[[int], str]) -> JobLens:
    """The JobLens of a request's checked `lens` (layers, top); LensError for layers the
    model does not have."""
    from ..activations.lens import layers_of

    layers, top = spec
    return JobLens(head, layers_of(layers if layers == "all" else list(layers), n_layer), top, piece)
