"""A model split across RPC workers: real `rpc-server` processes of builds/mainline on
127.0.0.1 (started here on free ports), the real default model, its layers split across
the local CPU and two workers.

What the split must keep: greedy output and `score` as the local run gives them. Against
the local run the computation is not the same one: the local CPU runs some weights
repacked for its kernels (llama.cpp's extra buffer types: CPU_REPACK), a worker holds
them as they are in the file, and those kernels round differently. So local and split
runs are compared with the near-tie rule the other server tests use
(conftest.NEAR_TIE), and scores per token within what that rounding moves (stated
below). Where the computation is the same, the comparison is bit for bit: two runs of
one split, every layer on one worker against the same layers split over two, and a
deterministic server's local run against its split run over workers started with
deterministic kernels.

Failures: a wrong address, a port nobody listens on, a peer that speaks another protocol
version (a small Python peer that answers the hello only: the component under test's
peer, not a stand-in for our code), a peer that never answers, a KV cache type the
workers' build lacks (turboquant server, mainline workers), and a worker killed or
stopped mid-run (error events naming it; the server keeps answering, over stdio and
over its socket).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import orjson
import pytest

from clickpaca.wire.client import Client, ServerError
from clickpaca.llama.native import build_dir
from clickpaca.rpc import wire
from clickpaca.rpc.worker import free_port, start_local
from conftest import NEAR_TIE, TEST_CACHE_K, TEST_CACHE_V, spawn_server

pytestmark = pytest.mark.model

WORKER_BUILD = "mainline"  # make test: the workers come from builds/mainline/bin
PROMPT = "The history of the printing press begins"
N_GEN = 24
N_TOP = 5
# 18 layers + the output layer: nGpuLayers 12 keeps layers 0-6 on the local CPU and
# splits 7-18 evenly over the two workers.
SPLIT = {"nGpuLayers": 12, "tensorSplit": [1, 1]}
BASE = {"nCtx": 2048, "nSeqMax": 4, "nBatch": 512}
# Mean |dNLL| per token between the split and the local run of the score below (nats).
# Measured 2026-11-30 on this build: 0.0091 (max 0.118 on one token of 133; mean NLL
# 0.5284 local, 0.5269 split), from the repacked local weights against the workers' file
# layout (the split itself adds nothing: test_one_worker_or_two_...). A broken split
# (layers in the wrong order, stale KV, a lost row) moves the NLL by tenths or more.
SCORE_TOL = 0.02


# ------------------------------------------------------------------ helpers


def greedy(c: Client, seq_id: int, prompt: str = PROMPT, n: int = N_GEN, **params) -> list:
    c.infer(seq_id, prompt, maxTokens=n, temperature=0, nProbs=N_TOP, **params)
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)


def same_up_to_a_near_tie(ref: list, other: list) -> bool:
    step = first_difference(ref, other)
    if step is None:
        return len(ref) == len(other)
    top, chosen = dict(ref[step][2]), other[step][0]
    return chosen in top and top[ref[step][0]] - top[chosen] < NEAR_TIE


def init_error(**init) -> dict:
    """The error event a server answers this init with (the server is closed after)."""
    c = Client.spawn(python=sys.executable)
    try:
        with pytest.raises(ServerError) as e:
            c.init(build="mainline", **BASE, **init, timeout=120)
        ev = e.value.event
        assert ev["type"] == "error" and ev.get("request") == "init", ev
        return ev
    finally:
        c.close()


def remote_server(endpoints: list[str], **init) -> Client:
    return spawn_server(rpcServers=endpoints, **{**BASE, **SPLIT, **init})


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path_factory.mktemp("rpc-logs"))
    yield [w.text for w in ws]
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def local():
    c = spawn_server(**BASE)
    yield c
    c.close()


@pytest.fixture(scope="module")
def remote(workers):
    c = remote_server(workers)
    yield c
    c.close()


# ------------------------------------------------------------------ the split


def test_ready_lists_every_device_and_what_it_holds(remote, workers):
    devs = remote.ready["devices"]
    assert [d.get("endpoint") for d in devs] == [None, *workers]
    cpu, w0, w1 = devs
    assert cpu["name"] == "CPU" and w0["name"].startswith("RPC") and w1["name"].startswith("RPC")
    assert cpu["layers"] == list(range(0, 7))
    assert w0["layers"] == list(range(7, 13)) and w1["layers"] == list(range(13, 19))  # 18: output
    for d in devs:
        assert 0 < d["memoryFree"] <= d["memoryTotal"], d
        assert d["modelMiB"] > 0, d
    for d in (w0, w1):
        assert d["protocol"] == "7.0.0" and d["kvMiB"] > 0, d
    assert remote.ready["rpcServers"] == workers and remote.ready["nGpuLayers"] == 12


def test_greedy_equals_the_local_run(local, remote):
    ref = greedy(local, 0)
    split = greedy(remote, 0)
    assert same_up_to_a_near_tie(ref, split), (first_difference(ref, split), ref, split)
    again = greedy(remote, 1)
    assert again == split  # the same split, the same computation: bit for bit


def test_score_equals_the_local_run(local, remote):
    text = ("The printing press was invented in the fifteenth century. It changed how books "
            "were made and who could read them. ") * 6
    a = local.score(2, text, perToken=True)
    b = remote.score(2, text, perToken=True)
    assert a["tokens"] == b["tokens"] > 100
    diffs = [abs(x - y) for x, y in zip(a["token_nll"], b["token_nll"])]
    assert sum(diffs) / len(diffs) < SCORE_TOL, (a["nll"], b["nll"], max(diffs))
    assert remote.score(3, text, perToken=True)["token_nll"] == b["token_nll"]  # bit for bit


def test_one_worker_or_two_give_the_same_numbers_bit_for_bit(tmp_path):
    """Every layer on one worker, or split over two: the same kernels on the same
    weights, with the activations copied between the hops exactly, so greedy logprobs
    and per-token scores are equal bit for bit (what the split itself adds: nothing)."""
    ws = start_local(3, WORKER_BUILD, threads=1, log_dir=tmp_path)
    text = "The printing press was invented in the fifteenth century. " * 8
    try:
        runs = []
        for eps, split in (([ws[0].text], [1]), ([ws[1].text, ws[2].text], [1, 1])):
            c = spawn_server(rpcServers=eps, tensorSplit=split, **BASE, **{"nGpuLayers": 99})
            try:
                runs.append((greedy(c, 0), c.score(1, text, perToken=True)["token_nll"]))
            finally:
                c.close()
    finally:
        for w in ws:
            w.stop()
    assert runs[0] == runs[1]


def test_grammar_bias_and_several_sequences_in_one_batch_bit_for_bit(tmp_path):
    """Three differently steered sequences decoded together, locally and split over two
    workers, in deterministic mode with the workers' kernels pinned the same way: the
    computation is then the same one, so the runs are equal bit for bit (tokens, logprobs,
    top lists). Default mode compares local and split runs with the near-tie rule (above),
    but with three sequences the local run's repacked and tiled kernels moved one margin by
    0.57 nats on this AVX2 machine (sequence 2, step 5: 0.54 locally, -0.03 split), beyond
    it; pinned, there is nothing left to tolerate (docs/DETERMINISM.md)."""
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path, deterministic_kernels=True)
    servers = []
    try:
        servers.append(spawn_server(**BASE, deterministic=True))
        servers.append(remote_server([w.text for w in ws], deterministic=True))
        for c in servers:
            assert c.ready["deterministic"] is True
            c.grammar("yn", 'root ::= " " ("yes" | "no") "."')
        ban = greedy(servers[0], 0, n=1)[0][0]  # the local run's first token, banned below
        reqs = {
            0: dict(prompt=PROMPT, maxTokens=12, temperature=0, nProbs=N_TOP),
            1: dict(prompt="Is the sky blue? Answer:", maxTokens=8, temperature=0, grammar_id="yn",
                    nProbs=N_TOP),
            2: dict(prompt=PROMPT, maxTokens=12, temperature=0, nProbs=N_TOP,
                    logit_bias=[{"token": ban, "bias": -1e9}]),
        }
        runs = []
        for c in servers:
            c.send_raw(b"".join(orjson.dumps({"type": "infer", "seq_id": sid, **r}) + b"\n"
                                for sid, r in reqs.items()))
            out = {}
            for sid in reqs:
                toks, done = c.collect(sid)
                assert done["type"] == "done", done
                out[sid] = [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]])
                            for t in toks]
                out[f"{sid}-text"] = "".join(t["piece"] for t in toks)
            runs.append(out)
        local_run, split_run = runs
        assert split_run == local_run
        assert split_run["1-text"] in (" yes.", " no.")
        assert ban not in [t[0] for t in split_run[2]]
    finally:
        for c in servers:
            c.close()
        for w in ws:
            w.stop()


def test_output_layer_kept_local(local, remote, tmp_path):
    """outputLocal: the vocabulary projection stays on the local CPU (the logits do not
    cross the network); the worker holds less, and greedy output stays the local run's."""
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path)
    try:
        c = remote_server([w.text for w in ws], outputLocal=True)
        try:
            cpu, w0, w1 = c.ready["devices"]
            assert c.ready["outputLocal"] is True
            assert cpu["layers"] == [*range(0, 7), 18] and w1["layers"] == list(range(13, 18))
            assert w1["modelMiB"] < remote.ready["devices"][2]["modelMiB"]
            out = greedy(c, 0)
            assert same_up_to_a_near_tie(greedy(local, 0), out)
            assert greedy(c, 1) == out  # bit for bit, run to run
        finally:
            c.close()
    finally:
        for w in ws:
            w.stop()


