"""Microbenchmark of the sampler chain on synthetic rows (backs ``clickpaca bench sampler``).

Times are thread CPU time (not wall time), so another process on a shared machine
inflates them less; they are per sampled token, in microseconds, best of a few rounds.
The synthetic rows mimic Gemma 3 270M's (see ``synthetic_row``).
"""

from __future__ import annotations

import time

import numpy as np

from .batch import sample_tick
from .chain import SequenceSampler
from .params import SamplerParams

__all__ = ["SCENARIOS", "microbench", "format_bench", "synthetic_row"]


def synthetic_row(rng: np.random.Generator, n_vocab: int) -> np.ndarray:
    """Shaped like Gemma 3 270M's rows (measured: max ~20, mean ~-3, sd ~5, top
    probability 0.1-0.99, 95% nucleus 1-3000 tokens): a N(-3, 5^2) bulk, plus 24
    plausible tokens placed from 6 below to 2 above the bulk's maximum."""
    row = (rng.standard_normal(n_vocab) * 5.0 - 3.0).astype(np.float32)
    k = min(24, n_vocab)
    row[rng.choice(n_vocab, k, replace=False)] = row.max() + rng.uniform(-6, 2, k).astype(np.float32)
    return row


def random_mask(rng: np.random.Generator, n_vocab: int, density: float) -> np.ndarray:
    """A grammar bitmask (int32 words) allowing each token with probability ``density``."""
    allowed = np.zeros((n_vocab + 31) // 32 * 32, np.uint8)
    allowed[:n_vocab] = rng.random(n_vocab) < density
    return np.packbits(allowed, bitorder="little").view(np.int32)


#: name -> (params, grammar mask density or None)
SCENARIOS = {
    "default": (SamplerParams(), None),
    "greedy": (SamplerParams(top_k=1), None),
    "top_p_only": (SamplerParams(top_k=0, top_p=0.95), None),
    "grammar_10pct": (SamplerParams(), 0.10),
    "bias_penalties": (SamplerParams(penalty_repeat=1.1, penalty_freq=0.1, penalty_present=0.1,
                                     logit_bias={1: -1e9, 2: 2.0, 106: -1e9, 1000: 5.0, 2000: -3.0}), None),
    "temperature_only": (SamplerParams(top_k=0, top_p=1.0, temperature=0.9), None),
    "n_probs_5": (SamplerParams(n_probs=5), None),
    "trace": (SamplerParams(trace=True), None),  # the default chain with trace on
}


TICK_ROWS = 64


def _tick_cost(s: SequenceSampler, rows: list[np.ndarray], rounds: int) -> float:
    """us per row of ``batch.sample_tick`` over a [64, n_vocab] block (forks of ``s``)."""
    block = np.stack([rows[i & 7] for i in range(TICK_ROWS)])
    forks = [s.fork() for _ in range(TICK_ROWS)]
    idx = list(range(TICK_ROWS))
    sample_tick(forks, block, idx)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        sample_tick(forks, block, idx)
        best = min(best, (time.thread_time_ns() - t0) / TICK_ROWS / 1e3)
    return best


def preselect_cost(s: SequenceSampler, rows: list[np.ndarray], rounds: int,
                    mask: np.ndarray | None) -> tuple[float, int]:
    """(us per row, rows the values could not decide) of the host's work on the
    pre-selection path for a tick of 64 forks of ``s``: the rows' orders before the
    decode (fastpath.order_many, as the engine makes them) and the draws from their
    pre-selected values after it (fastpath.sample_tick). What the graph computes (presample.reference stands in for
    it here) is the decode's work, not timed. A row whose values cannot decide would
    take the host path on its whole row: counted, not timed."""
    from ..llama.presample import reference
    from . import fastpath

    best, missed = float("inf"), 0
    ks = [fastpath.K_MIN] * TICK_ROWS  # each sequence's K, doubled after a miss as the engine does
    # each sequence its own seed, as requests have (a tick must batch them all the same);
    # the sequences live through the rounds as a server's do (what a sequence makes once,
    # when it starts, is not a token's work), each taking in the token it drew
    forks = [SequenceSampler(s.params.replace(seed=(s.params.seed or 0) + i), s.n_vocab, list(s.history))
             for i in range(TICK_ROWS)]
    for _ in range(rounds + 1):  # the first round warms up (and lets K adapt)
        t0 = time.thread_time_ns()
        orders = fastpath.order_many(forks, [mask] * TICK_ROWS, ks)
        t_order = time.thread_time_ns() - t0
        pres = [reference(rows[i % len(rows)], o) for i, o in enumerate(orders)]  # each row's own K (read)
        t0 = time.thread_time_ns()
        res = fastpath.sample_tick(forks, pres, [mask] * TICK_ROWS)
        t_sample = time.thread_time_ns() - t0
        best = min(best, (t_order + t_sample) / TICK_ROWS / 1e3)
        missed = sum(isinstance(r, str) for r in res)
        ks = [min(2 * k, fastpath.K_MAX) if r == fastpath.PAST_K else k for k, r in zip(ks, res)]
        for f, r in zip(forks, res):
            if isinstance(r, str):  # a row the values could not decide: its draw, as the host would
                f.draw()
            else:
                f.accept(r.token)
    return best, missed


def microbench(n_vocab: int = 262_144, repeats: int = 200, rounds: int = 3, seed: int = 0,
               scenarios: dict | None = None, batched: bool = True,
               preselect: bool = True) -> dict[str, dict[str, float]]:
    """{scenario: {"chain": us per token, <stage>: us per token, ...}}.

    "chain" is a whole ``SequenceSampler.sample`` call (the best round); the stages come
    from a separate instrumented run (grammar = mask count/extraction, cut = finding the
    candidates in the full row, one entry per step, sample, probs = logprobs).
    "calibration" times one np.max and one np.exp over a row: on a shared machine, read
    the chain as a multiple of those. "batched" (scenarios without a grammar): us per row
    of one ``batch.sample_tick`` over 64 rows (a tick of 64 sequences). "preselect":
    us per row of the host's work when the decode pre-selects each row's values
    (``preselect_cost``), or why the chain takes the host path; "preselect_whole_rows":
    the rows of that tick whose values could not decide (they take the whole row)."""
    rng = np.random.default_rng(seed)
    rows = [synthetic_row(rng, n_vocab) for _ in range(8)]
    history = rng.integers(0, n_vocab, 64).tolist()
    buf = np.empty(n_vocab, np.float32)
    calib = {"row_max": lambda r: r.max(), "row_exp": lambda r: np.exp(r, out=buf)}
    out: dict[str, dict[str, float]] = {"calibration": {}}
    for key, f in calib.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.thread_time_ns()
            for i in range(repeats):
                f(rows[i & 7])
            best = min(best, (time.thread_time_ns() - t0) / repeats / 1e3)
        out["calibration"][key] = round(best, 1)
    for name, (params, density) in (scenarios or SCENARIOS).items():
        mask = random_mask(rng, n_vocab, density) if density is not None else None
        s = SequenceSampler(params.replace(seed=seed), n_vocab, history)
        for r in rows[:2]:
            s.sample(r, mask)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.thread_time_ns()
            for i in range(repeats):
                s.sample(rows[i & 7], mask)
            best = min(best, (time.thread_time_ns() - t0) / repeats / 1e3)
        timings: dict[str, int] = {}
        for i in range(repeats):
            s.sample(rows[i & 7], mask, timings=timings)
        res = {"chain": round(best, 1)}
        res.update({k: round(v / repeats / 1e3, 1) for k, v in timings.items()})
        if batched and mask is None:
            res["batched"] = round(_tick_cost(s, rows, rounds), 1)
        if preselect:
            from . import fastpath
            why = fastpath.route(s, mask is not None)
            if why is None:
                cost, missed = preselect_cost(s, rows, rounds, mask)
                res["preselect"] = round(cost, 1)
                res["preselect_whole_rows"] = missed
            else:
                res["preselect"] = f"host path: {why}"
        out[name] = res
    return out


def format_bench(results: dict[str, dict[str, float]]) -> str:
    """A plain text table: one line per scenario, the chain total then the stages."""
    lines = []
    for name, r in results.items():
        if "chain" not in r:
            lines.append(f"{name:<18} " + "  ".join(f"{k}={v:g} us" for k, v in r.items()))
            continue
        stages = "  ".join(f"{k}={v:g}" if not isinstance(v, str) else f"{k}=({v})"
                           for k, v in r.items() if k != "chain")
        lines.append(f"{name:<18} {r['chain']:>8.1f} us/token   {stages}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m clickpaca.sampling.bench
    print(format_bench(microbench()))
