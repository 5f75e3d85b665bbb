"""What reading and steering cost a decode: no callback, a callback declining every node,
one layer captured, and a context-wide control vector on every layer (no callback).

`python -m clickpaca.activations.cost`: greedy-free decode steps (the argmax of each row fed
back) of `--seqs` sequences, one token each per llama_decode, through core; the
setups alternate round by round on contexts of the same settings, so the machine's
load falls on all of them alike. Prints tokens/s per setup, median (min-max) over rounds,
by the wall clock and per CPU second of this process (all its threads: on a machine
loaded by others the wall clock mostly measures the waiting, the CPU time what the
setup itself costs).

`--slots` (the activations build): each sequence steered by its own one of 8 registered
vectors on every layer (the K slots, activations/steering.py), then the same with a gate,
against no steering; the ratio per round is each setup's rate over no steering's.

`--steer` (the activations build): the same decode steps with no vector, with a vector on
1 of the sequences and on all of them (per-sequence strengths, native/activations), and
with upstream's context-wide vector on all of them.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from ..llama import core
from . import steer
from .capture import Capture

SETUPS = ("no callback", "callback, nothing captured", "capture l_out-L every token",
          "context-wide vector, all layers")


def run(model_path: str, seqs: int = 8, steps: int = 32, rounds: int = 5, layer: int = 9,
        threads: int = 2, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Tokens/s by the wall clock per setup and round; per CPU second into `cpu` if given."""
    model = core.Model(model_path)
    caps = [None, Capture(model.nat), Capture(model.nat), None]
    ctxs = [core.Context(model, n_ctx=2048, n_batch=256, n_seq_max=seqs, n_threads=threads,
                         eval_callback=c.callback if c else None) for c in caps]
    rng = np.random.default_rng(0)
    steer.apply(ctxs[3], {il: rng.normal(scale=0.01, size=model.n_embd).astype(np.float32)
                          for il in range(1, model.n_layer)})
    prompt = model.tokenize("The history of the city begins")
    return _rounds(model, ctxs, SETUPS, rounds, cpu,
                   lambda name, ctx: _decode_rate(model, ctx, prompt, seqs, steps, layer=layer,
                                                  capture=caps[2] if name == SETUPS[2] else None))


def _rounds(model: core.Model, ctxs: list, names: tuple[str, ...], rounds: int,
            cpu: dict[str, list[float]] | None, rate) -> dict[str, list[float]]:
    """Each setup in turn, round after round (`rate(name, ctx)` -> (wall, per CPU)):
    tokens/s by the wall clock per setup, per CPU second into `cpu`; then close them all."""
    out: dict[str, list[float]] = {s: [] for s in names}
    for _ in range(rounds):
        for name, ctx in zip(names, ctxs):
            wall, per_cpu = rate(name, ctx)
            out[name].append(wall)
            if cpu is not None:
                cpu.setdefault(name, []).append(per_cpu)
    for c in ctxs:
        c.close()
    model.close()
    return out


STEER_SETUPS = ("no vector", "vector on 1 sequence", "vector on every sequence",
                "context-wide vector (upstream)")


def run_steer(model_path: str, seqs: int = 8, steps: int = 32, rounds: int = 5, layers: tuple[int, int] = (4, 9),
              threads: int = 2, strength: float = 2.0) -> dict[str, list[float]]:
    """Tokens/s per STEER_SETUPS setup and round (the activations build)."""
    from ..llama import features

    model = core.Model(model_path, build="activations")
    if not features.available(model.nat, "cvec-seq"):
        raise SystemExit(f"build {model.nat.name!r} lacks per-sequence control vectors (make activations)")
    rng = np.random.default_rng(0)
    dirs = {il: rng.normal(scale=0.01, size=model.n_embd).astype(np.float32) for il in range(1, model.n_layer)}
    ctxs = [core.Context(model, n_ctx=2048, n_batch=256, n_seq_max=seqs, n_threads=threads) for _ in STEER_SETUPS]
    lib = model.nat.lib
    for i in (1, 2):
        steer.apply(ctxs[i], dirs, 1.0, layers)
        for s in range(seqs):
            lib.llama_set_adapter_cvec_seq(ctxs[i].ptr, s, strength if (i == 2 or s == 0) else 0.0)
    steer.apply(ctxs[3], dirs, strength, layers)
    prompt = model.tokenize("The history of the city begins")
    out: dict[str, list[float]] = {s: [] for s in STEER_SETUPS}
    for _ in range(rounds):
        for name, ctx in zip(STEER_SETUPS, ctxs):
            out[name].append(_decode_rate(model, ctx, prompt, seqs, steps)[0])
    for c in ctxs:
        c.close()
    model.close()
    return out


