"""`python -m clickpaca.measure.kvsim`: simulated KV types in the model, against f16 and f32.

The windows are `clickpaca ppl`'s (the same text cut, window size and count, second half of
each scored), so its noise floor for the same model and settings applies to every row here.
Rows: the f32 reference (f32 K/V, flash attention off), the f16 default, real cache types
(`--real`, to check that a simulated type gives what the real one gives; each `T`, `K/V`, or
`K+c/V`: the real K and V types with K centered, the calibrated mean key subtracted by the
eval callback (hook.Center) and the real type's kernels quantizing the centered keys), and simulated
pairs (`--sim`, each `K/V` of quant.py specs, optionally `@layers`: only those layers,
e.g. `q4_0/q4_0@5,11,17` or `lm4/f16@0-5`). Specs that centre or split are calibrated on
one window of the same text after the scored ones (never on a scored token); a centered
real type uses the same calibration.

KL is KL(P_f16 || P_row) per scored position with a 95% block-bootstrap interval
(results/paired.py), beside KL against f32 and top-1 agreement with f16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ...llama import core, kvcenter
from ...llama.cachetypes import DEFAULT, EXACT, MAINLINE, build_for, get
from ...results.paired import bootstrap, delta_ppl, mean_ci
from ...results.table import markdown
from ..bench.ppl import cut_text
from ..common import model_path
from ..kl import F32_REF, NOISE_BASE, Variant, compare_variants
from ..texts import read_text
from . import hook as hk
from . import quant


def parse_layers(text: str, n_layer: int) -> frozenset[int]:
    """`5,11,17` or `0-5,12` -> layer set; ValueError naming what is out of range."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if not 0 <= a <= b < n_layer:
            raise ValueError(f"layers {text!r}: {part!r} outside 0..{n_layer - 1}")
        out.update(range(a, b + 1))
    return frozenset(out)


def parse_sim(text: str, n_layer: int) -> tuple[str, str, frozenset[int] | None]:
    pair, _, layers = text.partition("@")
    k, sep, v = pair.partition("/")
    if not sep:
        raise ValueError(f"--sim {text!r}: write K/V, e.g. lm4/lm3")
    quant.parse(k), quant.parse(v)  # errors early, naming the spec
    return k, v, parse_layers(layers, n_layer) if layers else None


def parse_real(text: str) -> tuple[str, str, bool]:
    """--real's `T`, `K/V` or `K+c/V` (kvcenter.parse_pair)."""
    return kvcenter.parse_pair(text, "--real")


def real_name(k: str, v: str, center: bool) -> str:
    if not center and k == v:
        return f"{k} (real)"
    return f"{k}{'+c' if center else ''}/{v} (real)"


class _Centered:
    """Variant.hook of a centered real row: makes its hook.Center, kept to check after the run."""

    def __init__(self, calib: dict) -> None:
        self.calib = calib
        self.made: list[hk.Center] = []

    def __call__(self, nat: Any) -> hk.Center:
        h = hk.Center(nat, self.calib)
        self.made.append(h)
        return h


class _Factory:
    """Variant.hook: makes the FakeQuant of a row and keeps it to check after the run."""

    def __init__(self, k: str, v: str, layers: frozenset[int] | None, calib: dict) -> None:
        self.args = (k, v, layers, calib)
        self.made: list[hk.FakeQuant] = []

    def __call__(self, nat: Any) -> hk.FakeQuant:
        k, v, layers, calib = self.args
        h = hk.FakeQuant(nat, k, v, layers, calib)
        self.made.append(h)
        return h


