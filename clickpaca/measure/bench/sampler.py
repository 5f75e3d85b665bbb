"""`clickpaca bench sampler`: microseconds per token per sequence of the sampler chain.

Reuses clickpaca.sampling's microbenchmark (`clickpaca.sampling.bench.microbench`:
thread CPU time per `SequenceSampler.sample` call and per stage, best of `--repeats`
rounds, on synthetic rows shaped like Gemma 3 270M's, 262,144 tokens). Then runs the
same scenarios on REAL logits rows of the model (the first tokens of a public-domain
play) as a check that the synthetic rows are representative; wall time is shown too.
Then each step alone on the full vocabulary beside llama.cpp's C sampler
(`sampler_steps.py`). --seqs: the host's time per tick beside the decode (sampler_ticks.py);
--against REV: an earlier commit's sampling beside this tree's (sampler_against.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...sampling import SequenceSampler
from ...sampling import fastpath
from ...sampling.bench import SCENARIOS, microbench, preselect_cost, random_mask
from ...sampling.registry import CONSTRAINT, ELEMENTWISE, SCALE, TRUNCATION, steps as registered_steps
from ..common import out_dir, png, with_defaults
from .sampler_steps import step_costs
from ...results.report import emit, machine, plot_points
from ...results.stats import progress
from ...results.table import markdown

N_VOCAB = 262_144
SYNTH_REPEATS = 100  # sample calls per round on synthetic rows
REAL_ROWS = 64  # real logits rows
STEP_REPEATS = 5  # calls per round of each step on the full vocabulary


def step_order() -> tuple[str, ...]:
    """Timing stages in the order a default chain meets them: the steps before the cut
    (grammar, elementwise), the cut, the truncations and temperature, then sampling and
    logprobs (the registry's rows now)."""
    rows = registered_steps()
    return (*(s.name for s in rows if s.kind in (CONSTRAINT, ELEMENTWISE)), "cut",
            *(s.name for s in rows if s.kind in (TRUNCATION, SCALE)), "sample", "probs")


def real_rows(n_rows: int, model_path: str | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Logits rows of the model over the start of a public-domain play (None if unavailable)."""
    try:
        from ...llama import core
        from ...llama.models import resolve_model
        from ..texts import read_text

        text, _ = read_text(None)
        model = core.Model(resolve_model(model_path))
        ctx = core.Context(model, n_ctx=512, n_batch=256, n_seq_max=1)
        toks = model.tokenize(text[:4000])[:n_rows]
        batch = core.Batch(model.nat, 256)
        batch.add(toks, 0, 0, output_all=True)
        rows = None
        if ctx.decode(batch) == 0:
            rows = np.array(ctx.logits(), dtype=np.float32, copy=True)
        ctx.close()
        model.close()
        return (rows, np.asarray(toks)) if rows is not None else None
    except Exception as e:  # noqa: BLE001 - the synthetic part still runs
        progress(f"sampler: real logits unavailable ({e})")
        return None


def on_rows(rows: np.ndarray, hist: np.ndarray, rounds: int) -> dict[str, dict[str, float]]:
    """Per scenario: best-round CPU and wall us per token over the given rows."""
    rng = np.random.default_rng(0)
    out = {}
    for name, (params, density) in SCENARIOS.items():
        mask = random_mask(rng, N_VOCAB, density) if density is not None else None
        s = SequenceSampler(params.replace(seed=0), N_VOCAB, hist[:64].tolist())
        for r in rows[:2]:
            s.sample(r, mask)
        cpu = wall = float("inf")
        for _ in range(rounds):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for r in rows:
                s.sample(r, mask)
            cpu = min(cpu, (time.thread_time_ns() - c0) / len(rows) / 1e3)
            wall = min(wall, (time.perf_counter_ns() - w0) / len(rows) / 1e3)
        out[name] = {"chain_cpu": round(cpu, 1), "chain_wall": round(wall, 1)}
        if fastpath.route(s, mask is not None) is None:  # the host's work with the decode's pre-selection
            cost, missed = preselect_cost(s, list(rows), rounds, mask)
            out[name].update({"preselect_cpu": round(cost, 1), "preselect_whole_rows": missed})
    return out


def measure(args: Any) -> dict[str, Any]:
    m0 = machine()
    rounds = max(1, int(args.repeats))
    progress("sampler: clickpaca.sampling.bench.microbench (synthetic rows)")
    synth = microbench(n_vocab=N_VOCAB, repeats=SYNTH_REPEATS, rounds=rounds)
    progress("sampler: the same scenarios on real logits rows")
    real = real_rows(REAL_ROWS, getattr(args, "model", None))
    real_res = on_rows(real[0], real[1], rounds) if real is not None else {}
    progress("sampler: the host's whole share of the pre-selection on a real decode of 64 sequences")
    host = _preselect_host(getattr(args, "model", None), rounds)
    progress("sampler: each step alone on the full vocabulary, beside llama.cpp's C sampler")
    steps = step_costs(_native(getattr(args, "build", None)), N_VOCAB, STEP_REPEATS, rounds)
    results = []
    for name, (params, density) in SCENARIOS.items():
        r = synth.get(name, {})
        results.append({"scenario": name, "params": params.to_request(), "mask_density": density,
                        "us_per_token": r.get("chain"), "us_per_token_batched64": r.get("batched"),
                        "us_per_token_preselect64": r.get("preselect"),
                        "preselect_whole_rows": r.get("preselect_whole_rows"),
                        "steps_us": {k: v for k, v in r.items()
                                     if k not in ("chain", "batched", "preselect", "preselect_whole_rows")},
                        "real_rows": real_res.get(name), "preselect_real_decode": host.get(name)})
    return {"params": {"n_vocab": N_VOCAB, "rounds": rounds, "synthetic_repeats": SYNTH_REPEATS,
                       "real_rows": 0 if real is None else len(real[0])},
            "machine_start": m0, "calibration_us": synth.get("calibration"), "results": results,
            "steps": steps,
            "notes": ["us/token = thread CPU time of one SequenceSampler.sample call (one sequence, "
                      "one token), best round; from clickpaca.sampling.bench.microbench (synthetic rows "
                      "shaped like Gemma 3 270M's); stages from its per-stage timer",
                      "real rows: the same scenarios on real logits rows of the model (CPU and wall)",
                      f"calibration (one np.max / np.exp over a row): {synth.get('calibration')} us",
                      "steps: each step alone on all 262,144 tokens (as the first truncation with no "
                      "superset hook), ours against llama_sampler_apply on the same set; llama.cpp's "
                      "figure includes filling its array, 'net' subtracts the fill; chain = one sample "
                      "call of a chain of just that step (superset hook used where the row has one, "
                      "plus the draw)",
                      "trace: the default chain with trace on (its 'trace' stage is the trace's cost)",
                      "preselect: thread CPU per row of the host's work when the decode pre-selects the "
                      "values (init preselect): fastpath.order before the decode and fastpath.sample_tick "
                      "after it, for a tick of 64 rows; the graph's own work is part of the decode (bench "
                      "batch --preselect measures it); 'whole rows': rows of that tick whose values could "
                      "not decide (they take the host path on the whole row, not timed here)",
                      "preselect, real decode: the host's whole share per pre-selected row on a real "
                      "decode of 64 sequences of the default model (measure/bench/preselect_host.py): "
                      "order + the callbacks that compose the graph's ops and upload their inputs + "
                      "read (decoding the packed rows) + sample_tick; real rows preselect is the "
                      "like-for-like of the host path's real rows (docs/BENCHMARKS.md, 'Sampler host cost per token')",
                      "again: read + sample repeated at once on the same packs, the same work without "
                      "the decode's eviction of the host core's caches (a CPU build's decode runs on the "
                      "cores the host samples on; read + sample less 'again' is their refill)"]}


def table(out: dict[str, Any]) -> str:
    seen = {k for r in out["results"] for k in r["steps_us"]}
    order = step_order()
    steps = [k for k in order if k in seen] + sorted(seen - set(order))
    rows = []
    for r in out["results"]:
        real = r.get("real_rows") or {}
        rows.append([r["scenario"], r["us_per_token"], r.get("us_per_token_batched64"),
                     r.get("us_per_token_preselect64"), real.get("chain_cpu"), real.get("chain_wall"),
                     real.get("preselect_cpu"), real.get("preselect_whole_rows"),
                     _host_cell(r.get("preselect_real_decode"))]
                    + [r["steps_us"].get(k) for k in steps])
    return markdown(["scenario", "us/token (synthetic, CPU)", "batched, 64 rows", "preselect, 64 rows",
                     "real rows CPU", "real rows wall", "real rows preselect", "preselect whole rows (of 64)",
                    "preselect, real decode: total (order + callbacks + read + sample; again)"]
                    + [f"{k}" for k in steps], rows)


def _preselect_host(model: str | None, rounds: int) -> dict[str, dict]:
    """preselect_host.measure, or {} when there is no model or build to run it on."""
    try:
        from . import preselect_host

        return preselect_host.measure(model, rounds=rounds)
    except Exception as e:  # noqa: BLE001 - the other columns still run
        progress(f"sampler: no real decode for the pre-selection's host share ({e})")
        return {}


def _host_cell(h: dict | None) -> str | None:
    """'total (order + callbacks + read + sample)' of one scenario, or None."""
    if not h:
        return None
    again = f"; again {h['again']}" if "again" in h else ""
    return f"{h['total']} ({h['order']} + {h['callbacks']} + {h['read']} + {h['sample']}{again})"


def _native(build: str | None):
    """The build's bindings for llama.cpp's side (None: that column stays empty)."""
    try:
        from ...llama import native

        return native.load(build or "mainline")
    except Exception as e:  # noqa: BLE001 - our side still runs
        progress(f"sampler: no llama.cpp build for the step comparison ({e})")
        return None


def steps_table(out: dict[str, Any]) -> str:
    rows = [[k, v["ours_us"], v["chain_us"], v["llama_us"], v["llama_net_us"], v["ratio"], v["chain_ratio"]]
            for k, v in out.get("steps", {}).items()]
    return markdown(["step (262,144 candidates)", "clickpaca step us", "clickpaca chain us",
                     "llama.cpp us (with fill)", "llama.cpp net us", "step / net", "chain / net"], rows)


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args)
    if getattr(args, "against", None):
        return run_against(args)
    seqs = getattr(args, "seqs", None)
    if seqs:  # --seqs: host time per tick beside the decode of the same tick
        from . import sampler_ticks

        out = {"params": {"seqs": seqs, "ticks": sampler_ticks.TICKS}, "machine_start": machine(),
               "ticks": sampler_ticks.measure([int(x) for x in str(seqs).split(",")],
                                              getattr(args, "model", None), getattr(args, "threads", None)),
               "notes": ["per tick: one llama_decode of one token per sequence (wall, median of the ticks) "
                         "and the host's sampling of its [n, 262144] logits block: one "
                         "SequenceSampler.sample per row (per_seq), sampling.batch.sample_tick on one "
                         "thread (batched) and on the decode's threads (threads), the same results "
                         "checked; host / decode = wall over wall; CPU figures in the JSON "
                         "(<side>_cpu_ms: this thread, <side>_proc_cpu_ms: every thread)"]}
        emit(out_dir(args), "sampler", out, sampler_ticks.table(out["ticks"]),
             "Sampler host time per tick beside the decode (262,144 vocab)")
        return out
    out = measure(args)
    emit(out_dir(args), "sampler", out, table(out) + "\n\n" + steps_table(out),
         "Sampler chain, microseconds per token per sequence (262,144 vocab)")
    if args.plot:
        pts = [(r["scenario"], i, r["us_per_token"]) for i, r in enumerate(out["results"])]
        plot_points(png(args, "sampler"), pts, "scenario #", "microseconds per token (CPU)",
                    "Sampler chain cost per token per sequence")
    return out


def run_against(args: Any) -> dict[str, Any]:
    """--against REV: REV's sampling beside this tree's (sampler_against.py), on the ticks of
    --seqs or on the microbenchmark and real rows."""
    from . import sampler_against as A
    from . import sampler_ticks

    rev, t = args.against, int(getattr(args, "threads", None) or 2)
    seqs = getattr(args, "seqs", None)
    params = {"against": rev, "threads": t, "rounds": int(args.repeats), "seqs": seqs}
    if seqs:
        n_ticks = max(sampler_ticks.TICKS, int(args.repeats))
        ticks = A.ticks(rev, [int(x) for x in str(seqs).split(",")], t, n_ticks)
        out = {"params": {**params, "ticks": n_ticks}, "machine_start": machine(), "ticks": ticks,
               "notes": [f"old = {rev}'s clickpaca/sampling, new = this tree's, each side on samplers of its "
                         "own over the same logits of every tick, results checked equal (the fields both "
                         f"result types have); {n_ticks} ticks (--repeats, at least {sampler_ticks.TICKS}), the "
                         "order of the sides turned each tick; host ms: wall, medians of the ticks; new / old: "
                         "per tick, median (min-max)"]}
        emit(out_dir(args), "sampler-against", out, A.ticks_table(ticks),
             f"Sampler host time per tick, {rev} (old) against this tree (new)")
        return out
    res, cal = A.compare(rev, real_rows(REAL_ROWS, getattr(args, "model", None)), int(args.repeats), t)
    out = {"params": params, "machine_start": machine(), "chains": A.summary(res), "samples": res,
           "calibration_us": cal,
           "notes": [f"old = {rev}'s clickpaca/sampling, new = this tree's, alternating round by round (the "
                     "side that goes first turned each round); us per token per sequence, medians of the rounds: "
                     "synthetic rows (CPU), 64 real rows (CPU), one sample_tick over them (CPU and wall; new also "
                     f"on {t} threads); new / old: per round, median (min-max)"]}
    emit(out_dir(args), "sampler-against", out, A.table(res, cal),
         f"Sampler chain, {rev} (old) against this tree (new), us per token per sequence")
    return out