SLOT_SETUPS = ("no steering", "8 vectors, all layers", "8 vectors, all layers, gated")


def run_slots(model_path: str, seqs: int = 8, steps: int = 32, rounds: int = 5, threads: int = 2,
              strength: float = 2.0, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Tokens/s per SLOT_SETUPS setup and round (the activations build's K slots,
    activations/steering.py): 8 registered vectors, sequence s steered by vector s % 8 on
    every layer; gated: the same with a `when` per sequence (vector (s+1) % 8, layer 6,
    above 0). One context per setup, the same settings."""
    from ..llama import features
    from .steering import Steering
    from .wire import Gate, SteerEntry

    model = core.Model(model_path, build="activations")
    if not features.available(model.nat, "steer-slots"):
        raise SystemExit(f"build {model.nat.name!r} lacks steering slots (make activations)")
    rng = np.random.default_rng(0)
    prompt = model.tokenize("The history of the city begins")
    ctxs = [core.Context(model, n_ctx=max(2048, 64 * seqs), n_batch=max(256, seqs * len(prompt)), n_seq_max=seqs,
                         n_threads=threads) for _ in SLOT_SETUPS]
    for i in (1, 2):
        st = Steering(ctxs[i], 8)
        for v in range(8):
            st.register("bench", f"v{v}", tuple((il, rng.normal(scale=0.01, size=model.n_embd).astype("<f4").tobytes())
                                                for il in range(1, model.n_layer)))
        for s in range(seqs):
            when = Gate(f"v{(s + 1) % 8}", 6, 0.0) if i == 2 else None
            rs = st.for_request("bench", (SteerEntry(f"v{s % 8}", strength, when=when),), model.detokenize)
            rs.begin(s, list(prompt))
    return _rounds(model, ctxs, SLOT_SETUPS, rounds, cpu,
                   lambda name, ctx: _decode_rate(model, ctx, prompt, seqs, steps))


def _decode_rate(model: core.Model, ctx: core.Context, prompt, seqs: int, steps: int,
                 capture: Capture | None = None, layer: int = 0) -> tuple[float, float]:
    """Tokens/s of `steps` one-token decodes of `seqs` sequences after a shared prompt, by
    the wall clock and per CPU second of this process; with a `capture`, each decode's
    l_out-<layer> rows of every sequence are armed and taken."""
    ctx.clear()
    batch = core.Batch(model.nat, max(256, seqs * len(prompt)))
    for s in range(seqs):
        batch.add(prompt, 0, s)
    assert ctx.decode(batch) == 0
    toks = ctx.logits().argmax(axis=1)
    pos = len(prompt)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batch.clear()
        for s in range(seqs):
            batch.add([int(toks[s])], pos, s)
        if capture is not None:
            capture.arm([f"l_out-{layer}"], {s: [s] for s in range(seqs)}, batch)
        assert ctx.decode(batch) == 0
        if capture is not None:
            capture.take()
        toks = ctx.logits().argmax(axis=1)
        pos += 1
    return seqs * steps / (time.perf_counter() - t0), seqs * steps / (time.process_time() - c0)


def main() -> None:
    from ..llama.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layer", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steer", action="store_true", help="steering setups instead (the activations build)")
    ap.add_argument("--slots", action="store_true", help="each sequence its own vector (K slots), with and "
                                                         "without a gate (the activations build)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    cpu: dict[str, list[float]] = {}
    if a.slots:
        res = run_slots(str(resolve_model()), a.seqs, a.steps, a.rounds, threads=a.threads, cpu=cpu)
    elif a.steer:
        res = run_steer(str(resolve_model()), a.seqs, a.steps, a.rounds, threads=a.threads)
    else:
        res = run(str(resolve_model()), a.seqs, a.steps, a.rounds, a.layer, a.threads, cpu)
    print(f"{a.seqs} sequences, {a.steps} decode steps per round, {a.rounds} alternating rounds, "
          f"{a.threads} threads, load {os.getloadavg()[0]:.2f}")
    for label, table in (("tok/s", res), ("tok/CPU-s", cpu)):
        if not table:
            continue  # --steer measures the wall clock only
        first = next(iter(table.values()))  # the first setup: no callback, or no vector
        base = float(np.median(first))
        for name, v in table.items():
            med = float(np.median(v))
            paired = np.asarray(v) / np.asarray(first)  # round by round: the load falls on both
            print(f"  {name.replace('L', str(a.layer)):32s} {med:7.1f} {label} ({min(v):.1f}-{max(v):.1f})  "
                  f"ratio {med / base:.3f}, per round {float(np.median(paired)):.3f} "
                  f"({float(paired.min()):.3f}-{float(paired.max()):.3f})")


if __name__ == "__main__":
    main()
