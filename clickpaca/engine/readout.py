"""Activation readout through the jobs: which rows of a tick's batch each job captures,
and what it keeps of them until its end event.

- `Readout`, one per runtime: the context's eval callback (activations/capture.py). Before a
  decode `arm(plan, batch)` asks every feed's job which positions it captures and arms the
  callback with those batch rows (through the micro-batches llama.cpp will split the batch
  into); after it `take()` hands each sequence its rows or the error that stops it. On a
  build with `llama_set_eval_callback` (features.py `eval-callback-live`) the callback is set
  for capturing decodes only, so requests without `capture` cost nothing; without it the
  callback is installed only when `init` asks (`capture: true`), since it then sees every node
  of every decode.
- The same callback writes: on a build with the live callback `arm` also asks each feed's
  job for its patch's rows (engine/patches.py) and arms the callback's writer
  (activations/patching.py); `take` hands a sequence whose patch was not written in full
  a `PatchFailed`. The callback is set for the decodes that read or write.
- `JobCapture`, one per capturing request: its nodes, the positions it captures
  (`captureTokens`), whether it needs logits rows, the rows so far, and its end event's
  `capture` field (base64, or an `.npy` file in the state directory when large).
"""

from __future__ import annotations

import io
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..llama import features
from . import faults, statedir
from ..activations import capture as C
from ..activations import patching as P
from ..wire.protocol import ProtocolError
from ..wire.protocol.checks import CAPTURE_DEFAULT
from .plan import Feed, Want

if TYPE_CHECKING:
    from ..llama import core

#: a capture event payload above this many bytes per node goes to an .npy file instead
MAX_INLINE_BYTES = 1 << 20
#: the rows one request may gather (float32, all its nodes together): the handler refuses
#: a request whose worst case exceeds it before it starts
MAX_CAPTURE_BYTES = 256 << 20
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_files = itertools.count()


