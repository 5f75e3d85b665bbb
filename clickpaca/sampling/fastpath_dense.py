"""Dense draws (no truncation: a draw over the whole vocabulary) of a tick's
pre-selected rows at once, for ``fastpath.sample_tick``.

``fastpath._dense`` draws one row: the float64 cumulative block masses, the block where
u x total lands (the last one with mass at or before it), then the cumulative masses of
that block (handed back by the graph: ``Preselected.dense``) offset by the mass before
it. `dense_tick` does the same on [m, n_blocks] and [m, BLOCK] matrices, with the same
float64 operations in the same order per row: ``np.add.accumulate`` along a row is the
1-D accumulate (sequential), a right-sided searchsorted on a non-decreasing row is the
count of entries <= the target, and the offset is added after the accumulate as there.
So every row's token is bit for bit ``_dense``'s, and does not depend on the other rows
of the tick (no reduction crosses rows). The uniform is the one ``order`` peeked (in
the order: the graph chose the blocks around it); the row's ``draw`` once the token is
certain must give it back, else (the stream moved since the order) the draw is taken
back and the row goes to ``fastpath.sample``. What stays per row: that draw, the dict
lookup of the block handed back, the result, and, with nProbs, ``fastpath._dense_result``
(the log-probabilities).
"""

from __future__ import annotations

import numpy as np

from .chain import SampleResult, SequenceSampler
from ..llama.presample import BLOCK

__all__ = ["dense_tick"]


def _keep(ok: np.ndarray, js: list[int], out: list, fallback) -> np.ndarray:
    """Rows js[a] where ok[a] is False get ``fallback``; the positions a where it is True."""
    for a in np.flatnonzero(~ok).tolist():
        out[js[a]] = fallback(js[a])
    return np.flatnonzero(ok)


def dense_tick(samplers: list[SequenceSampler], pres: list, js: list[int], out: list, fallback,
               finish) -> None:
    """The dense draw of rows js (route.py's ``ChainPlan.dense`` said yes, the order's temperature is the
    chain's, nothing touched, no grammar, finite top and blocks, blocks of one length).
    A row the matrices cannot decide (no mass, a draw outside the blocks handed back)
    gets ``fallback(j)`` (``fastpath.sample``: the reason, nothing drawn); a row with
    nProbs gets ``finish(j, tok, mass, total)`` (``fastpath._dense_result``); the others
    draw their uniform and get the token."""
    # float64 copies of float32 values (exact), as _dense's astype (concatenate: cheaper than stack)
    blocks = np.concatenate([pres[j].blocks for j in js], dtype=np.float64).reshape(len(js), -1)
    cb = np.add.accumulate(blocks, axis=1)
    total = cb[:, -1]
    # the host's walk assumes masses >= 0 (a non-decreasing cumulative sum): else per row
    ok = (total > 0) & (blocks >= 0).all(axis=1) & np.fromiter(
        (pres[j].dense is not None and pres[j].order.u is not None for j in js), bool, len(js))
    g = _keep(ok, js, out, fallback)
    if not g.size:
        return
    gl = [js[a] for a in g.tolist()]
    blocks, cb, total = blocks[g], cb[g], total[g]
    m, nb = blocks.shape
    rows = np.arange(m)
    # the uniform order() peeked (the graph's blocks around the draw are for it); the
    # stream is checked at the end (a draw that is not it is taken back: SequenceSampler.undraw)
    u = np.fromiter((pres[j].order.u for j in gl), np.float64, m)
    target = u * total
    b = np.minimum((cb <= target[:, None]).sum(axis=1), nb - 1)  # searchsorted(cb, target, "right")
    if not (blocks[rows, b] > 0).all():  # back to the last block with mass (the host's while blocks[b] <= 0)
        b = np.maximum.accumulate(np.where(blocks > 0, np.arange(nb), -1), axis=1)[rows, b]
    chunks = [pres[j].dense.get(bb) for j, bb in zip(gl, b.tolist())]
    have = np.fromiter((c is not None and c.size == BLOCK for c in chunks), bool, m)
    if not have.all():
        keep = _keep(have, gl, out, fallback)
        if not keep.size:
            return
        gl = [gl[x] for x in keep.tolist()]
        chunks = [chunks[x] for x in keep.tolist()]
        b, target, total, cb = b[keep], target[keep], total[keep], cb[keep]
        m = len(gl)
        rows = np.arange(m)
    # in place: the float64 copy becomes the cumulative masses, then offset by the mass before
    within = np.concatenate(chunks, dtype=np.float64).reshape(m, BLOCK)
    np.add.accumulate(within, axis=1, out=within)
    within += np.where(b > 0, cb[rows, b - 1], 0.0)[:, None]
    j = (within <= target[:, None]).sum(axis=1).tolist()  # searchsorted(within, target, "right")
    lost = [False] * m
    for x in range(m):
        if j[x] >= BLOCK:  # past the block's last mass: its last token with mass
            has = np.flatnonzero(chunks[x] > 0)
            lost[x] = not has.size  # no mass in the block (the host's walk fails on it)
            j[x] = int(has[-1]) if has.size else 0
    tok = [bb * BLOCK + jj for bb, jj in zip(b.tolist(), j)]
    mass = [float(c[jj]) for c, jj in zip(chunks, j)]
    tot = total.tolist()
    for x, (jj, t) in enumerate(zip(gl, tok)):
        s = samplers[jj]
        if lost[x]:
            out[jj] = fallback(jj)
        elif s.params.n_probs > 0:  # finish draws only once the log-probabilities are had
            out[jj] = finish(jj, t, mass[x], tot[x]) if s.peek() == pres[jj].order.u else fallback(jj)
        elif (u := s.draw()) == pres[jj].order.u:
            out[jj] = SampleResult(t, n_candidates=s.n_vocab, path="graph")
        else:  # the stream moved since order(): taken back, and the row decided alone
            s.undraw(u)
            out[jj] = fallback(jj)

