"""The RPC workers of one model, registered through ggml-rpc with our own timeouts.

ggml-rpc keeps one connection per worker (its "dispatcher": a socket and a thread that
sends every command) for as long as anything uses that worker, and sets no socket
timeouts: a worker that hangs would block the decode forever. So before the model
loads, `RpcDevices` opens each worker's connection itself, with ggml_backend_rpc_init,
and holds that backend until the model is gone: the model's weights, KV cache and every
decode then go through this one connection. Right after it opens, the socket is found
(the process's socket whose peer is the worker) and given SO_RCVTIMEO/SO_SNDTIMEO, and
the dispatcher thread is noted: a socket error then surfaces as ggml-rpc's abort on
that thread, which loss.py turns into a lost worker with a name.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from ..llama import features, gpu
from .wire import Endpoint

TCP_STATES = {1: "established", 7: "closed", 8: "close-wait"}  # linux/tcp_states.h


class RpcUnavailable(RuntimeError):
    """This build has no usable RPC backend."""


@dataclass
class Worker:
    """One worker: its endpoint, our connection to it, and the devices it offers."""

    endpoint: Endpoint
    text: str  # the endpoint exactly as ggml-rpc is given it (its dispatchers are keyed by it)
    version: tuple[int, int, int]
    rpc_backend: Any = None  # the ggml_backend_t that holds the connection open
    fd: int | None = None  # the connection's socket (owned by ggml-rpc; never closed here)
    thread: int | None = None  # native id of its dispatcher thread
    devices: list = field(default_factory=list)  # ggml_backend_dev_t


def _native_threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # no /proc (macOS): the lost worker is then found by its socket state
        return set()


def _socket_fds() -> list[int]:
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 4096))
    out = []
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                out.append(fd)
        except OSError:
            pass
    return out


def _peer(fd: int) -> tuple | None:
    """The peer address of an inet socket fd (through a duplicate, closed again)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return s.getpeername()[:2]
    except OSError:
        return None
    finally:
        s.close()  # closes the duplicate only: the connection stays ggml-rpc's


def _with_socket(fd: int, fn):
    """Apply fn to a duplicate of fd: socket options and TCP state are the socket's, so
    setting them on the duplicate sets them for ggml-rpc's descriptor too."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        return fn(s)
    finally:
        s.close()


def set_timeouts(fd: int, seconds: float) -> None:
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))

    def apply(s: socket.socket) -> None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    _with_socket(fd, apply)


def tcp_state(fd: int) -> str | None:
    """"established", "close-wait" (the worker closed), "closed" (reset), other states by
    number; None where TCP_INFO is not available."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = _with_socket(fd, lambda s: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8))
    except OSError:
        return "closed"
    return TCP_STATES.get(info[0], f"state {info[0]}")


class RpcDevices:
    """Opens, tunes and holds the workers' connections; lists their devices."""

    def __init__(self, nat, checked: list[tuple[str, Endpoint, tuple[int, int, int]]], timeout: float) -> None:
        self.nat = nat
        self.timeout = timeout
        self.workers: list[Worker] = []
        ffi = nat.ffi
        try:
            for text, ep, version in checked:
                self.workers.append(self._open(text, ep, version))
        except BaseException:
            self.close()
            raise
        devs = [d for w in self.workers for d in w.devices]
        self.dev_array = ffi.new("ggml_backend_dev_t[]", devs + [ffi.NULL])

    def _open(self, text: str, ep: Endpoint, version: tuple[int, int, int]) -> Worker:
        ffi, lib = self.nat.ffi, self.nat.lib
        w = Worker(ep, text, version)
        # (features.py "rpc": b6170 has neither ggml_backend_rpc_add_server nor the device
        # argument of ggml_backend_rpc_init; protocol_version refused such builds already)
        python_threads = {t.native_id for t in threading.enumerate()}
        before = _native_threads()
        w.rpc_backend = lib.ggml_backend_rpc_init(text.encode(), 0)  # connects and says hello
        if w.rpc_backend == ffi.NULL:
            raise RuntimeError(f"ggml-rpc could not open a backend on {text}")
        new = _native_threads() - before - python_threads
        w.thread = new.pop() if len(new) == 1 else None
        try:
            addr = socket.gethostbyname(ep.host)  # ggml-rpc resolves with gethostbyname too
        except OSError:
            addr = ep.host
        fds = [fd for fd in _socket_fds() if _peer(fd) == (addr, ep.port)]
        # Our own check's connection is closed; another connection of this process to the
        # same worker would be an older init's, which one process never has.
        w.fd = fds[-1] if fds else None
        if w.fd is not None:
            set_timeouts(w.fd, self.timeout)
        reg = lib.ggml_backend_rpc_add_server(text.encode())  # its devices, over this connection
        if reg == ffi.NULL:
            raise RuntimeError(f"the RPC worker {text} offers no devices")
        w.devices = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
        return w

    @property
    def n_devices(self) -> int:
        return sum(len(w.devices) for w in self.workers)

    # -------------------------------------------------------------- losing one

    def worker_of_thread(self, native_id: int) -> Worker | None:
        return next((w for w in self.workers if w.thread == native_id), None)

    def state(self, w: Worker) -> str | None:
        return tcp_state(w.fd) if w.fd is not None else None

    def describe_loss(self, native_id: int) -> tuple[Worker | None, str]:
        """Which worker failed (the one whose dispatcher thread aborted, else the one whose
        connection is no longer established) and what it looks like from here."""
        w = self.worker_of_thread(native_id)
        if w is None:
            gone = [x for x in self.workers if self.state(x) not in ("established", None)]
            w = gone[0] if len(gone) == 1 else None
        if w is None:
            return None, "a connection to an RPC worker failed"
        st = self.state(w)
        if st == "established":
            why = (f"did not answer within rpcTimeout ({self.timeout:g} s): hung, stopped or "
                   "overloaded")
        elif st is None:
            why = "the connection failed"
        else:
            why = f"closed the connection (TCP {st}): the worker process ended or dropped it"
        return w, why

    def close(self) -> None:
        """Release the held connections (after the model and context are freed)."""
        lib = self.nat.lib
        for w in self.workers:
            if w.rpc_backend is not None:
                lib.ggml_backend_free(w.rpc_backend)
                w.rpc_backend = None


