"""When a decode may reuse the graph llama.cpp holds: a set of orders' `Plan` (the shape
of the ops they need), whether a built graph `fits` it, and the room (`roomy`) a new graph
is given so that orders which grow by a few still fit. Rebuilding costs a new sampler
chain and a new graph; these rules decide when it is paid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .rows import BLOCK, Layout, RowOrder


@dataclass(frozen=True)
class Plan:
    """The shape of the ops for a set of orders: what a graph was built for. Two decodes
    with equal plans (and equal micro-batches) can share one graph."""

    slots: tuple[int, ...]
    layout: Layout
    scale: float | None  # the one 1/tau of every row (softmax's own scale), else None
    keep: bool = True  # whole rows copied beside the packs (a decode of several micro-batches)


#: a new graph's K and touched ids are rounded up to these, so that orders which grow by a
#: few (a penalty window's distinct tokens, say) still fit the graph built for them
K_ROOM, TOUCHED_ROOM = 32, 16


def _room(n: int, step: int) -> int:
    return -(-n // step) * step


def roomy(plan: Plan, n_vocab: int) -> Plan:
    """``plan`` with K (above 1: the greedy plan stays) and the touched ids rounded up to
    K_ROOM and TOUCHED_ROOM: what a new graph is built for."""
    lay = plan.layout
    k = lay.k if lay.k == 1 else min(n_vocab, _room(lay.k, K_ROOM))
    t = _room(lay.n_touched, TOUCHED_ROOM)
    if (k, t) == (lay.k, lay.n_touched):
        return plan
    return dataclasses.replace(plan, layout=dataclasses.replace(lay, k=k, n_touched=t))


def fits(plan: Plan, built: Plan | None) -> bool:
    """Whether the graph built for ``built`` serves ``plan``: its ops compute a superset
    (the same rows, pieces and temperature; K and touched ids at least as many, and at
    most twice as many or what `roomy` makes of them, so that a graph much too large is
    rebuilt). Each row reads its own k best and its own touched values from the larger
    pack (`unpack`)."""
    if built is None or plan.slots != built.slots or plan.keep != built.keep or plan.scale != built.scale:
        return False
    a, b = plan.layout, built.layout
    return ((a.n_blocks, a.dense, a.raw, a.raw_top, a.mass) == (b.n_blocks, b.dense, b.raw, b.raw_top, b.mass)
            and (a.k == b.k or 1 < a.k <= b.k <= max(2 * a.k, _room(a.k, K_ROOM)))
            and a.n_touched <= b.n_touched <= max(2 * a.n_touched, _room(a.n_touched, TOUCHED_ROOM)))


def plan_of(orders: dict[int, RowOrder], n_vocab: int, keep: bool = True) -> Plan | None:
    """The ops' shape for these orders (None: no rows ordered)."""
    if not orders:
        return None
    slots = tuple(sorted(orders))
    os_ = [orders[s] for s in slots]
    k = min(n_vocab, max(o.k for o in os_))
    n_touched = max(o.touched.size for o in os_)
    masked = any(o.mask is not None for o in os_)
    dense = any(o.u is not None for o in os_)
    raw = any(o.raw for o in os_)
    mass = dense or any(o.mass for o in os_)
    layout = Layout(k, -(-n_vocab // BLOCK), n_touched, dense, raw, raw_top=raw and masked, mass=mass)
    scales = {o.inv_tau for o in os_}
    return Plan(slots, layout, scales.pop() if mass and len(scales) == 1 else None, keep)
