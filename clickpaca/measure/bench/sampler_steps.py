"""Each sampler step alone on the full vocabulary, beside llama.cpp's C sampler.

Both sides get the same candidate sets: every token of a 262,144-token synthetic row
(``clickpaca.sampling.bench.synthetic_row``), as a step sees them when it is the first
truncation and has no superset hook. Ours: the step's definition (steps.py / dry.py)
on (ids, float64 logits). llama.cpp's: ``llama_sampler_apply`` through the bindings on
a fresh ``llama_token_data_array`` per call (the copy of the row into it is included,
as in llama.cpp's own test-sampling.cpp bench; the copy alone is measured too, and the
ratio is ours / (llama.cpp's - the copy)). Also a whole sample call of a chain of just
that step (``chain_us``): how the chain runs it, through the step's superset hook when
it has one, plus the draw. Thread CPU time per call, best round.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ...sampling import dry as D
from ...sampling import steps as S
from ...sampling.bench import synthetic_row
from ...sampling.oracle import TOKEN_DATA

__all__ = ["step_costs"]

HIST = 256  # context tokens for penalties and DRY


def _cases(n_vocab: int, hist: list[int]) -> dict[str, tuple[Callable, tuple]]:
    """step -> (our call on (ids, logits), (llama_sampler_init_<name>, args))."""
    tok, cnt = np.unique(np.asarray(hist[-64:], np.int32), return_counts=True)
    return {
        "top_k": (lambda i, l: S.top_k(i, l, 40), ("top_k", 40)),
        "top_p": (lambda i, l: S.top_p(i, l, 0.95), ("top_p", 0.95, 0)),
        "min_p": (lambda i, l: S.min_p(i, l, 0.05), ("min_p", 0.05, 0)),
        "temperature": (lambda i, l: S.temperature(i, l, 0.7), ("temp", 0.7)),
        "penalties": (lambda i, l: S.penalties(i, l, tok, cnt.astype(np.float64), 1.1, 0.1, 0.1),
                      ("penalties", n_vocab, 64, 1.1, 0.1, 0.1)),
        "dry": (lambda i, l: D.apply(i, l, *D.dry_penalties(hist, 0.8, 1.75, 2, -1, {})),
                ("dry", None, 0.8, 1.75, 2, HIST, None, 0)),
        "top_n_sigma": (lambda i, l: S.top_n_sigma(i, l, 1.0), ("top_n_sigma", 1.0)),
        "typical_p": (lambda i, l: S.typical_p(i, l, 0.9), ("typical", 0.9, 0)),
        "xtc": (lambda i, l: S.xtc(i, l, 1.0, 0.1, 0.0), ("xtc", 1.0, 0.1, 0, 1)),
        "dynatemp": (lambda i, l: S.dynatemp(i, l, 0.7, 0.5, 1.0), ("temp_ext", 0.7, 0.5, 1.0)),
        "mirostat": (lambda i, l: S.mirostat(i, l, 10.0, 100, n_vocab), ("mirostat", n_vocab, 1, 5.0, 0.1, 100)),
        "mirostat_v2": (lambda i, l: S.mirostat_v2(i, l, 10.0), ("mirostat_v2", 1, 5.0, 0.1)),
    }


#: step -> the params that turn it on, alone in ``samplers`` (the chain's way of running it)
CHAIN_PARAMS = {
    "top_k": {"top_k": 40}, "top_p": {"top_p": 0.95}, "min_p": {"min_p": 0.05},
    "temperature": {"temperature": 0.7},
    "penalties": {"penalty_repeat": 1.1, "penalty_freq": 0.1, "penalty_present": 0.1},
    "dry": {"dry_multiplier": 0.8, "dry_sequence_breakers": ()}, "top_n_sigma": {"top_n_sigma": 1.0},
    "typical_p": {"typical_p": 0.9}, "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.1},
    "dynatemp": {"temperature": 0.7, "dynatemp_range": 0.5}, "mirostat": {"mirostat": 1},
    "mirostat_v2": {"mirostat": 2},
}


def _chain(name: str, row: np.ndarray, hist: list[int]) -> Callable[[], Any]:
    """One sample call of a chain of just this step (its superset hook used if it has one)."""
    from ...sampling import SamplerParams, SequenceSampler

    s = SequenceSampler(SamplerParams(samplers=[name], seed=0, **CHAIN_PARAMS[name]), row.size, hist)
    return lambda: s.sample(row)


def _best(f: Callable[[], Any], repeats: int, rounds: int) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(repeats):
            f()
        best = min(best, (time.thread_time_ns() - t0) / repeats / 1e3)
    return best


def step_costs(nat: Any | None, n_vocab: int = 262_144, repeats: int = 5, rounds: int = 3,
               seed: int = 0) -> dict[str, dict[str, float | None]]:
    """{step: {"ours_us", "llama_us", "llama_net_us", "ratio"}} (llama.cpp's figures None
    without a build: nat None), plus "(array fill)": the copy alone."""
    rng = np.random.default_rng(seed)
    row = synthetic_row(rng, n_vocab)
    ids = np.arange(n_vocab, dtype=np.int32)
    logits = row.astype(np.float64)
    hist = rng.integers(0, 64, HIST).tolist()  # few distinct tokens: DRY finds repeats
    out: dict[str, dict[str, float | None]] = {}
    copy_us = None
    if nat is not None:  # filling the C array alone: part of every llama.cpp figure below
        buf0 = nat.ffi.new("llama_token_data[]", n_vocab)
        view0 = np.frombuffer(nat.ffi.buffer(buf0), TOKEN_DATA)
        src0 = np.empty(n_vocab, TOKEN_DATA)
        src0["id"], src0["logit"], src0["p"] = ids, row, 0.0
        copy_us = _best(lambda: view0.__setitem__(slice(None), src0), repeats, rounds)
    for name, (ours, (init, *args)) in _cases(n_vocab, hist).items():
        o = _best(lambda: ours(ids, logits), repeats, rounds)
        c = None
        if nat is not None:
            ffi, lib = nat.ffi, nat.lib
            args = [ffi.NULL if a is None else a for a in args]
            smpl = getattr(lib, f"llama_sampler_init_{init}")(*args)
            for t in hist:
                lib.llama_sampler_accept(smpl, t)
            buf = ffi.new("llama_token_data[]", n_vocab)
            view = np.frombuffer(ffi.buffer(buf), TOKEN_DATA)
            src = np.empty(n_vocab, TOKEN_DATA)
            src["id"], src["logit"], src["p"] = ids, row, 0.0
            arr = ffi.new("llama_token_data_array *")

            def apply() -> None:
                view[:] = src
                arr.data, arr.size, arr.selected, arr.sorted = buf, n_vocab, -1, False
                lib.llama_sampler_apply(smpl, arr)
            c = _best(apply, repeats, rounds)
            lib.llama_sampler_free(smpl)
        net = None if c is None else max(c - copy_us, 1.0)
        ch = _best(_chain(name, row, hist), repeats, rounds)
        out[name] = {"ours_us": round(o, 1), "chain_us": round(ch, 1),
                     "chain_ratio": None if net is None else round(ch / net, 2),
                     "llama_us": None if c is None else round(c, 1),
                     "llama_net_us": None if net is None else round(net, 1),
                     "ratio": None if net is None else round(o / net, 2)}
    out["(array fill)"] = {"ours_us": None, "chain_us": None, "chain_ratio": None, "llama_us": None if copy_us is None else round(copy_us, 1),
                           "llama_net_us": None, "ratio": None}
    return out