def calibrate(model: str, tokens: np.ndarray, threads: int | None,
              build: str = MAINLINE) -> tuple[dict, Any]:
    """Mean and RMS of K and V per layer and head over one window (Recorder). On the CPU
    whatever the build (the hook reads the rows in host memory; a GPU build's CPU backend
    computes them, with no layer and no op offloaded: llama.cpp sends a big batch's ops to
    a GPU even with every layer on the host), so a GPU machine calibrates too."""
    m = core.Model(model, build=build, n_gpu_layers=0)
    try:
        rec = hk.Recorder(m.nat)
        n = len(tokens)
        ctx = core.Context(m, n_ctx=-(-n // 256) * 256, n_batch=64, n_ubatch=64, n_seq_max=2,
                           type_k=DEFAULT, type_v=DEFAULT, n_threads=threads, flash_attn="on",
                           eval_callback=rec.callback, offload=False)
        b = core.Batch(m.nat, 64)
        for s in range(0, n, 64):
            b.clear()
            b.add(tokens[s:s + 64], s, 0, output_last=False)
            if ctx.decode(b) != 0:
                raise RuntimeError("calibration decode failed")
        ctx.close()
        if rec.errors:
            raise RuntimeError(f"calibration: {rec.errors[0]}")
        return rec.calib(), rec
    finally:
        m.close()


def calib_window(full: list[int], n_scored: int, ctx: int) -> np.ndarray:
    """The calibration tokens: one window of `ctx` after the next window past the scored
    text, never scored (the same for every row of a run, and for `clickpaca kv-center`)."""
    lo = n_scored + ctx
    return np.asarray(full[lo:lo + ctx])


def file_calib(path: str) -> dict:
    """A center file (`clickpaca kv-center`) as the K means hook.Center subtracts."""
    center = kvcenter.read(path)
    return {(True, il): quant.Calib(mean=m, rms=np.ones_like(m)) for il, m in enumerate(center.layers)}


def n_layers(model: str, build: str) -> int:
    m = core.Model(model, build=build)
    try:
        return int(m.n_layer)
    finally:
        m.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_path(args)
    reals = [parse_real(r) for r in (args.real or "").split(",") if r.strip()]
    # one build per process: the one the real types need (turboquant offers the mainline types too)
    build = build_for(*(t for k, v, _ in reals for t in (k, v))) if reals else MAINLINE
    n_layer = n_layers(model, build)
    text, text_path = read_text(args.text)
    sims = [parse_sim(s, n_layer) for s in (args.sim or "").split(";") if s]
    mdl = core.Model(model, build=build)
    try:
        cut, chunks, _ = cut_text(mdl, text, args.ctx, args.chunks)
        tokens = mdl.tokenize(cut, add_special=True, parse_special=False)
        full = mdl.tokenize(text, add_special=True, parse_special=False)
    finally:
        mdl.close()
    center_file = getattr(args, "center", None)
    # the run's own calibration, unless only real +c rows need one and --center gives it
    need_calib = any(quant.parse(s).center or quant.parse(s).kind == "split"
                     for k, v, _ in sims for s in (k, v)) \
        or (any(c for _, _, c in reals) and not center_file)
    calib: dict = {}
    if need_calib:
        calib, _ = calibrate(model, calib_window(full, len(tokens), args.ctx), args.threads, build)
    variants = [F32_REF, NOISE_BASE]
    centered = []
    # --center FILE: the real +c rows subtract that file's center (another text's, say)
    # instead of this run's calibration; the simulated +c specs keep the run's
    real_calib = file_calib(center_file) if center_file else calib
    for k, v, c in reals:
        if c:
            centered.append(_Centered(real_calib))
        variants.append(Variant(real_name(k, v, c), k, v, hook=centered[-1] if c else None))
    factories = []
    for k, v, layers in sims:
        f = _Factory(k, v, layers, calib)
        factories.append(f)
        name = f"{k}/{v} (sim)" + (f" @{','.join(map(str, sorted(layers)))}" if layers else "")
        variants.append(Variant(name, hook=f))
    refs = [0, 1]
    if args.floor_of:
        # the simulated type's own floor: its default changed in one thing that should not
        # matter (as `ppl --noise-of`), each against the unchanged simulation
        k, v, layers = parse_sim(args.floor_of, n_layer)
        base = next((i for i, x in enumerate(variants) if isinstance(x.hook, _Factory) and x.hook.args[:3] == (k, v, layers)),
                    None)
        if base is None:
            raise ValueError(f"--floor-of {args.floor_of!r}: not one of --sim")
        refs.append(base)
        for label, change in (("prompt chunks of 16 (not 64)", {"chunk": 16}),
                              ("cells after 100 of another sequence", {"offset": 100})):
            f = _Factory(k, v, layers, calib)
            factories.append(f)
            variants.append(Variant(f"{variants[base].name}, {label}", hook=f, **change))
    recs = compare_variants(model, variants, refs, np.asarray(tokens), args.ctx, build=build,
                            threads=args.threads)
    head = 0
    for f in factories:
        for h in f.made:
            if h.errors:
                raise RuntimeError(f"{f.args[:2]}: {h.errors[0]}")
            if h.calls == 0 and not (f.args[0] == f.args[1] == DEFAULT):
                raise RuntimeError(f"{f.args[:2]}: the hook never saw a K or V node")
            head = max(head, h.head)
    for c in centered:
        for h in c.made:
            if h.errors:
                raise RuntimeError(f"centering: {h.errors[0]}")
            if h.calls == 0:
                raise RuntimeError("centering: the hook never saw a K node")
    rows = []
    for v, rec in zip(variants, recs):
        row = {"name": v.name, "ppl": rec["ppl"], "tokens": rec["tokens"], "token_nll": rec["token_nll"]}
        if isinstance(v.hook, _Factory):
            k, vv, layers = v.hook.args[:3]
            row["bits"] = (quant.bits_per_value(quant.parse(k), head or 128) +
                           quant.bits_per_value(quant.parse(vv), head)) / 2
            row["layers"] = sorted(layers) if layers else None
        elif v is not F32_REF and v is not NOISE_BASE:
            row["bits"] = (get(v.type_k).bits + get(v.type_v).bits) / 2
            row["centered"] = v.hook is not None
        own = [(variants[i].name, "own") for i in refs[2:]]
        for ref, key in [(NOISE_BASE.name, DEFAULT), (F32_REF.name, EXACT)] + own:
            vs = rec["vs"].get(ref)
            if vs:
                ci = mean_ci(vs["token_kl"])
                row[f"kl_{key}"] = ci["mean"]
                row[f"kl_{key}_ci"] = ci["ci"]
                row[f"kl_{key}_p99"] = vs["kl_p99"]
                row[f"top1_{key}"] = vs["top1_agreement"]
                row[f"token_kl_{key}"] = vs["token_kl"]
        rows.append(row)
    against_real(rows)
    return {"model": model, "head": head, "layers": n_layer, "text": text_path, "ctx": args.ctx,
            "chunks": chunks, "threads": args.threads, "center": center_file, "rows": rows}


#: the row every other row's KL is read against (the goal: half of real q4_0's KL,
#: docs/KV-RESEARCH.md, "A compressed type that earns its bits")
REAL_REF = "q4_0 (real)"


def against_real(rows: list[dict[str, Any]], ref: str = REAL_REF) -> None:
    """Each row with a KL against f16 gets its ratio to the `ref` row's KL ("kl_ratio", with a
    paired block-bootstrap interval over the same positions, "kl_ratio_ci"), and each row its
    paired ΔPPL against f16 ("dppl_rel", "dppl_rel_ci"). In place; nothing if `ref` is absent."""
    base = next((r for r in rows if r["name"] == NOISE_BASE.name), None)
    real = next((r for r in rows if r["name"] == ref), None)
    for r in rows:
        if base is not None and r is not base:
            d = delta_ppl(base["token_nll"], r["token_nll"])
            r["dppl_rel"], r["dppl_rel_ci"] = d["delta_ppl_rel"], d["delta_ppl_rel_ci"]
        if real is not None and "token_kl_f16" in r:
            a, b = np.asarray(real["token_kl_f16"]), np.asarray(r["token_kl_f16"])
            r["kl_ratio"] = float(b.mean() / a.mean())
            r["kl_ratio_ci"] = list(bootstrap(lambda x, y: y.mean(axis=1) / x.mean(axis=1), [a, b]))


def table(out: dict[str, Any]) -> str:
    f16 = next(r for r in out["rows"] if r["name"] == NOISE_BASE.name)
    head = ["K / V", "bits/value", "PPL", "vs f16", "KL vs f16 [95% CI]", "/ real q4_0 [95% CI]", "KL p99",
            "top-1 vs f16", "KL vs f32", "KL vs the simulated default"]
    rows = []
    for r in out["rows"]:
        kl = f"{r['kl_f16']:.4f} [{r['kl_f16_ci'][0]:.4f}, {r['kl_f16_ci'][1]:.4f}]" if "kl_f16" in r else "-"
        rows.append([r["name"], f"{r['bits']:.3f}" if "bits" in r else "-", f"{r['ppl']:.2f}",
                     f"{100 * (r['ppl'] / f16['ppl'] - 1):+.1f}%",
                     kl, f"{r['kl_ratio']:.2f} [{r['kl_ratio_ci'][0]:.2f}, {r['kl_ratio_ci'][1]:.2f}]"
                     if "kl_ratio" in r else "-",
                     f"{r['kl_f16_p99']:.3f}" if "kl_f16_p99" in r else "-",
                     f"{r['top1_f16']:.3f}" if "top1_f16" in r else "-",
                     f"{r['kl_f32']:.4f}" if "kl_f32" in r else "-",
                     f"{r['kl_own']:.4f}" if "kl_own" in r else "-"])
    return markdown(head, rows, align="ll" + "r" * (len(head) - 2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.kvsim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="path or registry name (smollm2, gemma3-270m)")
    ap.add_argument("--text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--real", default="", help="comma list of real cache types beside: T, K/V, or K+c/V "
                    "(K centered by the calibrated mean, then quantized by the real type): q4_0,turbo4,q4_0+c/q4_0")
    ap.add_argument("--center", default=None, help="the real K+c/V rows subtract this center file's means "
                    "(`clickpaca kv-center`) instead of the run's own calibration")
    ap.add_argument("--sim", default="", help="';'-separated K/V[@layers] of quant.py specs")
    ap.add_argument("--floor-of", default=None,
                    help="one of --sim: also its default with prompt chunks of 16 and with cells after 100 "
                         "of another sequence, read against it (the simulated type's own noise floor)")
    ap.add_argument("--out", default="bench-results/kvsim", help="folder; writes NAME.json")
    ap.add_argument("--name", default="kvsim")
    args = ap.parse_args(argv)
    try:
        out = run(args)
    except ValueError as e:
        print(f"kvsim: {e}", file=sys.stderr)
        return 2
    print(table(out))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(out))
    return 0
