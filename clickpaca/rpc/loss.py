"""A worker lost mid-run becomes an event with a name, not the end of the process.

ggml-rpc ends the process (GGML_ABORT) on any socket error of a worker's connection:
the worker died (EOF, ECONNRESET, EPIPE) or, with the timeouts devices.py sets, did not
answer in time. The abort runs on that connection's dispatcher thread while the engine
thread waits inside llama_decode for an answer that will never come. Neither thread can
be given back to llama.cpp: a callback that returned would be followed by abort(), and
the engine thread's wait has no way out.

So `WorkerLoss` installs ggml's abort callback. The callback names the lost worker
(devices.py: whose dispatcher thread aborted, and the state of its connection), hands
the message to the handler the server registered (server.py: `take_over`, which answers
every request from then on with an error naming the worker, on this very thread), and
parks the thread for good. The engine thread stays blocked; the process ends when its
input does (`quit`, end of input, SIGTERM).
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Callable

from .devices import RpcDevices


class WorkerLoss:
    """Installed before the first connection opens (a failure while loading is a loss
    too); `devices` is set once the workers are open."""

    def __init__(self, nat, handler: Callable[[str], None] | None = None) -> None:
        self.nat = nat
        self.devices: RpcDevices | None = None
        self.message: str | None = None  # set once, by the first abort
        self.handler = handler
        self._lock = threading.Lock()
        self._cb = nat.ffi.callback("ggml_abort_callback_t", self._on_abort)
        self._previous = nat.lib.ggml_set_abort_callback(self._cb)

    def describe(self, native_id: int, abort_message: str) -> str:
        if self.devices is None:
            return f"lost an RPC worker while connecting (llama.cpp: {abort_message.strip()})"
        w, why = self.devices.describe_loss(native_id)
        if w is not None:
            return f"lost the RPC worker {w.text}: it {why}"
        if "RPC" in abort_message:
            return f"lost an RPC worker: {why} (llama.cpp: {abort_message.strip()})"
        # not a worker's connection: another fatal error inside llama.cpp, on this thread
        return f"llama.cpp stopped with a fatal error: {abort_message.strip()}"

    def _on_abort(self, c_message) -> None:
        """ggml_abort's callback, on whichever thread aborted. With a handler it never
        returns (returning lets ggml call abort()); without one (no server to keep
        answering: a library user) the process aborts as it would have."""
        try:
            text = self.nat.ffi.string(c_message).decode("utf-8", "replace")
            message = self.describe(threading.get_native_id(), text)
            print(f"clickpaca: {message}", file=sys.stderr, flush=True)
            if self.handler is None:
                return
            with self._lock:
                first = self.message is None
                if first:
                    self.message = message
            if first:
                self.handler(message)  # the server's take-over; ends the process itself
        except BaseException:  # noqa: BLE001 - nothing may propagate into ggml_abort
            traceback.print_exc(file=sys.stderr)
        threading.Event().wait()  # parked for good

    def close(self) -> None:
        """Restore the previous callback (the runtime is closing normally)."""
        self.nat.lib.ggml_set_abort_callback(self._previous)
