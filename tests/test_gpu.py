"""The engine on a GPU build (docs/GPU.md), on the GPU: `make gpu-check` runs these after
building linux-cuda for the local GPU. Marked `gpu`: `make test` and `make check` leave
them out; without a GPU build they fail at init, never skip.

- ready.devices lists each GPU with its memory, and every layer goes to the GPUs by default;
- the turbo cache types and deterministic mode are refused by name;
- capture copies rows out of device memory, and they agree with a run kept on the CPU;
- per-sequence control vectors steer on the GPU (the patch's ops are ggml ops);
- key centering (init kvCenter) runs on the GPU, calibrated on the CPU backend;
- sequences decoded together agree with each alone up to the near-tie rule.

CLICKPACA_GPU_BUILD (default mainline) and CLICKPACA_GPU_PATCHED (default activations)
name the builds; `make gpu-check` links the CUDA builds under those names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from clickpaca.activations import capture as C
from clickpaca.activations import cvec
from clickpaca.llama import cachetypes, core, gpu
from clickpaca.llama.native import load
from clickpaca.wire.client import Client, ServerError
from conftest import NEAR_TIE

pytestmark = [pytest.mark.gpu, pytest.mark.model]

BUILD = os.environ.get("CLICKPACA_GPU_BUILD", "mainline")
PATCHED = os.environ.get("CLICKPACA_GPU_PATCHED", "activations")
PROMPTS = ["The capital of France is", "Once upon a time", "My favourite colour is", "The weather today",
           "In 1492, Columbus", "The best way to learn", "Water boils at", "A haiku about the sea:"]
N_GEN, N_TOP = 16, 5


def spawn(build: str = BUILD, **init) -> Client:
    c = Client.spawn("--allow-any-path")
    try:
        c.init(**{"nCtx": 4096, "nSeqMax": 16, "build": build, "cacheTypeK": "f16", "cacheTypeV": "f16",
                  "stateDir": tempfile.mkdtemp(prefix="clkp-state-"), **init})
    except BaseException:
        c.close()
        raise
    return c


def nvidia_smi_devices() -> tuple[list[tuple[str, int | None]], bool]:
    """(name, total memory in bytes; None for a MIG device) per device this process sees
    (CUDA_VISIBLE_DEVICES and MIG applied: clickpaca/llama/gpu.py visible_devices), and
    whether their count is exact."""
    smi = shutil.which("nvidia-smi") or "nvidia-smi"
    listing = subprocess.run([smi, "-L"], capture_output=True, text=True, check=True).stdout
    out = subprocess.run([smi, "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    memory = {u.strip(): int(m) << 20 for u, m in (line.rsplit(",", 1) for line in out.strip().splitlines())}
    devices, exact = gpu.visible_devices(listing, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [(d["name"], None if d["mig"] else memory[d["uuid"]]) for d in devices], exact


def greedy(c: Client, seq_id: int, prompt: str, **params) -> list:
    c.infer(seq_id, prompt, maxTokens=N_GEN, temperature=0, nProbs=N_TOP, **params)
    toks, done = c.collect(seq_id, timeout=300)
    assert done["type"] == "done", done
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def greedy_on_a_new_server(build: str, prompt: str, **init) -> list:
    """`greedy` on a server of its own (spawned with `init`, closed after)."""
    c = spawn(build, **init)
    try:
        return greedy(c, 0, prompt)
    finally:
        c.close()


def same_up_to_a_near_tie(a: list, b: list) -> bool:
    """Equal token for token, or parting first where `a` had a near-tie (conftest.NEAR_TIE)."""
    for x, y in zip(a, b):
        if x[0] != y[0]:
            top = dict(x[2])
            return y[0] in top and top[x[0]] - top[y[0]] < NEAR_TIE
    return len(a) == len(b)


def test_ready_lists_each_gpu_with_its_memory_and_every_layer_on_the_gpus():
    c = spawn()
    try:
        ready = c.ready
    finally:
        c.close()
    assert ready["nGpuLayers"] == -1
    gpus = [r for r in ready["devices"] if r["name"] != "CPU"]
    smi, exact = nvidia_smi_devices()
    # with MIG, how many instances one process enumerates depends on the CUDA release: at
    # least one, at most those CUDA_VISIBLE_DEVICES leaves
    assert len(gpus) == len(smi) if exact else 1 <= len(gpus) <= len(smi), (gpus, smi)
    for row, (name, total) in zip(gpus, smi):
        if total is None:  # a MIG device: nvidia-smi --query-gpu reports the whole GPU's memory
            continue
        assert abs(row["memoryTotal"] - total) <= 0.02 * total, (row, name, total)
        assert 0 < row["memoryFree"] <= row["memoryTotal"]
    n_layer = ready["model"]["nLayer"]
    on_gpus = sorted(i for r in gpus for i in r["layers"])
    assert on_gpus == list(range(n_layer + 1)), on_gpus  # the repeating layers and the output layer
    assert sum(r["modelMiB"] for r in gpus) > 0 and sum(r["kvMiB"] for r in gpus) > 0


@pytest.mark.parametrize("field", ["cacheTypeK", "cacheTypeV"])
def test_turbo_types_are_refused_by_name(field):
    turbo = cachetypes.names(build="turboquant")[0]
    with pytest.raises(ServerError) as e:
        spawn(PATCHED, **{field: turbo, "flashAttn": "on"})
    assert e.value.event["type"] == "error" and f"{field}: {turbo} has CPU kernels only" in e.value.event["message"]


def test_deterministic_mode_is_refused_by_name():
    with pytest.raises(ServerError) as e:
        spawn(deterministic=True)
    assert "deterministic: not proven on a GPU build" in e.value.event["message"]


def test_capture_copies_rows_from_the_device_and_they_agree_with_the_cpu(model_path, monkeypatch):
    nat = load(BUILD)
    toks = None
    nodes = ["attn_norm-0", "l_out-5"]
    results, device_calls = {}, []
    for layers in (-1, 0):
        m = core.Model(model_path, n_gpu_layers=layers, nat=nat)
        if toks is None:
            toks = m.tokenize("The quick brown fox jumps over")
        cap = C.Capture(nat)
        real = cap._device_rows
        monkeypatch.setattr(cap, "_device_rows", lambda *a, _r=real: device_calls.append(layers) or _r(*a))
        ctx = core.Context(m, n_ctx=256, n_batch=64, n_seq_max=1, eval_callback=cap.callback)
        batch = core.Batch(nat, 64)
        batch.add(toks, 0, 0)
        cap.arm(nodes, {"s": list(range(len(toks)))}, batch)
        assert ctx.decode(batch) == 0
        results[layers] = cap.take()["s"]
        ctx.close()
        m.close()
    assert -1 in device_calls, "no node was read from device memory with every layer on the GPU"
    for name in nodes:
        g, c = results[-1][name], results[0][name]
        assert g.shape == c.shape == (len(toks), g.shape[1]) and np.isfinite(g).all()
        cos = (g * c).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(c, axis=1))
        assert cos.min() > 0.999, (name, cos)


def test_per_sequence_control_vectors_steer_on_the_gpu(tmp_path):
    rng = np.random.default_rng(28)
    dirs = {il: rng.normal(scale=4.0, size=640).astype(np.float32) for il in range(1, 18)}
    path = str(cvec.write_gguf(tmp_path / "random.gguf", dirs, "gemma3"))
    c = spawn(PATCHED, controlVector=path, controlVectorLayers=[3, 9])
    try:
        assert all(i in sum((r["layers"] for r in c.ready["devices"] if r["name"] != "CPU"), [])
                   for i in (3, 9))
        off = greedy(c, 0, PROMPTS[0], controlVectorStrength=0.0)
        on = greedy(c, 1, PROMPTS[0], controlVectorStrength=1.0)
    finally:
        c.close()
    base = greedy_on_a_new_server(PATCHED, PROMPTS[0])
    assert same_up_to_a_near_tie(base, off), (base, off)  # strength 0: no vector
    shift = max(abs(a[1] - b[1]) for a, b in zip(off, on))
    assert [t[0] for t in on] != [t[0] for t in off] or shift > 0.5, (off, on)


def test_each_requests_own_vector_steers_on_the_gpu_and_a_shut_gate_does_nothing():
    """The K steering slots (`vector`, `steer`, `when`; docs/ACTIVATIONS.md) on the GPU: the
    slot product and the gate's projection and step are ggml ops the CUDA backend runs. A
    steered request moves its tokens or log-probabilities; a gate that never opens
    (above 1e30) leaves the unsteered run, up to a near tie (no deterministic mode here)."""
    rng = np.random.default_rng(57)
    data = {str(il): rng.normal(scale=4.0, size=640).tolist() for il in range(1, 18)}
    c = spawn(PATCHED)
    try:
        c.vector("v", data)
        base = greedy(c, 0, PROMPTS[0])
        on = greedy(c, 1, PROMPTS[0], steer=[{"vector": "v", "strength": 1.0}])
        shut = greedy(c, 2, PROMPTS[0], steer=[{"vector": "v", "strength": 1.0,
                                                "when": {"vector": "v", "layer": 6, "above": 1e30}}])
    finally:
        c.close()
    assert same_up_to_a_near_tie(base, shut), (base, shut)
    shift = max(abs(a[1] - b[1]) for a, b in zip(base, on))
    assert [t[0] for t in on] != [t[0] for t in base] or shift > 0.5, (base, on)


def test_sequences_together_agree_with_each_alone_up_to_a_near_tie():
    c = spawn()
    try:
        alone = [greedy(c, i, p) for i, p in enumerate(PROMPTS)]
        for i, p in enumerate(PROMPTS):
            c.infer(i, p, maxTokens=N_GEN, temperature=0, nProbs=N_TOP)
        together = []
        for i in range(len(PROMPTS)):
            toks, done = c.collect(i, timeout=300)
            assert done["type"] == "done", done
            together.append([(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]])
                             for t in toks])
    finally:
        c.close()
    for a, b in zip(alone, together):
        assert same_up_to_a_near_tie(a, b), (a, b)


def test_key_centering_runs_on_the_gpu(tmp_path, model_path):
    """init kvCenter on the GPU (the centers live in each layer's buffer type): a center
    calibrated by `clickpaca kv-center` (which runs on the CPU backend of any build) moves
    the numbers by rounding only, so greedy agrees with the uncentered run up to a near tie.
    That the center is in the graph: the centered log-probabilities move by more than
    CENTER_MOVES nats beyond what two uncentered runs differ by (their noise floor)."""
    import sys

    path = tmp_path / "center.npz"
    out = subprocess.run([sys.executable, "-m", "clickpaca", "kv-center", "-o", str(path), "--model", str(model_path),
                          "--ctx", "128", "--chunks", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    c = spawn(PATCHED, kvCenter=str(path))
    try:
        assert c.ready["kvCenter"]["layers"] == 18
        centered = greedy(c, 0, PROMPTS[0])
    finally:
        c.close()
    base = greedy_on_a_new_server(PATCHED, PROMPTS[0])
    again = greedy_on_a_new_server(PATCHED, PROMPTS[0])
    assert same_up_to_a_near_tie(base, centered), (base, centered)
    assert [t[0] for t in base] == [t[0] for t in again], (base, again)
    noise = logprob_distance(base, again)
    moved = logprob_distance(base, centered)
    assert moved > noise + CENTER_MOVES, (moved, noise)


#: The least the key centering moves a top-5 log-probability (nats) over 16 greedy tokens:
#: an f16 cache rounds centred keys differently, which moves scores by ~1e-3 relative.
CENTER_MOVES = 1e-4


def logprob_distance(a: list, b: list) -> float:
    """The largest difference of a shared top-5 token's log-probability, over the tokens
    both runs chose alike (up to the first where they part)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x[0] != y[0]:
            break
        tx, ty = dict(x[2]), dict(y[2])
        worst = max([worst, *(abs(tx[t] - ty[t]) for t in tx.keys() & ty.keys())])
    return worst
