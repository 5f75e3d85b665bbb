"""`clickpaca cvec`: a control vector from contrastive prompt pairs, in llama.cpp's format.

Each prompt is decoded as its own sequence (several in one batch); `capture` takes the
layers' `l_out-il` row at the prompt's last token, the point where llama.cpp adds the
direction of layer il (build_cvec comes just before the node named `l_out`). The direction
of a layer is the mean of (positive - negative) over the pairs, or (`method="pca"`) the
first principal axis of those differences, signed and scaled to the mean difference's
projection on it, so strengths mean the same under both methods.

The file is what llama.cpp's cvector-generator writes and common_control_vector_load
reads: general.architecture "controlvector", controlvector.model_hint,
controlvector.layer_count, and one 1-D f32 tensor "direction.<il>" per layer (il >= 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..llama import core
from .capture import Capture

ARCH = "controlvector"


class PairsError(ValueError):
    """The prompt-pair file cannot be used; the message names the line."""


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """JSON lines {"positive": "...", "negative": "..."}; blank lines skipped."""
    pairs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PairsError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) and obj[k]
                                                for k in ("positive", "negative")):
            raise PairsError(f"{path}:{i}: needs non-empty strings 'positive' and 'negative'")
        pairs.append((obj["positive"], obj["negative"]))
    if not pairs:
        raise PairsError(f"{path}: no prompt pairs")
    return pairs


def last_token_states(model: core.Model, prompts: list[str], layers: list[int],
                      per_batch: int = 8, n_threads: int | None = None) -> dict[int, np.ndarray]:
    """layer -> [len(prompts), n_embd]: l_out-<layer> at each prompt's last token."""
    cap = Capture(model.nat)
    toks = [model.tokenize(p) for p in prompts]
    cap_tokens = max(sum(len(t) for t in toks[i:i + per_batch]) for i in range(0, len(toks), per_batch))
    n_ctx = max(256, cap_tokens + 16)
    ctx = core.Context(model, n_ctx=n_ctx, n_batch=cap_tokens, n_ubatch=cap_tokens, n_seq_max=per_batch,
                       n_threads=n_threads, eval_callback=cap.callback)
    names = [f"l_out-{il}" for il in layers]
    out = {il: np.zeros((len(prompts), model.n_embd), np.float32) for il in layers}
    try:
        batch = core.Batch(model.nat, cap_tokens)
        for i0 in range(0, len(toks), per_batch):
            batch.clear()
            ctx.clear()
            rows = {}
            for j, t in enumerate(toks[i0:i0 + per_batch]):
                rows[i0 + j] = [batch.add(t, 0, j) + len(t) - 1]
            cap.arm(names, rows, batch)
            rc = ctx.decode(batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for k, got in cap.take().items():
                for il in layers:
                    out[il][k] = got[f"l_out-{il}"][0]
    finally:
        ctx.close()
    return out


def derive(pos: dict[int, np.ndarray], neg: dict[int, np.ndarray], method: str = "mean") -> dict[int, np.ndarray]:
    """layer -> direction [n_embd] from the paired states ([pairs, n_embd] each)."""
    if method not in ("mean", "pca"):
        raise ValueError(f"method: 'mean' or 'pca', got {method!r}")
    dirs = {}
    for il in pos:
        diff = (pos[il] - neg[il]).astype(np.float64)
        mean = diff.mean(axis=0)
        if method == "mean":
            d = mean
        else:
            _, _, vt = np.linalg.svd(diff, full_matrices=False)
            u = vt[0]
            proj = float(mean @ u)
            d = u * proj if proj != 0 else u * np.linalg.norm(mean)  # signed toward the mean
        dirs[il] = d.astype(np.float32)
    return dirs


def write_gguf(path: str | Path, directions: dict[int, np.ndarray], model_hint: str) -> Path:
    """The control-vector GGUF llama.cpp loads (--control-vector, common_control_vector_load)."""
    import gguf

    if any(il < 1 for il in directions):
        raise ValueError("llama.cpp never steers layer 0: directions start at layer 1")
    p = Path(path)
    w = gguf.GGUFWriter(str(p), ARCH)
    w.add_string(f"{ARCH}.model_hint", model_hint)
    w.add_int32(f"{ARCH}.layer_count", len(directions))
    for il in sorted(directions):
        w.add_tensor(f"direction.{il}", np.ascontiguousarray(directions[il], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def read_gguf(path: str | Path) -> dict[int, np.ndarray]:
    """layer -> direction from a control-vector GGUF (ours or llama.cpp's)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        name = t.name
        if not name.startswith("direction."):
            raise ValueError(f"{path}: tensor {name!r} is not a direction.<layer>")
        out[int(name.split(".", 1)[1])] = np.array(t.data, dtype=np.float32).reshape(-1)
    return out


def parse_layers(spec: str | None, n_layer: int) -> list[int]:
    """'A-B' inclusive (llama.cpp numbering, 1 .. n_layer-1); None: all of them."""
    if spec is None:
        return list(range(1, n_layer))
    try:
        a, _, b = spec.partition("-")
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise ValueError(f"--layers: 'A-B', got {spec!r}") from None
    if not 1 <= lo <= hi < n_layer:
        raise ValueError(f"--layers: {lo}-{hi} outside 1-{n_layer - 1}")
    return list(range(lo, hi + 1))


def run_cvec(args: Any) -> int:
    """The command: pairs file -> capture -> directions -> GGUF."""
    from ..llama.models import resolve_model

    try:
        pairs = read_pairs(args.pairs)
    except (OSError, PairsError) as e:
        print(f"cvec: {e}", file=sys.stderr)
        return 2
    model = core.Model(resolve_model(args.model), build=args.build)
    try:
        layers = parse_layers(args.layers, model.n_layer)
    except ValueError as e:
        print(f"cvec: {e}", file=sys.stderr)
        return 2
    pos = last_token_states(model, [p for p, _ in pairs], layers, n_threads=args.threads)
    neg = last_token_states(model, [n for _, n in pairs], layers, n_threads=args.threads)
    dirs = derive(pos, neg, args.method)
    arch = model.description.split(" ", 1)[0]
    write_gguf(args.output, dirs, arch)
    norms = ", ".join(f"{il}:{np.linalg.norm(d):.1f}" for il, d in dirs.items())
    print(f"cvec: {len(pairs)} pairs, layers {layers[0]}-{layers[-1]}, {args.method} -> {args.output} "
          f"(|direction| per layer {norms})")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cvec", help="a control vector (llama.cpp's GGUF format) from contrastive prompt pairs")
    p.add_argument("pairs", help="JSON lines {\"positive\": ..., \"negative\": ...}")
    p.add_argument("-o", "--output", required=True, help="the control-vector GGUF to write")
    p.add_argument("--layers", default=None, help="A-B inclusive, llama.cpp numbering (default: 1 to the last)")
    p.add_argument("--method", choices=("mean", "pca"), default="mean")
    p.add_argument("--model", default=None, help="model path (default: clickpaca model)")
    p.add_argument("--build", default="mainline")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run_cvec)
