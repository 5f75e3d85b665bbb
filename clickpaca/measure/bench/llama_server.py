"""llama.cpp's llama-server as a bench peer: start it on a free loopback port, send
completions from concurrent threads, stop it.

Why the standard library only (http.client, threads): the bench must not depend on an
HTTP stack whose own overhead or connection pooling would be measured with the server.
Every request field sent here exists in this version's tools/server (server-schema.cpp,
README `/completion`); every command-line flag in `llama-server --help`.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ...llama.native import build_dir
from ...results.stats import progress
from .tools import native_env

#: The /completion fields the bench sends (checked against server-schema.cpp of b11312).
REQUEST_FIELDS = frozenset({
    "prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "samplers",
    "json_schema", "logit_bias", "ignore_eos", "cache_prompt", "return_tokens", "stream",
})


class PeerError(RuntimeError):
    """llama-server did not start, answered with an error, or died."""


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary(build: str = "mainline") -> str:
    """builds/peer/bin/llama-server, made by `make peer` from the very mainline tree that
    builds/mainline points to (the same libraries clickpaca loads)."""
    if build != "mainline":
        raise PeerError(f"llama-server is built from the mainline tree only; --build {build} "
                        "has no peer to compare with")
    peer = build_dir("peer")
    exe = peer / "bin" / "llama-server"
    if not exe.exists():
        raise PeerError(f"{exe} not found; run `make peer`")
    info = json.loads((peer / "build-info.json").read_text())
    if Path(info["mainline"]).resolve() != build_dir("mainline").resolve():
        raise PeerError(f"builds/peer was made from {info['mainline']}, not from builds/mainline "
                        f"({build_dir('mainline').resolve()}); run `make peer`")
    return str(exe)


def server_command(model: str, build: str, threads: int, parallel: int, ctx: int,
                   batch: int, kv_unified: bool, port: int, ubatch: int | None = None) -> list[str]:
    """The exact llama-server command line of a bench run (printed and recorded); `ubatch`:
    rows per graph pass (-ub), the batch's by default, as clickpaca's nUbatch."""
    return [
        server_binary(build), "-m", model, "--host", "127.0.0.1",
        "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
        "-c", str(ctx), "-b", str(batch), "-ub", str(ubatch or batch), "-cb",
        "--kv-unified" if kv_unified else "--no-kv-unified",
        "--swa-full",          # clickpaca's default (swaFull true): same cache shape
        "--cache-ram", "0",    # no prompt cache across requests (clickpaca: reusePrefix false)
        "--no-webui",          # built without UI assets (native/peer.py downloads nothing)
        "--offline", "-fit", "off",  # no network; keep -c and -np as given
    ]


class LlamaServer:
    """A running llama-server; `with LlamaServer(...) as s: s.complete(...)`."""

    def __init__(self, cmd: list[str], port: int, log_dir: str | None = None,
                 start_timeout: float = 300) -> None:
        self.cmd, self.port = cmd, port
        fd, self.log_path = tempfile.mkstemp(prefix="clickpaca-bench-llama-server-",
                                             suffix=".log", dir=log_dir)
        self._log = os.fdopen(fd, "wb")
        self.problems: list[str] = []
        progress(f"peer: $ {shlex.join(cmd)}")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=native_env())
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"llama-server exited with {self.proc.returncode} while "
                                f"starting: {self.log_tail()}")
            try:
                status, _ = self.request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise PeerError(f"llama-server not healthy after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 800) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace").strip()

    def request(self, method: str, path: str, body: dict | None,
                timeout: float = 3600) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")

    def complete(self, body: dict) -> dict:
        """One POST /completion; the answer stamped with its arrival time as `_t`."""
        unknown = set(body) - REQUEST_FIELDS
        if unknown:
            raise PeerError(f"fields not checked against llama-server's docs: {sorted(unknown)}")
        status, out = self.request("POST", "/completion", body)
        t = time.perf_counter()
        if status != 200 or not isinstance(out, dict):
            raise PeerError(f"/completion answered {status}: {str(out)[:300]}")
        out["_t"] = t
        return out

    def complete_all(self, bodies: list[dict]) -> tuple[float, list[dict]]:
        """Send every body at once from its own thread; (send time, answers in order)."""
        answers: list[Any] = [None] * len(bodies)
        start = threading.Barrier(len(bodies) + 1)

        def one(i: int) -> None:
            start.wait()
            try:
                answers[i] = self.complete(bodies[i])
            except Exception as e:  # noqa: BLE001 - reported with the run, not raised in a thread
                answers[i] = {"error": str(e), "_t": time.perf_counter()}

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
        for th in threads:
            th.start()
        t0 = time.perf_counter()
        start.wait()
        for th in threads:
            th.join()
        return t0, answers

    def tokenize(self, text: str) -> list[int]:
        status, out = self.request("POST", "/tokenize", {"content": text, "add_special": False})
        if status != 200:
            raise PeerError(f"/tokenize answered {status}: {out}")
        return [t if isinstance(t, int) else t["id"] for t in out["tokens"]]

    def detokenize(self, tokens: list[int]) -> str:
        status, out = self.request("POST", "/detokenize", {"tokens": tokens})
        if status != 200:
            raise PeerError(f"/detokenize answered {status}: {out}")
        return out["content"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        code = self.proc.returncode
        if code not in (0, -15, None):
            self.problems.append(f"llama-server exited with {code} (log {self.log_path}): "
                                 f"{self.log_tail(400)}")
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
