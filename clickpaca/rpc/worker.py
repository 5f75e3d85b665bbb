"""Running RPC workers: `clickpaca rpc-server` (the native tool of a build), and local
workers on loopback for the tests and the benchmark.

The worker is llama.cpp's own `rpc-server` (built into builds/<name>/bin with every
build): clickpaca adds nothing to it, so a machine that serves as a worker needs only
the build. It binds 127.0.0.1 unless told otherwise: the RPC protocol has no
authentication (docs/SCALE-OUT.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..llama import deterministic
from ..llama.native import build_dir
from ..base.paths import make_target
from .wire import Endpoint, WorkerCheckError, connect, hello


def tool_path(build: str = "mainline") -> Path:
    """The build's rpc-server, or FileNotFoundError saying how to get it."""
    path = build_dir(build) / "bin" / "rpc-server"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `make {make_target(build)}` "
                                "(every build includes rpc-server since GGML_RPC=ON)")
    return path


def command(build: str, host: str, port: int, threads: int | None = None, cache: bool = False) -> list[str]:
    cmd = [str(tool_path(build)), "--host", host, "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    if cache:
        cmd.append("--cache")
    return cmd


def worker_env(deterministic_kernels: bool = False) -> dict[str, str]:
    """OpenMP threads that sleep when idle (as native.py sets for the server): a spinning
    worker would take the cores its neighbours need (groundwork notes).

    `deterministic_kernels`: the tiled K-quant matmul off, as deterministic mode sets it in
    the server's own process. A worker computes its layers with its own process's ggml, so
    a deterministic server split over workers that have the tiled matmul on takes another
    kernel for batches of 8 rows or more, and its logits are not the local run's
    (measured: first-token logprob 0.03 nats apart, tokens parting after 8 steps; with it
    off on the workers too, bit for bit; docs/DETERMINISM.md)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    if deterministic_kernels:
        env[deterministic.TILED_ENV] = "0"
    return env


def run(args) -> int:
    """`clickpaca rpc-server`: replace this process with the native worker."""
    try:
        cmd = command(args.build, args.host, args.port, args.threads, args.cache)
    except FileNotFoundError as e:
        print(f"clickpaca rpc-server: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost"):
        print(f"clickpaca rpc-server: binding {args.host}: the RPC protocol has no authentication; "
              "anyone who reaches this port can use the worker (allocate its memory, read and "
              "write its buffers, run graphs). Use it on a trusted network or through an SSH "
              "tunnel (docs/SCALE-OUT.md).", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # rpc-server writes with send() and no MSG_NOSIGNAL: a client that vanishes while it
    # answers would kill it with SIGPIPE. An ignored signal stays ignored across exec, so
    # the worker gets EPIPE instead, drops that client and waits for the next.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.execve(cmd[0], cmd, worker_env(args.deterministic))
    return 1  # not reached


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalWorker:
    """A worker process on this machine (loopback), started by `start_local`."""

    proc: subprocess.Popen
    endpoint: Endpoint
    log: Path

    @property
    def text(self) -> str:
        return str(self.endpoint)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_ready(ep: Endpoint, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the worker answers a hello (it listens only after its devices are set up)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the RPC worker on {ep} exited with status {proc.returncode}")
        try:
            s = connect(ep, 2.0)
            try:
                s.settimeout(5.0)
                hello(s, ep)
                return
            finally:
                s.close()
        except WorkerCheckError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_local(n: int, build: str = "mainline", threads: int | None = None,
                log_dir: Path | None = None, deterministic_kernels: bool = False) -> list[LocalWorker]:
    """n workers of the build on 127.0.0.1, each on a free port, answering hellos
    (`deterministic_kernels`: see worker_env)."""
    workers: list[LocalWorker] = []
    try:
        for _ in range(n):
            port = free_port()
            ep = Endpoint("127.0.0.1", port)
            log = Path(log_dir or "/tmp") / f"clickpaca-rpc-{port}.log"
            with open(log, "wb") as f:
                # restore_signals=False: the worker inherits Python's ignored SIGPIPE (see run)
                proc = subprocess.Popen(command(build, ep.host, port, threads), stdout=f,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=worker_env(deterministic_kernels), restore_signals=False)
            workers.append(LocalWorker(proc, ep, log))
        for w in workers:
            wait_ready(w.endpoint, w.proc)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers
