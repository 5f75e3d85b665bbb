"""`python -m clickpaca.measure.kvsim.mse`: each spec's relative error on a model's real K and V.

Captures one window's K (after RoPE) and V of every layer (hook.Recorder, a window after the
scored ones of `clickpaca ppl`), then per spec, per layer: mean over rows of
||x - x_hat||^2 / ||x||^2 (K and V apart), and how much of the rows' energy is their mean
(||mean||^2 / mean ||x||^2: what centering removes). The error is a mechanism, not the
outcome: the in-model KL (study.py) is.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ...llama import core
from ...results.table import markdown
from ..bench.ppl import cut_text
from ..common import model_path
from ..texts import read_text
from . import quant
from .study import calibrate


def relative_error(spec: str, rows: np.ndarray, is_k: bool, calib: quant.Calib) -> float:
    y = quant.apply(quant.parse(spec), rows, is_k, calib).astype(np.float64)
    x = rows.astype(np.float64)
    num = ((y - x) ** 2).sum(axis=2)
    den = (x * x).sum(axis=2)
    return float(np.mean(num[den > 0] / den[den > 0]))


def mean_energy(rows: np.ndarray, calib: quant.Calib) -> float:
    x = rows.astype(np.float64)
    return float((calib.mean.astype(np.float64) ** 2).sum() / (x * x).sum(axis=2).mean() / rows.shape[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.kvsim.mse", description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--specs", default="q4_0,q4_0+s,q4_0+norot,lm4,lm4+s,lm4+norot,lm3,lm4g32,lm5,q4_0+c,lm4+c,lm5+c,lm3+c")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = model_path(args)
    text, _ = read_text(args.text)
    m = core.Model(model)
    try:
        cut, _, _ = cut_text(m, text, args.ctx, args.chunks)
        n = len(m.tokenize(cut, add_special=True, parse_special=False))
        full = m.tokenize(text, add_special=True, parse_special=False)
    finally:
        m.close()
    calib, rec = calibrate(model, np.asarray(full[n + args.ctx:n + 2 * args.ctx]), args.threads)
    layers = sorted({layer for _, layer in rec.samples})
    specs = args.specs.split(",")
    out: dict = {"model": model, "layers": {}}
    rows = []
    for is_k in (True, False):
        per = {s: [] for s in specs}
        energy = []
        for layer in layers:
            x = np.concatenate(rec.samples[(is_k, layer)])
            c = calib[(is_k, layer)]
            energy.append(mean_energy(x, c))
            for s in specs:
                per[s].append(relative_error(s, x, is_k, c))
        kv = "K" if is_k else "V"
        out["layers"][kv] = {"mean_energy": energy, **per}
        rows.append([kv, "mean's share of energy", f"{np.mean(energy):.3f}", f"{np.min(energy):.3f}",
                     f"{np.max(energy):.3f}", str(int(np.argmax(energy)))])
        for s in specs:
            e = np.asarray(per[s])
            rows.append([kv, s, f"{e.mean():.4f}", f"{e.min():.4f}", f"{e.max():.4f}", str(int(e.argmax()))])
    print(markdown(["", "spec", "mean over layers", "min", "max", "worst layer"], rows, align="llrrrr"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
