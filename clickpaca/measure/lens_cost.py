"""What the logit lens costs, measured through the real server: one sequence generating
greedily with `lens` on every layer against the same request without it, alternating
round by round on one server (docs/ACTIVATIONS.md, "The logit lens"). Also the lens graph
alone: the rows of one generated token (every layer) through activations/lens.py.

    python -m clickpaca.measure.lens_cost [--build B] [--tokens 32] [--rounds 5] [--top 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np

PROMPT = "The history of the river valley begins with"


def _tps(c, lens: dict | None, tokens: int) -> float:
    extra = {"lens": lens} if lens is not None else {}
    t0 = time.perf_counter()
    c.infer(0, PROMPT, temperature=0, maxTokens=tokens, **extra)
    toks, done = c.collect(0)
    if done["type"] != "done":
        raise RuntimeError(done)
    return len(toks) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from ..llama import core
    from ..llama.models import resolve_model
    from ..wire.client import Client
    from ..activations.lens import Lens

    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.lens_cost")
    ap.add_argument("--build", default="mainline")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    c = Client.spawn(python=sys.executable)
    c.init(nCtx=1024, nSeqMax=2, build=a.build, capture=True, nThreads=a.threads,
           stateDir=tempfile.mkdtemp(prefix="clkp-lens-"))
    lens = {"layers": "all", "top": a.top}
    try:
        _tps(c, None, 4), _tps(c, lens, 4)  # warm: the graph listing, the mapped head
        off, on = [], []
        for _ in range(a.rounds):
            off.append(_tps(c, None, a.tokens))
            on.append(_tps(c, lens, a.tokens))
    finally:
        c.close()
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"build {a.build}, capture ready {c.ready.get('capture')}, {a.tokens} tokens, {a.rounds} rounds")
    print(f"no lens      {m_off:7.1f} tok/s ({min(off):.1f}-{max(off):.1f})")
    print(f"lens, all    {m_on:7.1f} tok/s ({min(on):.1f}-{max(on):.1f})  ratio {m_on / m_off:.3f}")
    path = resolve_model()
    m = core.Model(path, build=a.build, n_gpu_layers=0)
    head = Lens(m.nat, path, n_threads=a.threads)
    rows = np.random.default_rng(0).normal(size=(int(m.n_layer), head.n_embd)).astype(np.float32) * 50
    head.apply(rows, a.top)
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        head.apply(rows, a.top)
        ts.append(time.perf_counter() - t0)
    print(f"lens graph alone, {m.n_layer} rows (one token, every layer): {1e3 * statistics.median(ts):.1f} ms "
          f"median of 10; head {head.head_type} {head.mapped_bytes / 2**20:.0f} MiB mapped, not copied")
    head.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
