"""Models split across machines through llama.cpp's RPC backend.

    wire.py     ggml-rpc's wire format from Python: connect, hello, type probe (checks a
                worker with timeouts before ggml-rpc, which would abort, touches it)
    devices.py  the workers' connections, opened through ggml-rpc and given timeouts;
                their devices for the model; the `ready` rows
    loss.py     a worker lost mid-run: ggml's abort callback turned into a named loss
    worker.py   running a worker (`clickpaca rpc-server`) and local ones for tests/bench
"""

from __future__ import annotations

from ..llama import features
from .devices import RpcDevices, RpcUnavailable, device_rows
from .loss import WorkerLoss
from .wire import Endpoint, WorkerCheckError, check_worker, parse_endpoint

def protocol_version(nat) -> tuple[int, int, int]:
    """The RPC protocol this build speaks (ggml-rpc.h's macros, through the bindings)."""
    lib = nat.lib
    missing = features.lacking("rpc", features.for_native(nat))
    if missing:
        raise RpcUnavailable(features.refusal("rpc", missing, nat.name).reason)
    return (int(lib.RPC_PROTO_MAJOR_VERSION), int(lib.RPC_PROTO_MINOR_VERSION),
            int(lib.RPC_PROTO_PATCH_VERSION))


def connect_workers(nat, servers: list[str], timeout: float,
                    kv_types: dict[str, tuple[str, int]]) -> RpcDevices:
    """Check every worker from Python (connect, protocol version, the KV cache types:
    field -> (name, ggml type)), then open them through ggml-rpc. WorkerCheckError or
    RpcUnavailable when one cannot be used; nothing is left open then."""
    ours = protocol_version(nat)
    lib = nat.lib
    types = {f: (name, t, int(lib.ggml_type_size(t)), int(lib.ggml_blck_size(t)))
             for f, (name, t) in kv_types.items()}
    checked = []
    for text in servers:
        ep = parse_endpoint(text)
        info = check_worker(ep, ours, timeout, types)
        checked.append((text, ep, info.version))
    return RpcDevices(nat, checked, timeout)


__all__ = ["Endpoint", "RpcDevices", "RpcUnavailable", "device_rows", "WorkerCheckError",
           "WorkerLoss", "check_worker", "connect_workers", "parse_endpoint", "protocol_version"]
