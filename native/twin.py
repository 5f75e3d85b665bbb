#!/usr/bin/env python3
"""A synthetic twin of a GGUF model: the same header (architecture, shapes, quantization
types, the real tokenizer), seeded random weights, made bit for bit alike anywhere.

Why: the default model (253 MB) does not fit where a GPU may be borrowed (64 MiB a call).
The twin runs the same arithmetic per token as the model it copies (same tensors, same
types, same kernels), so speed ratios against llama.cpp's tools on the same file carry
over; its words are noise, so it proves nothing about the model's outputs, only that two
backends agree on one file. The recipe is the header (compressed) and a seed: a few MiB.

    python3 native/twin.py recipe MODEL.gguf RECIPE.json    # on the machine with the model (needs gguf-py)
    python3 native/twin.py make RECIPE.json OUT.gguf        # anywhere: numpy and the standard library

Weights: each tensor's bytes are PCG64 raw 64-bit draws (numpy's bit generators promise
the same stream on every platform and version), seeded by (seed, tensor index); then each
block's scale fields are set to one float16 per tensor, chosen so a weight's spread is
about 1/sqrt(fan-in) (token_embd: 0.1, which keeps logits a few nats apart), and F32
tensors (the norms, which Gemma's converter stores as 1 + w) get norm_value's centre
times 1 plus noise of 0.1. The
recipe records the twin's sha256; `make` refuses a result that differs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
import sys
from pathlib import Path

import numpy as np

# ggml's block layouts of the types this recipe fills: (block size in values, bytes per
# block, {byte offset of each float16 scale field: which scale}).
LAYOUTS = {
    "Q8_0": (32, 34, {0: "d"}),
    "Q5_0": (32, 22, {0: "d"}),
    "Q4_K": (256, 144, {0: "d", 2: "dmin"}),
    "Q6_K": (256, 210, {208: "d"}),
}
# A block's typical |value| in units of its scale with random quant bytes: q8_0 int8 (std 74),
# q5_0 5-bit minus 16 (9.2), q4_K 6-bit scale x 4-bit quant (~200), q6_K int8 scale x 6-bit (~1370).
SPREAD = {"Q8_0": 74.0, "Q5_0": 9.2, "Q4_K": 200.0, "Q6_K": 1370.0}
SEED = 20261204


def target_std(name: str, fan_in: int) -> float:
    return 0.1 if name == "token_embd.weight" else 1.0 / np.sqrt(fan_in)


def norm_value(name: str) -> float:
    """An F32 tensor's centre: 1 (a norm's 1 + w), 8 for the norms after attention and the
    feed-forward, so that each layer adds more to the residual than the token's own
    embedding holds (with 1, a random model repeats its last token)."""
    return 8.0 if ".post_" in name else 1.0


def recipe(model: Path, out: Path, seed: int = SEED) -> dict:
    """The header of `model` and its tensors' places, types and scales; no weights."""
    import gguf  # llama.cpp's gguf-py (pyproject): only the recipe's maker needs it

    r = gguf.GGUFReader(str(model))
    header = model.read_bytes()[:r.data_offset]
    tensors = []
    for t in r.tensors:
        kind = t.tensor_type.name
        if kind != "F32" and kind not in LAYOUTS:
            raise SystemExit(f"{model.name}: {t.name} is {kind}, which native/twin.py cannot fill")
        fan_in = int(t.shape[0])
        scale = target_std(t.name, fan_in) / SPREAD[kind] if kind in LAYOUTS else norm_value(t.name)
        tensors.append({"name": t.name, "type": kind, "offset": int(t.data_offset) - r.data_offset,
                        "bytes": int(t.n_bytes), "scale": scale})
    end = max(t["offset"] + t["bytes"] for t in tensors)
    data = {"source": model.name, "source_sha256": sha256(model.read_bytes()), "seed": seed,
            "data_offset": r.data_offset, "data_bytes": end, "tensors": tensors,
            "header_xz": base64.b64encode(lzma.compress(header, preset=9)).decode()}
    data["twin_sha256"] = sha256(build(data))
    out.write_text(json.dumps(data) + "\n")
    return data


def sha256(b: bytes | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


def fill(t: dict, index: int, seed: int) -> np.ndarray:
    """One tensor's bytes: raw draws, then its scale fields (or F32 values) set."""
    n = t["bytes"]
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index])))
    raw = gen.bit_generator.random_raw((n + 7) // 8).astype("<u8").view(np.uint8)[:n].copy()
    if t["type"] == "F32":
        # centre x (1 + uniform(-0.1, 0.1)), from the draws' top 23 bits (exact in float32)
        bits = raw.view("<u4") >> np.uint32(9)
        u = bits.astype(np.float32) / np.float32(1 << 23) - np.float32(0.5)
        vals = np.float32(t["scale"]) * (np.float32(1.0) + u * np.float32(0.2))
        return vals.astype("<f4").view(np.uint8)
    _, size, fields = LAYOUTS[t["type"]]
    blocks = raw.reshape(-1, size)
    half = np.frombuffer(np.float16(t["scale"]).astype("<f2").tobytes(), dtype=np.uint8)
    for off, which in fields.items():
        # dmin = 7.5 d: a q4_K block's offset cancels its mean on average
        value = half if which == "d" else np.frombuffer(np.float16(t["scale"] * 7.5).astype("<f2").tobytes(), np.uint8)
        blocks[:, off:off + 2] = value
    return raw


def build(data: dict) -> bytes:
    """The twin's bytes from a recipe (its header, then each tensor at its offset)."""
    header = lzma.decompress(base64.b64decode(data["header_xz"]))
    if len(header) != data["data_offset"]:
        raise SystemExit("recipe: the header's length is not the data offset it records")
    body = np.zeros(data["data_bytes"], dtype=np.uint8)
    for i, t in enumerate(data["tensors"]):
        body[t["offset"]:t["offset"] + t["bytes"]] = fill(t, i, data["seed"])
    return header + body.tobytes()


def make(recipe_path: Path, out: Path) -> str:
    """Write the twin; its sha256 must be the recipe's (SystemExit naming both if not)."""
    data = json.loads(recipe_path.read_text())
    blob = build(data)
    got = sha256(blob)
    if got != data["twin_sha256"]:
        raise SystemExit(f"twin of {data['source']}: sha256 {got}, the recipe says {data['twin_sha256']} "
                         f"(numpy {np.__version__})")
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_bytes(blob)
    tmp.rename(out)
    return got


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "recipe":
        d = recipe(Path(argv[1]), Path(argv[2]))
        print(f"{argv[2]}: {len(d['tensors'])} tensors, twin sha256 {d['twin_sha256']}")
    elif len(argv) == 3 and argv[0] == "make":
        print(f"{argv[2]}: sha256 {make(Path(argv[1]), Path(argv[2]))} (as the recipe says)")
    else:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
