"""The RPC checks that need no model: endpoint parsing, the hello handshake against
small Python peers on 127.0.0.1 (they speak ggml-rpc's framing: the peer of the code
under test), and reading llama.cpp's load log for the `ready` device rows."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from clickpaca.measure.bench import rpc as bench_rpc
from clickpaca.rpc import wire
from clickpaca.rpc.devices import assigned_layers, buffer_sizes


@pytest.mark.parametrize("text, host, port", [("127.0.0.1:50052", "127.0.0.1", 50052),
                                              ("worker-1.lan:1", "worker-1.lan", 1)])
def test_endpoints_parse(text, host, port):
    assert wire.parse_endpoint(text) == wire.Endpoint(host, port)
    assert str(wire.parse_endpoint(text)) == text


@pytest.mark.parametrize("text", ["127.0.0.1", ":50052", "h:", "h:0", "h:65536", "h:x", "[::1]:5", "a b:1", 5])
def test_bad_endpoints_are_refused(text):
    with pytest.raises(ValueError):
        wire.parse_endpoint(text)


def test_a_bad_endpoint_reads_as_any_bad_field():
    """The value as JSON (fieldcheck.show), as every field's error writes it."""
    from clickpaca.wire.protocol import ProtocolError, validate

    with pytest.raises(ProtocolError) as e:
        validate({"type": "init", "rpcServers": ["h:0"]})
    assert e.value.message == 'rpcServers: "h:0": port must be 1..65535, got "h:0"'


def test_a_missing_rpc_server_names_the_make_target(tmp_path, monkeypatch):
    """Each build's own target (`make activations` for the activations build: it said
    `make setup`), `setup` for any other name."""
    from clickpaca.rpc.worker import tool_path

    monkeypatch.setenv("CLICKPACA_BUILDS", str(tmp_path))
    for build, target in (("mainline", "mainline"), ("turboquant", "turboquant"),
                          ("activations", "activations"), ("mine", "setup")):
        with pytest.raises(FileNotFoundError, match=f"run `make {target}`"):
            tool_path(build)


def test_the_rpc_tensor_layout_of_protocol_7():
    # struct rpc_tensor (packed): static_assert(sizeof % 8 == 0) in ggml-rpc.cpp
    assert wire.RPC_TENSOR.size == 296 and wire.RPC_TENSOR.size % 8 == 0


class OnePeer:
    """Accepts one connection, reads one request, then does `answer(conn, cmd, payload)`."""

    def __init__(self, answer) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.ep = wire.Endpoint("127.0.0.1", self.srv.getsockname()[1])
        self.seen: list[tuple[int, bytes]] = []
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            try:
                while True:
                    head = wire._recv_exact(conn, 9)
                    cmd, size = struct.unpack("<BQ", head)
                    payload = wire._recv_exact(conn, size)
                    self.seen.append((cmd, payload))
                    if not self.answer(conn, cmd, payload):
                        return
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self.srv.close()
        self.thread.join(5)


def hello_answer(version: bytes, extra_types_ok: bool = True):
    def answer(conn, cmd, payload) -> bool:
        if cmd == wire.RPC_CMD_HELLO:
            body = version + b"\0" + bytes(wire.RPC_CONN_CAPS_SIZE)
            conn.sendall(struct.pack("<Q", len(body)) + body)
            return True
        if cmd == wire.RPC_CMD_GET_ALLOC_SIZE and extra_types_ok:
            conn.sendall(struct.pack("<QQ", 8, 4096))
            return True
        return False  # close: what a worker does with a type it does not know
    return answer


def test_hello_reads_the_version_and_sends_zero_caps():
    peer = OnePeer(hello_answer(bytes([7, 0, 0])))
    try:
        info = wire.check_worker(peer.ep, (7, 0, 0), timeout=5)
    finally:
        peer.close()
    assert info.version == (7, 0, 0)
    assert peer.seen == [(wire.RPC_CMD_HELLO, bytes(wire.RPC_CONN_CAPS_SIZE))]


@pytest.mark.parametrize("theirs, ok", [((7, 0, 3), True), ((6, 9, 0), False), ((8, 0, 0), False),
                                        ((7, 1, 0), False)])
def test_versions_follow_ggml_rpcs_rule(theirs, ok):
    assert wire.compatible(theirs, (7, 0, 0)) is ok


