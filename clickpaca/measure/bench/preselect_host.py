"""The host's whole share of the pre-selection, measured on a real decode.

`bench sampler`'s synthetic "preselect" column times `fastpath.order_many` and
`fastpath.sample_tick` on numpy's reference of the graph's values. A real tick has two more
host parts, both timed here: the callbacks llama.cpp makes into Python while it builds the
graph (`Presampler.cost["callback_ns"]`) and decoding the packed rows
(`Presampler.read_many`). Each is thread CPU time per pre-selected row, the best of the
rounds, for a tick of N sequences of one scenario on the default model. "again" repeats
read + sample at once on the same packs: the difference is the refill of the host core's
caches that a CPU build's decode evicted. The ticks run as served (each token accepted),
and timing starts once every sequence's K has settled. The decode's own time is
`preselect_ops`'s measurement.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...llama import core, native
from ...llama.models import resolve_model
from ...llama.presample import Presampler
from ...sampling import fastpath
from ...sampling.bench import SCENARIOS, random_mask
from ...sampling.chain import SequenceSampler

PROMPT = "The capital of France is"
PARTS = ("order", "callbacks", "read", "sample")
#: warm-up ticks at most (K doubles from K_MIN to K_MAX in five)
WARM_MAX = 6


def measure(model_path: str | None = None, n: int = 64, rounds: int = 3, threads: int = 2,
            scenarios: dict | None = None) -> dict[str, dict[str, Any]]:
    """{scenario: {order, callbacks, read, sample, total, again: us per row; whole_rows:
    rows of the last tick whose values could not decide}} for every scenario the fast
    path takes."""
    nat = native.load("mainline")
    model = core.Model(resolve_model(model_path), nat=nat)
    scenarios = scenarios or SCENARIOS
    toks = model.tokenize(PROMPT).tolist()
    ps = Presampler(nat, model.n_vocab, n)
    ticks = (rounds + WARM_MAX) * len(scenarios)
    ctx = core.Context(model, n_ctx=n * (len(toks) + ticks + 8), n_batch=max(512, n * len(toks)), n_seq_max=n,
                       n_threads=threads, presampler=ps)
    out: dict[str, dict[str, Any]] = {}
    try:
        batch = core.Batch(nat, max(512, n * len(toks)))
        for s in range(n):
            batch.add(toks, 0, s, output_last=True)
        if ctx.decode(batch) != 0:
            raise RuntimeError("prefill failed")
        pos = len(toks)
        rng = np.random.default_rng(0)
        slots = list(range(n))
        for name, (params, density) in scenarios.items():
            mask = random_mask(rng, model.n_vocab, density) if density is not None else None
            samplers = [SequenceSampler(params.replace(seed=i), model.n_vocab, toks) for i in range(n)]
            if fastpath.route(samplers[0], mask is not None) is not None:
                continue
            ks = [fastpath.K_MIN] * n
            nxt = [1000 + s for s in slots]  # each sequence's next token (the decode's input)
            best: tuple = ()
            whole = warm = timed = 0
            while timed < rounds:
                t0 = time.thread_time_ns()
                ps.order(dict(zip(slots, fastpath.order_many(samplers, [mask] * n, ks))))
                t_order = time.thread_time_ns() - t0
                forks = [sm.fork() for sm in samplers]  # for "again" (before the decode: not after it)
                batch.clear()
                for s in slots:
                    batch.add([nxt[s]], pos, s, output_last=True)
                pos += 1
                if ctx.decode(batch) != 0:
                    raise RuntimeError("decode failed")
                t0 = time.thread_time_ns()
                pres = ps.read_many(slots, slots, n)
                t_read = time.thread_time_ns() - t0
                t0 = time.thread_time_ns()
                res = fastpath.sample_tick(samplers, pres, [mask] * n)
                t_sample = time.thread_time_ns() - t0
                t0 = time.thread_time_ns()
                fastpath.sample_tick(forks, ps.read_many(slots, slots, n), [mask] * n)
                t_again = time.thread_time_ns() - t0
                parts = tuple(ns / n / 1e3 for ns in (t_order, ps.cost["callback_ns"], t_read, t_sample))
                new_ks = [min(2 * k, fastpath.K_MAX) if r == fastpath.PAST_K else k for k, r in zip(ks, res)]
                # Warm-up until every K has settled (it only grows, as the engine's does:
                # each change is a new plan, so a graph built again), then `rounds` timed.
                if warm < WARM_MAX and (warm == 0 or new_ks != ks):
                    warm += 1
                else:
                    timed += 1
                    if not best or sum(parts) < sum(best):
                        best, again = parts, t_again / n / 1e3
                    whole = sum(isinstance(r, str) for r in res)
                ks = new_ks
                for s, r, sm in zip(slots, res, samplers):
                    if isinstance(r, str):  # a row the values could not decide: its draw, as the host would
                        sm.draw()
                    else:
                        nxt[s] = r.token
                    sm.accept(nxt[s])  # the token enters the context, and the penalty window, as served
            row = {k: round(v, 1) for k, v in zip(PARTS, best)}
            row["total"] = round(sum(best), 1)
            row["again"] = round(again, 1)
            row["whole_rows"] = whole
            out[name] = row
    finally:
        ctx.close()
        model.close()
    return out
