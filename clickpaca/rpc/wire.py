"""ggml-rpc's wire format, spoken from Python to check a worker before ggml-rpc does.

ggml-rpc aborts the whole process when a connect or its handshake fails (GGML_ABORT), so
`init` first asks each worker itself, with timeouts: a TCP connect, the HELLO command
(the worker's protocol version), and for each KV cache type a GET_ALLOC_SIZE of a small
tensor of that type (a worker whose build lacks the type drops the connection instead of
answering). Each gets a `WorkerCheckError` that says what failed and where.

The format (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7.x): a request is one command
byte, its size as a little-endian uint64 and its bytes; a response is its size as a
uint64 and its bytes. HELLO must come first on a connection. The worker serves one
connection at a time, so a worker busy with another client accepts the connection but
does not answer the HELLO.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from ..base.fieldcheck import show

RPC_CMD_GET_ALLOC_SIZE = 13  # enum rpc_cmd (ALLOC_BUFFER = 0, ...)
RPC_CMD_HELLO = 14  # fixed in every protocol version ("RPC_CMD_HELLO must be always 14")
RPC_CONN_CAPS_SIZE = 24  # transport capabilities (RDMA); all zero: plain TCP
# The serialized ggml tensor (struct rpc_tensor, packed) of protocol 7: id, type, buffer,
# ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data, name[64],
# use_count.
MAX_DIMS, MAX_SRC, MAX_OP_PARAMS, MAX_NAME = 4, 10, 64, 64
RPC_TENSOR = struct.Struct(f"<QIQ{MAX_DIMS}I{MAX_DIMS}II{MAX_OP_PARAMS // 4}ii{MAX_SRC}QQQQ{MAX_NAME}si")
assert RPC_TENSOR.size == 296
PROBE_PROTOCOL_MAJOR = 7  # the layout above is that of this major version
PROBE_NE0 = 4096  # a row length every ggml block size divides (ggml_new_tensor asserts it)


class WorkerCheckError(RuntimeError):
    """A worker that cannot be used; the message names it and says why, `field` the init
    field to blame (rpcServers, or the cache type a worker lacks)."""

    def __init__(self, message: str, field: str = "rpcServers") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """"host:port" (the form ggml-rpc takes: no brackets, IPv4 or a host name);
    ValueError saying what is wrong."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise ValueError(f"must be \"host:port\", got {show(text)}")
    host, port = text.split(":")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"must be \"host:port\" with a host name or IPv4 address, got {show(text)}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port must be 1..65535, got {show(text)}")
    return Endpoint(host, int(port))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("the worker closed the connection")
        out += chunk
    return bytes(out)


def request(sock: socket.socket, cmd: int, payload: bytes, max_response: int = 1 << 16) -> bytes:
    """Send one command and read its response (size-prefixed)."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size > max_response:
        raise ValueError(f"a response of {size} bytes (expected at most {max_response})")
    return _recv_exact(sock, size)


def connect(ep: Endpoint, timeout: float) -> socket.socket:
    """A TCP connection to the worker, or WorkerCheckError naming it and the cause."""
    try:
        return socket.create_connection((ep.host, ep.port), timeout=timeout)
    except socket.gaierror as e:
        raise WorkerCheckError(f"RPC worker {ep}: cannot resolve host {ep.host!r} ({e.strerror})") from None
    except ConnectionRefusedError:
        raise WorkerCheckError(f"RPC worker {ep}: connection refused (no worker listening there; "
                               f"start one with `clickpaca rpc-server --port {ep.port}`)") from None
    except (socket.timeout, TimeoutError):
        raise WorkerCheckError(f"RPC worker {ep}: no answer to the TCP connect within {timeout:g} s "
                               "(wrong address, or a firewall drops the packets)") from None
    except OSError as e:
        raise WorkerCheckError(f"RPC worker {ep}: cannot connect ({e.strerror or e})") from None


def hello(sock: socket.socket, ep: Endpoint) -> tuple[int, int, int]:
    """The worker's protocol version (major, minor, patch), from the HELLO command."""
    try:
        rsp = request(sock, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE))
    except (socket.timeout, TimeoutError):
        raise WorkerCheckError(
            f"RPC worker {ep}: accepted the connection but did not answer the handshake within "
            f"{sock.gettimeout():g} s (busy serving another client? a worker serves one at a "
            "time; or not an RPC worker)") from None
    except (ConnectionError, ValueError, OSError) as e:
        raise WorkerCheckError(
            f"RPC worker {ep}: the handshake failed ({e}): not an RPC worker, one of an older "
            "protocol that expects another hello, or an SSH tunnel whose far end has no worker "
            "running") from None
    if len(rsp) < 3:
        raise WorkerCheckError(f"RPC worker {ep}: a {len(rsp)}-byte hello response (expected the "
                               "protocol version): not an RPC worker")
    return rsp[0], rsp[1], rsp[2]