class Readout:
    """The runtime's eval callback and the tick's capture (see the module doc)."""

    def __init__(self, nat: Any, at_init: bool) -> None:
        self.nat = nat
        self.live = features.available(nat, "eval-callback-live")
        self.cap = C.Capture(nat) if (self.live or at_init) else None
        if self.live:  # patches are written through the live callback only (engine/patches.py)
            self.cap.writer = P.Writer(nat)
        self.ctx: "core.Context | None" = None
        self.n_ubatch, self.streams = 0, False
        self._on = False  # live: the callback is set on the context now
        self._armed = False
        self._lens: Any = None  # the model's final norm and head (activations/lens.py), made when first asked

    def lens_head(self, model: Any) -> Any:
        """The lens over ``model``'s file (its head memory-mapped, made once per runtime)."""
        if self._lens is None:
            from ..activations.lens import Lens

            self._lens = Lens(self.nat, model.path, n_threads=self.ctx.n_threads if self.ctx is not None else 1)
        return self._lens

    def bind(self, ctx: "core.Context") -> None:
        """The context it reads: how llama.cpp will split its batches (capture.micro_batches)."""
        self.ctx = ctx
        self.n_ubatch = ctx.n_ubatch
        self.streams = not ctx.kv_unified

    @property
    def at_creation(self) -> Any:
        """The callback to create the context with (None: none, or set live per decode)."""
        return self.cap.callback if self.cap is not None and not self.live else None

    @property
    def mode(self) -> str | None:
        """For `ready.capture`: "live" (set per capturing decode), "context" (given at
        creation, every decode asks it), or None (capture refused)."""
        return "live" if self.live else "context" if self.cap is not None else None

    def check(self, seq_id: int, kind: str, name: str = "capture") -> None:
        """ProtocolError naming `capture` (or ``name``: lens reads through it) when this
        server cannot capture."""
        if self.cap is None:
            raise ProtocolError(
                f"{name}: build {self.nat.name!r} lacks llama_set_eval_callback, so its eval callback "
                "can only be given when the context is created, and this server's init did not ask for "
                "it: send init capture: true (every decode then pays the callback, ~4 ms here: "
                "docs/ACTIVATIONS.md) or use a build that has it", seq_id, kind)

    def arm(self, plan: list[Feed], batch: Any) -> dict[Any, Exception]:
        """Arm the callback with each capturing job's rows of this batch (filled from
        `plan`); {sequence: why} of those whose part failed (stage `arm`: each job's rows
        are found alone, faults.each), armed without them (the scheduler ends them)."""
        feeds = [f for f in plan if f.key.job.capture is not None]
        got = faults.each("arm", feeds, lambda f: self._rows_of(f, batch), seq_ids=[f.key.seq_id for f in feeds])
        failed = {f.key: g for f, g in zip(feeds, got) if isinstance(g, Exception)}
        wants = {}
        for f, g in zip(feeds, got):
            if g is not None and not isinstance(g, Exception):
                names, rows, f.key.job.capture.pending = g
                wants[f.key] = names, rows
        self._armed = bool(wants)
        if self.cap is None:
            return failed
        writes = self._writes(plan, failed)
        ubatches = (C.micro_batches(batch.seq[:batch.n], self.n_ubatch, self.streams)
                    if wants or writes else None)
        # armed with nothing, it declines every node (a retry after a failed decode disarms it)
        self.cap.arm_each(wants, batch, ubatches)
        if self.cap.writer is not None:
            if writes:
                self.cap.writer.arm(writes, ubatches, batch.logits[:batch.n] != 0)
            else:
                self.cap.writer.disarm()
        self._set_live(bool(wants) or bool(writes))
        return failed

    def _writes(self, plan: list[Feed], failed: dict) -> dict:
        """sequence -> the rows its patch writes in this decode (engine/patches.py); a job
        whose part fails goes to `failed` (stage `arm`)."""
        feeds = [f for f in plan if f.key.job.patch is not None and f.key not in failed]
        got = faults.each("arm", feeds, lambda f: f.key.job.patch.writes(f), seq_ids=[f.key.seq_id for f in feeds])
        out = {}
        for f, g in zip(feeds, got):
            if isinstance(g, Exception):
                failed[f.key] = g
            elif g:
                out[f.key] = g
        return out

    @staticmethod
    def _rows_of(f: Feed, batch: Any) -> tuple[tuple[str, ...], list[int], list[int]] | None:
        """(node names, batch rows, positions) of one feed's capture (None: it captures
        nothing in this decode); CaptureError for rows outside the batch."""
        jc = f.key.job.capture
        pos = jc.positions(f)
        if not pos:
            return None
        rows = [f.at + p - f.pos for p in pos]
        if min(rows) < 0 or max(rows) >= batch.n:
            raise C.CaptureError("captureTokens", f"rows {rows} outside the batch of {batch.n}")
        return jc.names, rows, pos

    def take(self) -> dict[Any, dict[str, np.ndarray] | Exception]:
        """After a successful decode: sequence -> its rows (node -> [rows, ...]) or the
        error that ends it (a CaptureError; a failure of its own part of the take, stage
        `take`: each sequence's rows are taken alone, faults.each); {} when nothing was
        armed."""
        patched = self._patch_errors()
        if not self._armed or self.cap is None:
            return patched
        self._armed = False
        cap = self.cap
        try:
            cap.settle()
            keys = cap.keys
            got = faults.each("take", keys, cap.take_one)
        finally:
            cap.disarm()
        return {**{k: g if not isinstance(g, Exception) or isinstance(g, (C.CaptureError, faults.StageFailed))
                   else faults.StageFailed("take", faults.describe("take", g)) for k, g in zip(keys, got)},
                **patched}

    def _patch_errors(self) -> dict[Any, Exception]:
        """After the decode: sequence -> why its patch was not written in full; disarms the writer."""
        w = self.cap.writer if self.cap is not None else None
        if w is None or not w.armed:
            return {}
        try:
            return {k: PatchFailed(why) for k, why in w.settle().items()}
        finally:
            w.disarm()

    def _set_live(self, on: bool) -> None:
        if not self.live or on == self._on or self.ctx is None:
            return
        ffi = self.nat.ffi
        self.nat.lib.llama_set_eval_callback(self.ctx.ptr, self.cap.callback if on else ffi.NULL, ffi.NULL)
        self._on = on