def test_held_state_saved_and_loaded_through_the_workers(remote):
    """prefill / save / load with the KV cells on the workers: the state file carries the
    cells read back from them, and a loaded copy continues like the held original."""
    doc = "The printing press was invented in the fifteenth century by Johannes Gutenberg. " * 4
    assert remote.request({"type": "prefill", "seq_id": 2, "prompt": doc})["type"] == "prefilled"
    saved = remote.request({"type": "save", "seq_id": 2, "path": "rpc-doc"})
    assert saved["type"] == "saved" and saved["bytes"] > 0, saved
    loaded = remote.request({"type": "load", "seq_id": 3, "path": "rpc-doc"})
    assert loaded["type"] == "loaded" and loaded["tokens"] == saved["tokens"], loaded
    held = greedy(remote, 2, " It", n=8)
    again = greedy(remote, 3, " It", n=8)
    assert same_up_to_a_near_tie(held, again), (held, again)


def test_quantized_kv_cache_on_the_workers(tmp_path):
    """q8_0 K and V held by the workers (their CPU backend runs the same kernels). Workers
    of its own: a worker serves one client at a time, and `remote` holds the others."""
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path)
    try:
        c = remote_server([w.text for w in ws], cacheTypeK="q8_0", cacheTypeV="q8_0")
        try:
            assert c.ready["cacheTypeV"] == "q8_0"
            assert all(d["kvMiB"] > 0 for d in c.ready["devices"][1:])
            assert len(greedy(c, 0, n=8)) == 8
        finally:
            c.close()
    finally:
        for w in ws:
            w.stop()


