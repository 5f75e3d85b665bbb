"""init's kvCenter through the real server and the real `clickpaca kv-center` (#42).

The center file comes from the command itself; the server picks the patched build for it
(mainline's cache types are all there), reports the center in `ready`, and in
deterministic mode a centered sequence's numbers do not depend on its batch neighbours.
A KV state saved under a center loads under that center only. A file that is not a center,
and the mainline build (no llama_set_kv_center), are refused naming kvCenter. That the
native subtraction is the study's, bit for bit: tests/test_kvcenter_native.py.

Needs the patched build (`make patched`; `make test` builds it): a missing build fails
the init, never skips."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from clickpaca.engine import kvstate
from clickpaca.llama import kvcenter
from clickpaca.wire.client import Client, ServerError

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The movie was", "My day at the office was", "The food at the restaurant"]
N_GEN = 10
TYPES = {"cacheTypeK": "f16", "cacheTypeV": "f16"}  # deterministic mode refuses q4_0 (no flash attention)


@pytest.fixture(scope="module")
def center_path(tmp_path_factory, model_path) -> str:
    path = tmp_path_factory.mktemp("center") / "gemma.npz"
    out = subprocess.run([sys.executable, "-m", "clickpaca", "kv-center", "-o", str(path), "--model", str(model_path),
                          "--ctx", "128", "--chunks", "1", "--threads", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "18 layers, 4608 floats" in out.stdout  # Gemma 3 270M: 18 layers of one 256-wide KV head
    return str(path)


def spawn(**init) -> Client:
    c = Client.spawn("--allow-any-path")
    try:
        c.init(nCtx=1024, nSeqMax=4, deterministic=True, stateDir=tempfile.mkdtemp(prefix="clkp-state-"),
               **TYPES, **init)
    except BaseException:
        c.close()
        raise
    return c


@pytest.fixture(scope="module")
def centered(center_path):
    c = spawn(kvCenter=center_path)
    yield c
    c.close()


def greedy(c: Client, seq_id: int, prompt: str) -> list:
    c.infer(seq_id, prompt, maxTokens=N_GEN, temperature=0, nProbs=3)
    toks, done = c.collect(seq_id, timeout=300)
    assert done["type"] == "done", done
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def test_ready_reports_the_center_and_the_build(centered, center_path):
    r = centered.ready
    assert r["build"] == "kvcenter"  # chosen for kvCenter: f16 alone would be mainline's
    c = kvcenter.read(center_path)
    assert r["kvCenter"]["digest"] == c.digest and r["kvCenter"]["layers"] == 18
    assert r["kvCenter"]["calibration"]["tokens"] == 128 and r["kvCenter"]["path"] == center_path


def test_a_centered_sequence_runs_as_it_runs_alone(centered, center_path):
    """Beside neighbours and in a new process: the same bits (deterministic mode's promise)."""
    alone = {p: greedy(centered, 0, p) for p in PROMPTS}
    again = spawn(kvCenter=center_path)
    try:
        assert greedy(again, 3, PROMPTS[0]) == alone[PROMPTS[0]]
    finally:
        again.close()
    lines = [json.dumps({"type": "infer", "seq_id": s, "prompt": p, "maxTokens": N_GEN, "temperature": 0,
                         "nProbs": 3}).encode() + b"\n" for s, p in enumerate(PROMPTS)]
    centered.send_raw(b"".join(lines))
    for s, p in enumerate(PROMPTS):
        toks, done = centered.collect(s, timeout=300)
        assert done["type"] == "done", done
        assert [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks] == alone[p]


def test_a_state_loads_under_its_own_center_only(centered, center_path, tmp_path):
    path = tmp_path / "doc.kv"
    centered.request({"type": "prefill", "seq_id": 1, "prompt": PROMPTS[1]})
    centered.request({"type": "save", "seq_id": 1, "path": str(path)})
    header = kvstate.read(path)[0]
    assert header["cache"] == {"type_k": "f16", "type_v": "f16", "k_center": kvcenter.read(center_path).digest}
    assert centered.request({"type": "load", "seq_id": 2, "path": str(path)})["type"] == "loaded"
    centered.request({"type": "free", "seq_id": 1})
    centered.request({"type": "free", "seq_id": 2})
    plain = spawn(build="kvcenter")
    try:
        assert plain.ready["kvCenter"] is None
        # the center is really in the graph: the same prompt's numbers move (by rounding, in f16)
        assert greedy(plain, 3, PROMPTS[0]) != greedy(centered, 3, PROMPTS[0])
        with pytest.raises(ServerError) as e:
            plain.request({"type": "load", "seq_id": 0, "path": str(path)})
        msg = e.value.event["message"]
        assert "key center" in msg and "no key center" in msg, msg
    finally:
        plain.close()


@pytest.mark.parametrize("init, why", [
    ({"kvCenter": "/nonexistent/center.npz"}, "kvCenter: /nonexistent/center.npz: no such file"),
    ({"kvCenter": "CENTER", "build": "mainline"}, "kvCenter: build 'mainline' lacks llama_set_kv_center"),
])
def test_refusals_name_kv_center(center_path, init, why):
    init = {k: center_path if v == "CENTER" else v for k, v in init.items()}
    c = Client.spawn("--allow-any-path")
    try:
        with pytest.raises(ServerError) as e:
            c.init(nCtx=512, nSeqMax=1, **TYPES, **init)
        assert e.value.event["message"].startswith(why), e.value.event
    finally:
        c.close()