class PatchFailed(ValueError):
    """A patch that was not written in full in a decode (its message names `patch`)."""


@dataclass(eq=False)
class JobCapture:
    """One request's capture: what it reads from each feed and what it has read."""

    names: tuple[str, ...]  # every node it reads: its capture's and its lens's
    tokens: str  # captureTokens: last / generated / all
    dtype: str  # captureDtype
    needs_logits: bool  # some node holds only rows with logits (the last layer's, after the selection)
    states: Any = None  # the state directory (statedir.StateDir) and the session's namespace in it,
    namespace: str | None = None  # where a large capture's .npy goes
    positions_read: list[int] = field(default_factory=list)
    rows: dict[str, list[np.ndarray]] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)  # the positions armed this tick
    shown: tuple[str, ...] | None = None  # the nodes its end event's `capture` holds (None: names)
    lens: Any = None  # its logit lens (lensjob.JobLens), fed the rows of its nodes

    @property
    def reported(self) -> tuple[str, ...]:
        return self.names if self.shown is None else self.shown

    def positions(self, f: Feed) -> list[int]:
        """The positions of this feed it captures: `all` every token fed; `last` the last
        token of a prompt (of each window, for a score), `generated` the row each
        generated token is sampled from (the prompt's last token for the first one)."""
        if self.tokens == "all":  # a token fed again (plan.py's pairs) was captured when first fed
            return list(range(f.pos + f.refed, f.pos + f.count))
        if self.tokens == "last":
            return [f.pos + f.count - 1] if f.ends and not f.generating else []
        return [f.pos + f.count - 1] if f.samples else []

    def widen(self, w: Want) -> Want:
        """The job's Want with logits rows wherever it captures a node that exists only
        for rows with logits (each such row costs a logits row: 1 MiB at this vocabulary)."""
        if not self.needs_logits:
            return w
        if self.tokens == "all":
            lo, hi = w.n_past, w.n_tokens - 1
        elif self.tokens == "last" and not w.generating:
            lo = hi = w.n_tokens - 1
        else:  # generated: its rows are the sampling rows, which have logits
            return w
        if w.out_from <= w.out_to:
            lo, hi = min(lo, w.out_from), max(hi, w.out_to)
        w.out_from, w.out_to = lo, hi
        return w

    def took(self, got: dict[str, np.ndarray]) -> None:
        """This tick's rows (at the positions armed), in position order."""
        self.positions_read.extend(self.pending)
        if self.lens is not None:
            self.lens.took(self.pending, got)
        self.pending = []
        for name in self.reported:
            self.rows.setdefault(name, []).append(got[name].astype(self.dtype, copy=False))

    def event_field(self, seq_id: int) -> dict:
        """The end event's `capture`: positions and one array per node, inline (base64) up
        to MAX_INLINE_BYTES, else an .npy file in the state directory (its path); None
        when it captures only for its lens."""
        if not self.reported:
            return None
        nodes = {}
        try:
            for name in self.reported:
                parts = self.rows.get(name)
                arr = np.concatenate(parts) if parts else np.zeros((0,), self.dtype)
                if arr.nbytes > MAX_INLINE_BYTES:
                    nodes[name] = write_npy(arr, self.states, self.namespace, seq_id, name)
                else:
                    nodes[name] = C.encode(arr, self.dtype)
        except BaseException:  # its event never goes out: no file it names stays behind
            for ref in nodes.values():
                if "file" in ref:
                    remove_npy(ref, self.states, self.namespace)
            raise
        return {"tokens": self.tokens, "positions": list(self.positions_read), "nodes": nodes}


