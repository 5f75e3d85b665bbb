"""Turbo K/V caches bit-reproducible: which flash-attention path depends on the batch shape.

A turbo V needs flash attention. With the kernels deterministic mode pins otherwise
(weights in file layout, tiled K-quant matmul off, one KV stream per sequence), the one
path left that depends on the batch shape is flash attention's tiled (GEMM) path, which
the turboquant patch takes from deterministic.FA_TILE_ROWS query rows of a stream: a
96-token prompt decoded at once differs from 48 + 48. With micro-batches of
UBATCH every row goes row by row, and the last token's logits are the
same bits whether the prompt is decoded at once, as 48 + 48, as 95 + 1, or beside three
other prompts.

The measurement runs in a child process: ggml reads GGML_CPU_TILED_MM once per process,
and this process may have computed a graph already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from clickpaca.llama import cachetypes, native

pytestmark = [pytest.mark.turboquant, pytest.mark.model, pytest.mark.slow]

N = 96  # prompt tokens: above FA_TILE_ROWS, so one decode of it takes the tiled path
TYPES = ("turbo3", "turbo4")
#: deterministic mode's micro-batch for these types (their rows' det_ubatch)
UBATCH = cachetypes.get(TYPES[0]).det_ubatch


def _measure(types: list[str]) -> dict[str, dict[str, float]]:
    """Child process: max |d| of the last token's logits per (type, ubatch, variant)."""
    from clickpaca.llama import core, deterministic
    from clickpaca.llama.models import resolve_model

    deterministic.apply_process_settings()
    m = core.Model(resolve_model(None), build="turboquant", repack=False)
    text = "The river runs through the valley, and the children count the boats until night falls. "
    toks = m.tokenize(text * 40, add_special=False)
    prompts = [np.concatenate([[m.bos], toks[7 * i: 7 * i + N - 1]]).astype(np.int32) for i in range(4)]

    def last_logits(ct: str, ub: int, steps: list) -> np.ndarray:
        ctx = core.Context(m, n_ctx=4 * 256, n_batch=512, n_ubatch=ub, n_seq_max=4, type_k=ct, type_v=ct,
                           flash_attn="on", kv_unified=False)
        b = core.Batch(m.nat, 512)
        try:
            for parts in steps:
                b.clear()
                for seq, t, p0 in parts:
                    b.add(t, p0, seq, output_last=True)
                assert ctx.decode(b) == 0
                out = ctx.logits()[0].copy()  # sequence 0 is the first part of every step
            return out
        finally:
            ctx.close()

    p = prompts[0]
    out: dict[str, dict[str, float]] = {}
    for ct in types:
        for ub in (512, UBATCH):
            one = last_logits(ct, ub, [[(0, p, 0)]])
            variants = {"48 + 48": [[(0, p[:48], 0)], [(0, p[48:], 48)]],
                        "95 + 1": [[(0, p[:-1], 0)], [(0, p[-1:], N - 1)]],
                        "beside 3 other prompts": [[(s, prompts[s], 0) for s in range(4)]]}
            if ub == 512:
                variants = {"48 + 48": variants["48 + 48"]}
            out[f"{ct} ubatch {ub}"] = {name: float(np.abs(one - last_logits(ct, ub, steps)).max())
                                        for name, steps in variants.items()}
    return out


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, float]]:
    if not (native.build_dir("turboquant") / "build-info.json").exists():
        pytest.fail("builds/turboquant does not exist: `make turboquant`")
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    r = subprocess.run([sys.executable, __file__, *TYPES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_tiled_flash_attention_path_depends_on_the_batch_shape(measured):
    from clickpaca.llama.deterministic import FA_TILE_ROWS

    assert N >= FA_TILE_ROWS
    for ct in TYPES:
        assert measured[f"{ct} ubatch 512"]["48 + 48"] > 0, measured


def test_micro_batches_below_the_tile_give_the_same_bits(measured):
    from clickpaca.llama.deterministic import FA_TILE_ROWS, ubatch

    assert {cachetypes.get(t).det_ubatch for t in TYPES} == {UBATCH} and UBATCH < FA_TILE_ROWS
    assert ubatch(("f16", "turbo3"), 512) == UBATCH and ubatch(("f16", "f16"), 512) is None
    for ct in TYPES:
        assert measured[f"{ct} ubatch {UBATCH}"] == {
            "48 + 48": 0.0, "95 + 1": 0.0, "beside 3 other prompts": 0.0}, measured


def test_the_server_in_deterministic_mode_with_turbo3_keeps_its_bits_across_chunking_and_batch():
    """`init` deterministic with turbo3 K and V (flash attention on, micro-batches of
    the types' det_ubatch): a greedy run of a prompt longer than the tile gives the same bits with
    the prompt decoded at once (nBatch 512) or in chunks of 40, and beside three other
    prompts. (Without the pin the nBatch 512 run takes the tiled path: this test fails
    with det_ubatch set to 512, checked when it was written.)"""
    import tempfile

    from clickpaca.wire.client import Client
    from clickpaca.llama.deterministic import FA_TILE_ROWS

    text = "The river runs through the valley, and the children count the boats until night falls. "
    prompts = {s: f"{s}. " + text * 6 for s in range(4)}

    def run(c, ids):
        for s in ids:
            c.infer(s, prompts[s], maxTokens=8, temperature=0, nProbs=3)
        out = {}
        for s in ids:
            toks, done = c.collect(s)
            assert done["type"] == "done" and done["tokens_prompt"] > FA_TILE_ROWS, done
            out[s] = [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]
        return out

    runs = {}
    for n_batch in (512, 40):
        c = Client.spawn()
        try:
            ready = c.init(nCtx=2048, nSeqMax=4, nBatch=n_batch, build="turboquant", deterministic=True,
                           cacheTypeK="turbo3", cacheTypeV="turbo3",
                           stateDir=tempfile.mkdtemp(prefix="clkp-state-"), timeout=180)
            assert ready["deterministic"] is True and ready["kernels"]["flashAttn"] is True
            runs[n_batch] = run(c, [0])[0]
            if n_batch == 512:
                runs["batch"] = run(c, [0, 1, 2, 3])[0]
        finally:
            c.close()
    assert runs[40] == runs[512]
    assert runs["batch"] == runs[512]


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1:])))
