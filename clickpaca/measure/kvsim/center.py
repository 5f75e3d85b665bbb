"""`clickpaca kv-center`: calibrate a key center file for init's `kvCenter`.

The center is the mean key of each layer and KV head over one window of text (hook.Recorder
on an f16 cache), the calibration the study's `--real K+c/V` rows use: with the same text,
--ctx and --chunks it is that run's center to every bit, so the server reproduces the
study's centered rows (tests/test_kvcenter.py checks native centering against the study's
callback). Any center is exact for attention; a calibrated one is what makes the
quantized keys smaller (docs/KV-RESEARCH.md, "Key centering in the graph").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any



def make_center(model: str, text_path: str | None, ctx: int, chunks: int, threads: int | None) -> Any:
    """The study's center (a kvcenter.Center) for `--ctx ctx --chunks chunks` on that text."""
    from ...llama import core, kvcenter
    from ..bench.ppl import cut_text
    from ..texts import read_text
    from .study import calib_window, calibrate

    text, shown = read_text(text_path)
    mdl = core.Model(model, build="mainline")
    try:
        cut, _, _ = cut_text(mdl, text, ctx, chunks)
        n_scored = len(mdl.tokenize(cut, add_special=True, parse_special=False))
        full = mdl.tokenize(text, add_special=True, parse_special=False)
        n_layer = int(mdl.n_layer)
    finally:
        mdl.close()
    window = calib_window(full, n_scored, ctx)
    if len(window) < ctx:
        raise ValueError(f"the text has {len(full)} tokens: too short for {chunks} windows of {ctx} "
                         f"and a calibration window after them (needs {n_scored + 2 * ctx})")
    calib, _ = calibrate(model, window, threads)
    means = {layer: c.mean for (is_k, layer), c in calib.items() if is_k}
    return kvcenter.Center.from_means(means, n_layer, meta={
        "model": Path(model).name, "modelBytes": Path(model).stat().st_size, "text": shown,
        "window": [n_scored + ctx, n_scored + 2 * ctx], "tokens": len(window)})


def run(args: argparse.Namespace) -> int:
    from ...llama import kvcenter
    from ..common import model_path

    model = model_path(args)
    try:
        center = make_center(model, args.text, args.ctx, args.chunks, args.threads)
    except (ValueError, kvcenter.CenterError) as e:
        print(f"clickpaca kv-center: {e}", file=sys.stderr)
        return 2
    center.save(args.output)
    print(f"{args.output}: {len(center.layers)} layers, {center.flat.size} floats, "
          f"digest {center.digest[:16]}, calibrated on tokens {center.meta['window']} of {center.meta['text']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("kv-center", help="a key center file (init's kvCenter) calibrated on a text")
    p.add_argument("-o", "--output", required=True, help="the center file to write (.npz)")
    p.add_argument("--model", default=None, help="path or registry name (default: clickpaca model)")
    p.add_argument("--text", default=None, help="calibration text (default: the perplexity studies' play)")
    p.add_argument("--ctx", type=int, default=512, help="window size, as kvsim's --ctx (default 512)")
    p.add_argument("--chunks", type=int, default=2,
                   help="the scored windows skipped before the calibration window, as kvsim's --chunks "
                        "(default 2: the center of `kvsim --chunks 2`)")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)