def write_npy(arr: np.ndarray, states: Any, namespace: str | None, seq_id: int, node: str) -> dict:
    """A large capture as a new .npy file in the session's namespace of the state directory;
    the reference that goes in the event. Its name holds the server's run id (unique among
    the servers sharing the directory) and it is created with O_EXCL: nothing is ever
    replaced (a name taken anyway, by a client's `save`, moves on to the next number)."""
    buf = io.BytesIO()
    np.save(buf, arr)
    try:
        faults.hit("capture", seq_id)
        dir_fd = states.namespace_dir(namespace)
        try:
            for _ in range(8):
                name = f"capture-{states.run_id}-{seq_id}-{next(_files)}-{_SAFE.sub('_', node)}"[:120] + ".npy"
                try:
                    statedir.create_file(dir_fd, name, _halves(buf.getbuffer(), seq_id))
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError("eight names in a row were taken")
        finally:
            os.close(dir_fd)
    except (OSError, statedir.StatePathError) as e:
        raise faults.StageFailed("capture", f"capture: its {node} file could not be written in the state "
                                            f"directory: {e}") from e
    sub = namespace or ""
    return {"dtype": str(arr.dtype), "shape": list(arr.shape), "file": str(states.root / sub / name)}


def _halves(data: memoryview, seq_id: int):
    """The file's bytes in two writes, the tests' hook between them (faults.py point
    `capture:<seq_id>:opened`: the file exists, half written; create_file removes it)."""
    half = len(data) // 2
    yield data[:half]
    faults.hit("capture", seq_id, "opened")
    yield data[half:]


def remove_npy(ref: dict, states: Any, namespace: str | None) -> None:
    """Remove a capture file `write_npy` made (its event was never sent)."""
    try:
        dir_fd = states.namespace_dir(namespace)
        try:
            os.unlink(os.path.basename(ref["file"]), dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except (OSError, statedir.StatePathError):
        pass  # gone already, or its directory with it


def for_request(rt: Any, req: Any, namespace: str | None, max_rows: int) -> JobCapture | None:
    """The request's JobCapture (None without `capture`): the names checked against the
    model's graph (the error lists the valid ones) and the worst case against
    MAX_CAPTURE_BYTES; ProtocolError naming the field."""
    spec = getattr(req, "lens", None)
    if req.capture is None and spec is None:
        return None
    seq_id, kind = req.seq_id, req.type
    if spec is not None:  # a build without the lens's functions names them first (features.py)
        try:
            features.require(rt.model.nat, "logit-lens")
        except features.FeatureMissing as e:
            raise ProtocolError(str(e), seq_id, kind) from None
    rt.readout.check(seq_id, kind, "capture" if req.capture is not None else "lens")
    fa = {True: "on", False: "off"}.get(rt.ctx.flash_attn, "auto")
    g = C.graph(rt.model, fa)
    try:
        names = tuple(C.validate(list(req.capture), g.names, g.excluded)) if req.capture is not None else ()
    except C.CaptureError as e:
        raise ProtocolError(str(e), seq_id, kind) from None
    jl = None
    if spec is not None:
        jl = _lens_for(rt, spec, seq_id, kind)
        for n in jl.nodes:
            if n not in g.names:
                raise ProtocolError(f"lens: this model's graph has no {n}", seq_id, kind)
    per_row = sum(g.row_elems.get(n, rt.model.n_embd) for n in names) * 4
    if per_row * max_rows > MAX_CAPTURE_BYTES:
        raise ProtocolError(f"capture: up to {max_rows} rows of {per_row} bytes ({', '.join(names)}) "
                            f"exceed the {MAX_CAPTURE_BYTES >> 20} MiB a request may gather; capture "
                            "fewer nodes or tokens (captureTokens last)", seq_id, kind)
    every = names + tuple(n for n in (jl.nodes if jl is not None else ()) if n not in names)
    return JobCapture(every, req.captureTokens or CAPTURE_DEFAULT[kind], req.captureDtype,
                      needs_logits=any(n in g.output_rows_only for n in every),
                      states=rt.states, namespace=namespace, shown=names, lens=jl)


def _lens_for(rt: Any, spec: Any, seq_id: int, kind: str) -> Any:
    """The request's JobLens; ProtocolError naming `lens` (a model whose last steps are not
    composed, or layers it lacks)."""
    from ..activations.lens import LensError
    from . import lensjob

    try:
        return lensjob.for_request(rt.readout.lens_head(rt.model), spec, rt.model.n_layer, rt.piece)
    except LensError as e:
        raise ProtocolError(str(e) if str(e).startswith("lens") else f"lens: {e}", seq_id, kind) from None