def test_a_version_mismatch_names_both_versions():
    peer = OnePeer(hello_answer(bytes([6, 2, 1])))
    try:
        with pytest.raises(wire.WorkerCheckError) as e:
            wire.check_worker(peer.ep, (7, 0, 0), timeout=5)
    finally:
        peer.close()
    assert str(e.value).startswith(f"RPC worker {peer.ep}: protocol version 6.2.1, this build speaks 7.0.0")


def test_a_type_the_peer_drops_the_connection_for_is_named():
    peer = OnePeer(hello_answer(bytes([7, 0, 0]), extra_types_ok=False))
    try:
        with pytest.raises(wire.WorkerCheckError) as e:
            wire.check_worker(peer.ep, (7, 0, 0), timeout=5, types={"cacheTypeV": ("turbo3", 41, 14, 32)})
    finally:
        peer.close()
    assert e.value.field == "cacheTypeV"
    assert str(e.value).startswith(f"cacheTypeV: turbo3 is not supported by the RPC worker {peer.ep}")
    cmd, payload = peer.seen[1]
    assert cmd == wire.RPC_CMD_GET_ALLOC_SIZE and len(payload) == 4 + wire.RPC_TENSOR.size * 11
    fields = wire.RPC_TENSOR.unpack(payload[4:4 + wire.RPC_TENSOR.size])
    assert fields[1] == 41 and fields[3] == wire.PROBE_NE0  # the type, ne[0]


def test_known_types_pass_the_probe():
    peer = OnePeer(hello_answer(bytes([7, 0, 0])))
    try:
        wire.check_worker(peer.ep, (7, 0, 0), timeout=5, types={"cacheTypeK": ("q8_0", 8, 34, 32),
                                                                 "cacheTypeV": ("f16", 1, 2, 1)})
    finally:
        peer.close()
    assert [c for c, _ in peer.seen] == [wire.RPC_CMD_HELLO] + [wire.RPC_CMD_GET_ALLOC_SIZE] * 2


def test_silence_after_the_connect_is_a_timeout():
    # the peer stays silent (and connected) until the check has given up, however long a
    # loaded machine takes to get there: a fixed wait could end first and close instead
    given_up = threading.Event()
    peer = OnePeer(lambda conn, cmd, payload: given_up.wait(120) and False)
    try:
        with pytest.raises(wire.WorkerCheckError) as e:
            wire.check_worker(peer.ep, (7, 0, 0), timeout=0.5)
    finally:
        given_up.set()
        peer.close()
    assert "did not answer the handshake within 0.5 s" in str(e.value)


def test_a_closed_port_is_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(wire.WorkerCheckError) as e:
        wire.check_worker(wire.Endpoint("127.0.0.1", port), (7, 0, 0), timeout=5)
    assert "connection refused" in str(e.value)


LOG = """\
load_tensors: layer   0 assigned to device CPU, is_swa = 1
load_tensors: layer   1 assigned to device CPU, is_swa = 0
load_tensors: layer   2 assigned to device RPC0, is_swa = 1
load_tensors: layer   3 assigned to device RPC1, is_swa = 0
load_tensors:   CPU_Mapped model buffer size =   100.50 MiB
load_tensors: RPC0[127.0.0.1:5000] model buffer size =    20.00 MiB
llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     4.00 MiB
llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     2.00 MiB
sched_reserve:        CPU compute buffer size =     1.25 MiB
"""


def test_the_load_log_gives_layers_and_buffers():
    lines = LOG.splitlines(keepends=True)
    assert assigned_layers(lines) == {"CPU": [0, 1], "RPC0": [2], "RPC1": [3]}
    assert buffer_sizes(lines) == {("CPU_Mapped", "model"): 100.5, ("RPC0[127.0.0.1:5000]", "model"): 20.0,
                                   ("RPC0[127.0.0.1:5000]", "KV"): 6.0, ("CPU", "compute"): 1.25}


def test_bench_sides_and_bytes_per_token():
    names = [n for n, _ in bench_rpc.sides(["a:1", "b:2"])]
    assert names == ["local", "1 worker", "2 workers"]
    assert bench_rpc.sides(["a:1", "b:2"])[2][1]["rpcServers"] == ["a:1", "b:2"]
    before = {"a:1": {"sent": 10, "received": 5}, "b:2": {"sent": 0, "received": 0}}
    after = {"a:1": {"sent": 110, "received": 25}, "b:2": {"sent": 50, "received": 15}}
    d = bench_rpc.delta(before, after)
    assert d == {"sent": 150, "received": 35}
    assert bench_rpc.per_token(d, 10) == {"sent": 15.0, "received": 3.5, "total": 18.5}