def compatible(worker: tuple[int, int, int], ours: tuple[int, int, int]) -> bool:
    """ggml-rpc's own rule (negotiate_hello): the same major version, and a minor version
    no newer than the client's."""
    return worker[0] == ours[0] and worker[1] <= ours[1]


def probe_type(sock: socket.socket, ep: Endpoint, ggml_type: int, type_size: int, blck_size: int) -> bool:
    """Whether the worker's build knows a ggml type: GET_ALLOC_SIZE of a one-row tensor of
    that type (no buffer, no data). The worker answers with a size, or drops the
    connection when the type is beyond its own list. Protocol 7 layout only."""
    row = PROBE_NE0 // blck_size * type_size
    fields = [0x636c6b70, ggml_type, 0, PROBE_NE0, 1, 1, 1, type_size, row, row, row, 0,
              *([0] * (MAX_OP_PARAMS // 4)), 0, *([0] * MAX_SRC), 0, 0, 0, b"clickpaca-probe", 0]
    tensor = RPC_TENSOR.pack(*fields)
    empty = bytes(RPC_TENSOR.size)
    payload = struct.pack("<I", 0) + tensor + empty * MAX_SRC
    try:
        rsp = request(sock, RPC_CMD_GET_ALLOC_SIZE, payload)
    except (ConnectionError, ValueError):
        return False
    except (socket.timeout, TimeoutError):
        raise WorkerCheckError(f"RPC worker {ep}: no answer within {sock.gettimeout():g} s "
                               "to a query of a tensor size") from None
    return len(rsp) == 8


@dataclass(frozen=True)
class WorkerInfo:
    endpoint: Endpoint
    version: tuple[int, int, int]


def check_worker(ep: Endpoint, ours: tuple[int, int, int], timeout: float,
                 types: dict[str, tuple[str, int, int, int]] | None = None) -> WorkerInfo:
    """Connect, compare protocol versions and probe the KV cache types; the connection is
    closed again (the worker then waits for ggml-rpc's own). `types`: init field ->
    (cache type name, ggml type, type size, block size). WorkerCheckError on any failure."""
    sock = connect(ep, min(timeout, 10.0))
    try:
        sock.settimeout(timeout)
        version = hello(sock, ep)
        if not compatible(version, ours):
            raise WorkerCheckError(
                f"RPC worker {ep}: protocol version {'.'.join(map(str, version))}, this build speaks "
                f"{'.'.join(map(str, ours))} (the major versions must match and the worker's minor "
                "must not be newer): run a worker of this build (`clickpaca rpc-server`)")
        if types and ours[0] == PROBE_PROTOCOL_MAJOR:
            for field, (name, t, size, blck) in types.items():
                if not probe_type(sock, ep, t, size, blck):
                    raise WorkerCheckError(
                        f"{field}: {name} is not supported by the RPC worker {ep}: its build has no "
                        f"ggml type {t} ({name}); run workers of the server's build "
                        "(`clickpaca rpc-server --build NAME`)", field)
        return WorkerInfo(ep, version)
    except WorkerCheckError:
        # Close with a reset: a busy worker that accepts this connection later then reads
        # an error instead of a hello it would answer into a closed socket.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raise
    finally:
        sock.close()