# ------------------------------------------------------------------ refused at init


def test_nobody_listening_is_an_init_error():
    port = free_port()
    ev = init_error(rpcServers=[f"127.0.0.1:{port}"])
    assert ev["message"].startswith(f"rpcServers: RPC worker 127.0.0.1:{port}: connection refused"), ev


def test_an_unknown_host_is_an_init_error():
    ev = init_error(rpcServers=["no-such-worker.invalid:50052"])
    assert "rpcServers: RPC worker no-such-worker.invalid:50052: cannot resolve host" in ev["message"], ev


@pytest.mark.parametrize("bad, why", [
    (["127.0.0.1"], "must be \"host:port\""),
    (["127.0.0.1:0"], "port must be 1..65535"),
    (["a:1", "a:1"], "listed twice"),
    ([], "non-empty list"),
])
def test_malformed_endpoints_are_refused_by_the_protocol(bad, why):
    from clickpaca.wire.protocol import ProtocolError, validate

    with pytest.raises(ProtocolError) as e:
        validate({"type": "init", "rpcServers": bad})
    assert str(e.value).startswith("rpcServers: ") and why in str(e.value)


class Peer:
    """A TCP peer on 127.0.0.1 that reads ggml-rpc's hello and answers it with the given
    protocol version (or never answers)."""

    def __init__(self, version: tuple[int, int, int] | None) -> None:
        self.version = version
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.endpoint = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            try:
                cmd, size = struct.unpack("<BQ", self._exact(conn, 9))
                self._exact(conn, size)
                if cmd == wire.RPC_CMD_HELLO and self.version is not None:
                    body = bytes(self.version) + b"\0" + bytes(wire.RPC_CONN_CAPS_SIZE)
                    conn.sendall(struct.pack("<Q", len(body)) + body)
            except OSError:
                pass

    @staticmethod
    def _exact(conn: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise OSError("closed")
            out += chunk
        return out

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def test_another_protocol_version_is_an_init_error():
    peer = Peer((6, 0, 0))
    try:
        ev = init_error(rpcServers=[peer.endpoint])
    finally:
        peer.close()
    assert ev["message"].startswith(f"rpcServers: RPC worker {peer.endpoint}: protocol version 6.0.0, "
                                    "this build speaks 7.0.0"), ev


def test_a_peer_that_never_answers_the_hello_is_an_init_error():
    peer = Peer(None)
    try:
        ev = init_error(rpcServers=[peer.endpoint], rpcTimeout=1)
    finally:
        peer.close()
    assert "did not answer the handshake within 1 s" in ev["message"], ev


def test_tensor_split_must_match_the_devices(tmp_path):
    [w] = start_local(1, WORKER_BUILD, threads=1, log_dir=tmp_path)
    try:
        ev = init_error(rpcServers=[w.text], tensorSplit=[1, 1])
    finally:
        w.stop()
    assert ev["message"].startswith("tensorSplit: 2 values for 1 RPC devices"), ev


def test_a_worker_busy_with_another_server_is_an_init_error(remote, workers):
    """A worker serves one client at a time: a second server gets a clear error."""
    ev = init_error(rpcServers=workers[:1], rpcTimeout=2)
    assert ev["message"].startswith(f"rpcServers: RPC worker {workers[0]}: accepted the connection but "
                                    "did not answer the handshake within 2 s (busy serving another client?"), ev


@pytest.mark.turboquant
def test_a_kv_cache_type_the_workers_lack_is_refused(tmp_path):
    """A turboquant server with mainline workers: turbo3 is no ggml type of theirs (and a
    worker of the turboquant build holds it)."""
    if not (build_dir("turboquant") / "build-info.json").exists():
        pytest.fail("builds/turboquant is missing: run `make turboquant`")
    [w] = start_local(1, WORKER_BUILD, threads=1, log_dir=tmp_path)
    try:
        c = Client.spawn(python=sys.executable)
        try:
            with pytest.raises(ServerError) as e:
                c.init(build="turboquant", cacheTypeK="q8_0", cacheTypeV="turbo3", rpcServers=[w.text],
                       **BASE, timeout=120)
        finally:
            c.close()
        msg = e.value.event["message"]
        assert msg.startswith(f"cacheTypeV: turbo3 is not supported by the RPC worker {w.text}: "
                              "its build has no ggml type"), msg
        assert w.proc.poll() is None  # the worker survived the probe and serves the next client
        ok = spawn_server(rpcServers=[w.text], **BASE, **{"nGpuLayers": 99})
        try:
            assert len(greedy(ok, 0, n=4)) == 4
        finally:
            ok.close()
    finally:
        w.stop()
    # a worker of the turboquant build holds a turbo3 cache
    [tq] = start_local(1, "turboquant", threads=1, log_dir=tmp_path)
    try:
        c = spawn_server(build="turboquant", cacheTypeK="q8_0", cacheTypeV="turbo3", rpcServers=[tq.text],
                         **BASE, **{"nGpuLayers": 99})
        try:
            assert c.ready["devices"][1]["kvMiB"] > 0
            assert len(greedy(c, 0, n=4)) == 4
        finally:
            c.close()
    finally:
        tq.stop()


# ------------------------------------------------------------------ lost mid-run


def lose_mid_run(c: Client, worker, how: int) -> tuple[list, dict]:
    """Start a long generation, send the worker `how` (SIGKILL or SIGSTOP) once tokens
    flow, and return the tokens and the event that ended the request."""
    c.infer(0, PROMPT, maxTokens=4000, temperature=0,
            logit_bias=[{"token": t, "bias": -1e9} for t in (1, 106, 212)])
    stream = c.stream(0, timeout=300)
    toks = []
    for ev in stream:
        if ev["type"] != "token":
            return toks, ev
        toks.append(ev)
        if len(toks) == 5:
            os.kill(worker.proc.pid, how)
    raise AssertionError("the stream ended without an end event")


def test_a_worker_killed_mid_run(tmp_path):
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path)
    c = remote_server([w.text for w in ws])
    try:
        toks, end = lose_mid_run(c, ws[1], signal.SIGKILL)
        assert len(toks) >= 5
        assert end["type"] == "error" and end["seq_id"] == 0, end
        assert end["message"].startswith(f"lost the RPC worker {ws[1].text}: it closed the connection"), end
        # The server keeps answering: every request gets an error naming the worker.
        c.infer(1, "Hello", maxTokens=2)
        _, again = c.collect(1, timeout=60)
        assert again["type"] == "error" and ws[1].text in again["message"], again
        assert "cannot decode any more" in again["message"]
        c.quit()
        assert c.close(timeout=60) == 3  # server.EXIT_WORKER_LOST
    finally:
        c.close(timeout=5)
        for w in ws:
            w.stop()