_LAYER_RE = re.compile(r"layer +(\d+) assigned to device (\S+?),")
_BUFFER_RE = re.compile(r"^\S+: +(\S+) (model|KV|compute) buffer size = +([0-9.]+) MiB")


def assigned_layers(lines: list[str]) -> dict[str, list[int]]:
    """Device name -> the layers llama.cpp assigned to it (its debug log while loading;
    layer n_layer is the output layer)."""
    out: dict[str, list[int]] = {}
    for line in lines:
        m = _LAYER_RE.search(line)
        if m:
            out.setdefault(m.group(2), []).append(int(m.group(1)))
    return out


def buffer_sizes(lines: list[str]) -> dict[tuple[str, str], float]:
    """(buffer name, "model" | "KV" | "compute") -> MiB, as llama.cpp logs them."""
    out: dict[tuple[str, str], float] = {}
    for line in lines:
        m = _BUFFER_RE.search(line.strip())
        if m:
            key = (m.group(1), m.group(2))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def device_rows(nat, workers: RpcDevices | None, log_lines: list[str],
                output_layer: int | None = None) -> list[dict]:
    """One row per device for `ready`: the local CPU first, then this process's GPUs
    (llama/gpu.py), then each worker's devices,
    with free and total memory and what each holds: its layers (layer nLayer is the
    output layer) and its model / KV / compute buffers in MiB, as llama.cpp logged them
    while loading the model and creating the context. `output_layer`: the output layer's
    index when its weights were kept local (outputLocal): it is listed on the CPU."""
    ffi, lib = nat.ffi, nat.lib
    if not features.available(nat, "device-rows"):
        return []  # an older llama.cpp without ggml's device API
    layers = assigned_layers(log_lines)
    if output_layer is not None:
        layers = {d: [i for i in ls if i != output_layer] for d, ls in layers.items()}
        layers["CPU"] = sorted(layers.get("CPU", []) + [output_layer])
    buffers = buffer_sizes(log_lines)
    cpu = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    rows = []
    devices = [(cpu, None, 0)] + [(d, None, 0) for d in gpu.local_gpus(nat)] \
        + [(d, w, i) for w in (workers.workers if workers else []) for i, d in enumerate(w.devices)]
    for dev, w, index in devices:
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        name = ffi.string(lib.ggml_backend_dev_name(dev)).decode()
        row: dict[str, Any] = {
            "name": name,
            "description": ffi.string(lib.ggml_backend_dev_description(dev)).decode("utf-8", "replace"),
            "memoryFree": int(free[0]), "memoryTotal": int(total[0]),
            "layers": layers.get(name, []),
        }
        if w is not None:
            row["endpoint"] = w.text
            row["protocol"] = ".".join(map(str, w.version))
            # ggml-rpc names a worker's buffers by the device's index on that worker and
            # the endpoint ("RPC0[host:port]"), not by the device's name here ("RPC1")
            mine = {k: v for k, v in buffers.items() if k[0] == f"RPC{index}[{w.text}]"}
        elif dev == cpu:  # CPU, CPU_Mapped, CPU_REPACK, ...
            mine = {k: v for k, v in buffers.items() if k[0].startswith("CPU")}
        else:  # a local GPU: its buffers carry its name (CUDA0)
            mine = {k: v for k, v in buffers.items() if k[0] == name}
        for kind, key in (("model", "modelMiB"), ("KV", "kvMiB"), ("compute", "computeMiB")):
            row[key] = round(sum(v for (_, k), v in mine.items() if k == kind), 2)
        rows.append(row)
    return rows