def test_a_worker_that_hangs_mid_run(tmp_path):
    """SIGSTOP: the connection stays up and nothing comes back; rpcTimeout names it."""
    ws = start_local(2, WORKER_BUILD, threads=1, log_dir=tmp_path)
    c = remote_server([w.text for w in ws], rpcTimeout=5)
    try:
        toks, end = lose_mid_run(c, ws[0], signal.SIGSTOP)
        assert end["type"] == "error", end
        assert end["message"].startswith(f"lost the RPC worker {ws[0].text}: it did not answer within "
                                         "rpcTimeout (5 s)"), end
        c.infer(1, "Hello", maxTokens=2)
        assert c.collect(1, timeout=60)[1]["type"] == "error"
    finally:
        os.kill(ws[0].proc.pid, signal.SIGCONT)
        c.close(timeout=30)
        for w in ws:
            w.stop()


def test_the_socket_server_keeps_answering_after_a_lost_worker(tmp_path):
    ws = start_local(1, WORKER_BUILD, threads=1, log_dir=tmp_path)
    path = tmp_path / "s.sock"
    init = {"build": "mainline", "stateDir": str(tmp_path / "state"), "rpcServers": [ws[0].text],
            "nGpuLayers": 99, "cacheTypeK": TEST_CACHE_K, "cacheTypeV": TEST_CACHE_V, **BASE}
    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", "serve", "--socket", str(path),
                             "--init", orjson.dumps(init).decode()], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        a = Client.connect(path)
        toks, end = lose_mid_run(a, ws[0], signal.SIGKILL)
        assert end["type"] == "error" and ws[0].text in end["message"], end
        b = Client.connect(path)  # a client that comes after the loss
        b.infer(0, "Hello", maxTokens=2)
        _, ev = b.collect(0, timeout=60)
        assert ev["type"] == "error" and ws[0].text in ev["message"], ev
        a.close()
        b.close()
        proc.terminate()
        assert proc.wait(60) == 3
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in ws:
            w.stop()
