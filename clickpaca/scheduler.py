"""The scheduler: every tick is one llama_decode for all active sequences.

A tick packs, in this order, one token for each generating sequence, then prompt (and
scoring) chunks of waiting sequences in arrival order, up to nBatch tokens; a long
prompt is split across ticks so it never stalls the others. After the decode, each
generating sequence samples from its own logits row with its own sampler chain and
grammar state. Requests are applied between ticks (the server calls `handle`), so a
`cancel` or a new `infer` takes effect before the next decode.

Failures stay local: a decode that finds no KV room first defers prompt chunks, then
ends the sequence that holds the most cells; a failed decode ends only the sequences
that were in it. Every `infer` ends in exactly one `done` or `error`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import core, kvstate, statedir
from .grammars import GrammarEngine, GrammarError
from .mask_ahead import MaskAhead, MaskJob
from .models import resolve_model
from .native import NativeError
from .protocol import SAMPLER_FIELDS, ProtocolError, error_event
from .sampling import SamplerParams, SequenceSampler
from .scoring import score_rows, windows_for
from .text import StopMatcher, Utf8Assembler

N_TOP_MAX = 100
MAX_GRAMMARS_PER_SESSION = 64  # grammar ids one client may hold (each costs memory)


@dataclass(eq=False)
class Session:
    """One client's namespace of seq_ids and grammar ids (stdio has exactly one)."""

    send: Callable[[dict], None]
    name: str = "stdio"
    seqs: dict[int, "Sequence"] = field(default_factory=dict)
    grammars: dict[str, Any] = field(default_factory=dict)
    max_seqs: int | None = None  # slots this client may hold at once (socket: --max-seqs-per-client)
    namespace: str | None = None  # its private state-file namespace (statedir.py); None = the root


@dataclass(eq=False)
class Sequence:
    session: Session
    seq_id: int
    slot: int
    kind: str  # "infer" | "score" | "prefill"
    state: str = "prompt"  # "prompt" -> "generate" | "held"
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    fed: int = 0  # how many of `pending` are in the KV cache
    tokens: list[int] = field(default_factory=list)  # every token in the KV, in order
    next_token: int | None = None
    sampler: SequenceSampler | None = None
    matcher: Any = None
    stops: StopMatcher | None = None
    utf8: Utf8Assembler = field(default_factory=Utf8Assembler)
    max_tokens: int = 0
    n_predicted: int = 0
    n_prompt: int = 0
    n_reused: int = 0
    n_probs: int = 0
    t_arrival: float = 0.0
    t_prompt: float | None = None
    t_first: float | None = None
    kv_wait: bool = False
    # scoring
    windows: list = field(default_factory=list)
    window: int = 0
    nll: list = field(default_factory=list)
    per_token: bool = False

    @property
    def n_past(self) -> int:
        return len(self.tokens)


def prompt_order(order: list["Sequence"]) -> list["Sequence"]:
    """Waiting prompts, fewest tokens left first (ties: arrival order).

    Arrival order let one long prompt or score take the whole batch, tick after tick,
    while a one-token request behind it waited for all of it (114.6 s behind a
    40,000-character score); fewest-left-first lets short prompts through within a tick
    and gives the long one the rest of the batch. Generating sequences are not affected:
    they always get their token first.
    """
    waiting = [s for s in order if s.state == "prompt"]
    return sorted(waiting, key=lambda s: len(s.pending) - s.fed)


def _path_message(e: Exception) -> str:
    msg = str(e)
    return msg if msg.startswith("path:") else f"path: {msg}"


class Engine:
    """Owns the model, the context and every sequence of every session."""

    def __init__(self, state_dir: str | None = None, allow_any_path: bool = False) -> None:
        self.state_dir_default = state_dir
        self.allow_any_path = allow_any_path
        self.states: statedir.StateDir | None = None
        self._taken: list[Sequence] = []  # slots taken by the request being handled
        self.model_lock = threading.Lock()  # reader threads tokenize (prepare.py); close waits
        self.model: core.Model | None = None
        self.ctx: core.Context | None = None
        self.batch: core.Batch | None = None
        self.grammar_engine: GrammarEngine | None = None
        self.free_slots: list[int] = []
        self.order: list[Sequence] = []  # active (not held) sequences in arrival order
        self.ready_event: dict | None = None
        self.bitmask: np.ndarray | None = None
        self.masks: MaskAhead | None = None
        self.ticks = 0

    # ============================================================ requests

    def handle(self, session: Session, req: dict) -> None:
        """Apply one validated request; errors become `error` events for that session."""
        kind = req["type"]
        self._taken = []
        try:
            if kind == "init":
                self._init(session, req)
                return
            if self.ctx is None:
                raise ProtocolError(f"{kind} before init: send an init request first",
                                    req.get("seq_id", -1), kind)
            getattr(self, f"_{kind}")(session, req)
        except ProtocolError as e:
            self._give_back()
            if e.request is None:
                e.request = kind
            session.send(e.event())
        except BaseException:
            self._give_back()
            raise
        finally:
            self._taken = []

    def _give_back(self) -> None:
        """A request failed: release the slots it took that hold nothing yet (no leak)."""
        for seq in self._taken:
            if seq.session.seqs.get(seq.seq_id) is seq:
                self._release(seq)

    def _init(self, session: Session, req: dict) -> None:
        if self.ctx is not None:
            raise ProtocolError("init: the server is already initialised (one init per process)",
                                request="init")
        types = (req["cacheTypeK"], req["cacheTypeV"])
        build = req["build"] or ("turboquant" if any(t.startswith("turbo") for t in types) else "mainline")
        if req["nBatch"] < req["nSeqMax"]:
            raise ProtocolError(f"nBatch: must be >= nSeqMax ({req['nSeqMax']}) so every "
                                f"sequence gets a token each tick, got {req['nBatch']}", request="init")
        if req["nCtx"] < req["nSeqMax"]:
            # llama.cpp clamps n_batch to n_ctx, then reserves n_seq_max output rows:
            # GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) aborts the process.
            raise ProtocolError(f"nCtx: must be >= nSeqMax ({req['nSeqMax']}), got {req['nCtx']}",
                                request="init")
        try:
            states = statedir.StateDir(req["stateDir"] or self.state_dir_default
                                       or statedir.default_root(), self.allow_any_path)
        except (OSError, statedir.StatePathError) as e:
            raise ProtocolError(f"stateDir: cannot be used ({getattr(e, 'strerror', None) or e})",
                                request="init") from None
        try:
            path = resolve_model(req["modelPath"])
            model = core.Model(path, n_gpu_layers=req["nGpuLayers"], build=build)
        except core.ModelError as e:
            raise ProtocolError(f"modelPath: {e}", request="init") from None
        except NativeError as e:
            raise ProtocolError(f"build: {e}", request="init") from None
        try:
            ctx = core.Context(model, n_ctx=req["nCtx"], n_batch=req["nBatch"],
                               n_seq_max=req["nSeqMax"], type_k=types[0], type_v=types[1],
                               n_threads=req["nThreads"], flash_attn=req["flashAttn"],
                               kv_unified=req["kvUnified"], swa_full=req["swaFull"])
        except core.ContextError as e:
            model.close()
            raise ProtocolError(str(e), request="init") from None
        self.model, self.ctx = model, ctx
        self.states = states
        self.batch = core.Batch(model.nat, ctx.n_batch)
        self._warm_up()
        self.free_slots = list(range(ctx.n_seq_max - 1, -1, -1))
        self.grammar_engine = GrammarEngine.start(model)
        self.bitmask = np.zeros((ctx.n_seq_max, (model.n_vocab + 31) // 32), dtype=np.int32)
        self.masks = MaskAhead(self.bitmask)
        self.ready_event = {
            "type": "ready",
            "nVocab": model.n_vocab,
            "build": model.nat.name,
            "buildCommit": model.nat.info.get("commit"),
            "buildNumber": model.nat.info.get("build_number"),
            "nCtx": ctx.n_ctx,
            "nCtxPerSeq": ctx.n_ctx_seq,
            "nCtxShared": bool(req["kvUnified"]),
            "nBatch": ctx.n_batch,
            "nSeqMax": ctx.n_seq_max,
            "nThreads": ctx.n_threads,
            "cacheTypeK": ctx.type_k,
            "cacheTypeV": ctx.type_v,
            "kvBytes": ctx.kv_bytes,
            "kvUnified": bool(req["kvUnified"]),
            "swaFull": bool(req["swaFull"]),
            "flashAttn": req["flashAttn"],
            "stateDir": str(states.root),
            "cacheTypes": sorted(core.cache_types(model.nat)),
            "model": {"path": str(model.path), "description": model.description,
                      "sizeBytes": model.size_bytes, "nLayer": model.n_layer,
                      "nCtxTrain": model.n_ctx_train, "addBos": model.add_bos},
        }
        session.send(self.ready_event)

    def _warm_up(self) -> None:
        """One throw-away decode, so the first request's timings exclude graph setup."""
        assert self.ctx is not None and self.batch is not None and self.model is not None
        self.batch.clear()
        self.batch.add([self.model.bos], 0, 0, output_last=True)
        self.ctx.decode(self.batch)
        self.ctx.seq_rm(0, -1, -1)
        self.batch.clear()

    def _grammar(self, session: Session, req: dict) -> None:
        assert self.grammar_engine is not None
        if req["id"] not in session.grammars and len(session.grammars) >= MAX_GRAMMARS_PER_SESSION:
            raise ProtocolError(f"id: this session holds {MAX_GRAMMARS_PER_SESSION} grammars, the "
                                "limit (re-use an id to replace one)")
        try:
            compiled = req.get("_compiled") or self.grammar_engine.compile(req["grammar"])
            if isinstance(compiled, GrammarError):  # compiled by the reader (prepare.py)
                raise compiled
        except GrammarError as e:
            raise ProtocolError(f"grammar: {e}") from None
        session.grammars[req["id"]] = compiled
        session.send({"type": "grammar_ready", "id": req["id"]})

    def _check_seq(self, session: Session, seq_id: int, kind: str, field_: str = "seq_id") -> None:
        assert self.ctx is not None
        if not 0 <= seq_id < self.ctx.n_seq_max:
            raise ProtocolError(f"{field_}: must be in 0..{self.ctx.n_seq_max - 1} (nSeqMax), "
                                f"got {seq_id}", seq_id, kind)

    def _new_sequence(self, session: Session, seq_id: int, kind: str) -> Sequence:
        if not self.free_slots:
            raise ProtocolError(f"seq_id: no free sequence slot (all {self.ctx.n_seq_max} in use)",
                                seq_id, kind)
        if session.max_seqs is not None and len(session.seqs) >= session.max_seqs:
            raise ProtocolError(f"seq_id: this client holds {len(session.seqs)} sequences, its share "
                                f"(--max-seqs-per-client {session.max_seqs})", seq_id, kind)
        seq = Sequence(session=session, seq_id=seq_id, slot=self.free_slots.pop(), kind=kind,
                       t_arrival=time.perf_counter())
        session.seqs[seq_id] = seq
        self._taken.append(seq)
        return seq

    def _prompt_tokens(self, req: dict, continuing: bool) -> np.ndarray:
        """The request's prompt tokens: from its reader thread (prepare.py) if it did them."""
        pre = req.get("_tokens")
        return pre[continuing] if pre is not None else self.tokenize_prompt(req["prompt"], continuing)

    def tokenize_prompt(self, text: str, continuing: bool) -> np.ndarray:
        """Special tokens in the text are parsed; BOS is added once at the start only."""
        assert self.model is not None
        toks = self.model.tokenize(text, add_special=not continuing, parse_special=True)
        if not continuing and self.model.add_bos and len(toks) >= 2 \
                and toks[0] == self.model.bos and toks[1] == self.model.bos:
            toks = toks[1:]  # the text began with <bos> already
        return toks

    def _infer(self, session: Session, req: dict) -> None:
        model, ctx = self.model, self.ctx
        assert model is not None and ctx is not None
        seq_id = req["seq_id"]
        self._check_seq(session, seq_id, "infer")
        held = session.seqs.get(seq_id)
        if held is not None and held.state != "held":
            raise ProtocolError(f"seq_id: sequence {seq_id} is already active", seq_id, "infer")
        sampler_fields = {k: req[k] for k in SAMPLER_FIELDS if k in req}
        try:
            params = SamplerParams.from_request(sampler_fields, n_vocab=model.n_vocab)
        except ValueError as e:
            raise ProtocolError(str(e), seq_id, "infer") from None
        if params.n_probs > N_TOP_MAX:
            raise ProtocolError(f"nProbs: must be <= {N_TOP_MAX}, got {params.n_probs}", seq_id, "infer")
        compiled = None
        if req["grammar_id"] is not None:
            compiled = session.grammars.get(req["grammar_id"])
            if compiled is None:
                raise ProtocolError(f"grammar_id: unknown grammar {req['grammar_id']!r} "
                                    "(send a grammar request first)", seq_id, "infer")
        prompt = self._prompt_tokens(req, continuing=held is not None)
        if held is None and len(prompt) == 0:
            raise ProtocolError("prompt: empty (nothing to continue from)", seq_id, "infer")
        self._check_fits(held, prompt, seq_id, "infer")
        seq = held if held is not None else self._new_sequence(session, seq_id, "infer")
        seq.kind = "infer"
        seq.t_arrival = time.perf_counter()
        if held is not None:
            self._reopen_held(seq, prompt)
        else:
            seq.pending = prompt
            seq.fed = 0
            if req["reusePrefix"]:
                self._reuse_prefix(seq)
        seq.n_prompt = len(seq.pending) - seq.fed
        seq.state = "prompt"
        seq.sampler = SequenceSampler(params, model.n_vocab)
        seq.sampler.extend(seq.tokens)
        seq.sampler.extend(seq.pending[seq.fed:])
        seq.matcher = compiled.new_matcher() if compiled is not None else None
        seq.stops = StopMatcher(req["stop"])
        seq.utf8 = Utf8Assembler()
        seq.max_tokens = req["maxTokens"]
        seq.n_predicted = 0
        seq.n_probs = params.n_probs
        seq.t_prompt = seq.t_first = None
        self.order.append(seq)

    def _check_fits(self, held: Sequence | None, prompt: np.ndarray, seq_id: int, kind: str) -> None:
        assert self.ctx is not None
        total = (held.n_past if held else 0) + len(prompt)
        if total >= self.ctx.n_ctx_seq:
            raise ProtocolError(f"prompt: {total} tokens do not fit the context "
                                f"({self.ctx.n_ctx_seq} tokens per sequence)", seq_id, kind)

    def _reopen_held(self, seq: Sequence, prompt: np.ndarray) -> None:
        """Continue a held sequence: re-feed its last token so there is a logits row."""
        assert self.ctx is not None
        last = seq.tokens.pop()
        self.ctx.seq_rm(seq.slot, len(seq.tokens), -1)
        seq.pending = np.concatenate([np.array([last], np.int32), prompt])
        seq.fed = 0
        seq.n_reused = len(seq.tokens)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Share the cells of the held sequence with the longest common prompt prefix."""
        assert self.ctx is not None
        if not self.ctx.kv_unified:
            return  # one stream per sequence: llama.cpp copies only whole ones (GGML_ASSERT)
        best, best_n = None, 0
        for other in seq.session.seqs.values():
            if other is seq or other.state != "held" or not other.tokens:
                continue
            m = min(len(other.tokens), len(seq.pending) - 1)
            a = np.asarray(other.tokens[:m], np.int32)
            diff = np.flatnonzero(a != seq.pending[:m])
            n = int(diff[0]) if len(diff) else m
            if n < len(other.tokens) and self.ctx.seq_pos_min(other.slot) > max(
                    0, n - self.model.nat.lib.llama_model_n_swa(self.model.ptr)):
                continue  # cells before n left its sliding window (a loaded state keeps the last)
            if n > best_n:
                best, best_n = other, n
        if best is not None and best_n > 0:
            self.ctx.seq_cp(best.slot, seq.slot, 0, best_n)
            seq.tokens = [int(t) for t in seq.pending[:best_n]]
            seq.fed = best_n
            seq.n_reused = best_n

    def _score(self, session: Session, req: dict) -> None:
        model, ctx = self.model, self.ctx
        assert model is not None and ctx is not None
        seq_id = req["seq_id"]
        self._check_seq(session, seq_id, "score")
        if seq_id in session.seqs:
            raise ProtocolError(f"seq_id: sequence {seq_id} is already active", seq_id, "score")
        window = req["window"] or min(512, ctx.n_ctx_seq)
        if window > ctx.n_ctx_seq:
            raise ProtocolError(f"window: {window} exceeds the context per sequence "
                                f"({ctx.n_ctx_seq})", seq_id, "score")
        tokens = req.get("_tokens")
        if tokens is None:
            tokens = model.tokenize(req["text"], add_special=True, parse_special=False)
        windows = windows_for(tokens, window, model.bos if model.add_bos else None)
        if not windows:
            raise ProtocolError("text: too short to score (needs at least 2 tokens)", seq_id, "score")
        seq = self._new_sequence(session, seq_id, "score")
        seq.windows = windows
        seq.window = 0
        seq.pending = windows[0][0]
        seq.fed = 0
        seq.per_token = req["perToken"]
        seq.n_prompt = sum(len(w[0]) for w in windows)
        self.order.append(seq)

    def _prefill(self, session: Session, req: dict) -> None:
        ctx = self.ctx
        assert ctx is not None
        seq_id = req["seq_id"]
        self._check_seq(session, seq_id, "prefill")
        held = session.seqs.get(seq_id)
        if held is not None and held.state != "held":
            raise ProtocolError(f"seq_id: sequence {seq_id} is already active", seq_id, "prefill")
        prompt = self._prompt_tokens(req, continuing=held is not None)
        self._check_fits(held, prompt, seq_id, "prefill")
        seq = held if held is not None else self._new_sequence(session, seq_id, "prefill")
        seq.kind = "prefill"
        seq.state = "prompt"
        seq.pending, seq.fed = prompt, 0
        seq.n_prompt = len(prompt)
        seq.t_arrival = time.perf_counter()
        seq.t_prompt = None
        self.order.append(seq)

    def _cancel(self, session: Session, req: dict) -> None:
        seq = session.seqs.get(req["seq_id"])
        if seq is None or seq.state == "held":
            raise ProtocolError(f"seq_id: sequence {req['seq_id']} is not running "
                                "(use free to release a held sequence)", req["seq_id"], "cancel")
        self._finish(seq, "cancelled")

    def _free(self, session: Session, req: dict) -> None:
        seq = session.seqs.get(req["seq_id"])
        if seq is None:
            raise ProtocolError(f"seq_id: sequence {req['seq_id']} holds nothing", req["seq_id"], "free")
        if seq.state != "held":
            self._finish(seq, "cancelled")
        else:
            self._release(seq)
        session.send({"type": "freed", "seq_id": req["seq_id"]})

    def _fork(self, session: Session, req: dict) -> None:
        src = session.seqs.get(req["seq_id"])
        dst_id = req["dst_seq_id"]
        try:
            self._check_seq(session, dst_id, "fork", "dst_seq_id")
        except ProtocolError as e:
            e.seq_id = req["seq_id"]  # answer on the request's seq_id, where the client waits
            raise
        if src is None or src.state != "held":
            raise ProtocolError(f"seq_id: sequence {req['seq_id']} holds no state to fork "
                                "(prefill it first)", req["seq_id"], "fork")
        if dst_id in session.seqs:
            raise ProtocolError(f"dst_seq_id: sequence {dst_id} is in use", req["seq_id"], "fork")
        assert self.ctx is not None
        dst = self._new_sequence(session, dst_id, "prefill")
        self.ctx.seq_cp(src.slot, dst.slot, -1, -1)
        dst.tokens = list(src.tokens)
        dst.state = "held"
        session.send({"type": "forked", "seq_id": src.seq_id, "dst_seq_id": dst_id,
                      "tokens": dst.n_past})

    def _save(self, session: Session, req: dict) -> None:
        seq = session.seqs.get(req["seq_id"])
        if seq is None or seq.state != "held":
            raise ProtocolError(f"seq_id: sequence {req['seq_id']} holds no state to save",
                                req["seq_id"], "save")
        assert self.ctx is not None and self.states is not None
        shared, replace = req["shared"], req["replace"]

        def may_replace(dir_fd: int, name: str) -> None:
            kvstate.refuse_foreign(dir_fd, name)
            if shared and not replace:
                raise kvstate.StateFileError(f"{name!r} already exists in the shared namespace "
                                             "(save with replace: true to overwrite it)")
        try:
            dir_fd, name, label = self.states.locate(req["path"], session.namespace, shared)
            try:
                n = statedir.write_file(dir_fd, name, kvstate.encode(self.ctx, seq.slot, seq.tokens),
                                        label, may_replace)
            finally:
                os.close(dir_fd)
        except (statedir.StatePathError, kvstate.StateFileError) as e:
            raise ProtocolError(_path_message(e), req["seq_id"], "save") from None
        except OSError as e:
            raise ProtocolError(f"path: {req['path'][:60]!r} cannot be written ({e.strerror})",
                                req["seq_id"], "save") from None
        session.send({"type": "saved", "seq_id": seq.seq_id, "path": req["path"], "bytes": n,
                      "tokens": seq.n_past})

    def _load(self, session: Session, req: dict) -> None:
        seq_id = req["seq_id"]
        self._check_seq(session, seq_id, "load")
        if seq_id in session.seqs:
            raise ProtocolError(f"seq_id: sequence {seq_id} is in use (free it first)", seq_id, "load")
        assert self.ctx is not None and self.states is not None
        try:
            dir_fd, name, label = self.states.locate(req["path"], session.namespace, req["shared"])
            try:
                data = statedir.read_file(dir_fd, name, label)
            finally:
                os.close(dir_fd)
            header, tokens, payload = kvstate.decode(data, label)
        except (statedir.StatePathError, kvstate.StateFileError) as e:
            raise ProtocolError(_path_message(e), seq_id, "load") from None
        except OSError as e:
            raise ProtocolError(f"path: {req['path'][:60]!r} cannot be read ({e.strerror})",
                                seq_id, "load") from None
        seq = self._new_sequence(session, seq_id, "prefill")
        try:
            tokens = kvstate.restore(self.ctx, seq.slot, header, tokens, payload, label)
        except kvstate.StateFileError as e:
            raise ProtocolError(_path_message(e), seq_id, "load") from None
        seq.tokens = tokens
        seq.state = "held"
        session.send({"type": "loaded", "seq_id": seq_id, "tokens": seq.n_past})

    def _quit(self, session: Session, req: dict) -> None:
        if req.get("now"):
            for seq in list(self.order):
                self._finish(seq, "shutdown")

    def close_session(self, session: Session) -> None:
        """A client went away: cancel its sequences, free their KV, forget its grammars
        and its private state files."""
        for seq in list(session.seqs.values()):
            if seq.state == "held":
                self._release(seq)
            else:
                self._finish(seq, "cancelled", notify=False)
        session.grammars.clear()
        if self.states is not None:
            self.states.drop_namespace(session.namespace)

    # ============================================================ ending

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's KV cells and slot at once; its seq_id is reusable now."""
        assert self.ctx is not None
        self.ctx.seq_rm(seq.slot, -1, -1)
        if seq in self.order:
            self.order.remove(seq)
        if seq.session.seqs.get(seq.seq_id) is seq:
            del seq.session.seqs[seq.seq_id]
        self.free_slots.append(seq.slot)
        for other in self.order:
            other.kv_wait = False
        if len(self.free_slots) == self.ctx.n_seq_max:
            # Nothing is held or running: start the next requests from the first cells.
            # Otherwise new cells land after the freed ones and every later decode
            # attends over the larger span (measured: 64 sequences ran ~35% slower).
            self.ctx.clear()

    def _finish(self, seq: Sequence, reason: str, stop: str | None = None, notify: bool = True) -> None:
        now = time.perf_counter()
        self._release(seq)
        if not notify:
            return
        if seq.kind in ("score", "prefill") and reason in ("cancelled", "shutdown"):
            seq.session.send({"type": "done", "seq_id": seq.seq_id, "stop_reason": reason,
                              "request": seq.kind})
            return
        t_prompt_end = seq.t_first or now
        prompt_s = (t_prompt_end - seq.t_prompt) if seq.t_prompt else 0.0
        eval_s = (now - seq.t_first) if seq.t_first else 0.0
        ev = {"type": "done", "seq_id": seq.seq_id, "tokens_prompt": seq.n_prompt,
              "tokens_reused": seq.n_reused, "tokens_predicted": seq.n_predicted,
              "prompt_ms": round(prompt_s * 1000, 3), "eval_ms": round(eval_s * 1000, 3),
              "prompt_tps": round(seq.n_prompt / prompt_s, 2) if prompt_s > 0 else None,
              # the first token comes from the prompt's logits: n tokens take n - 1 decodes
              "eval_tps": round((seq.n_predicted - 1) / eval_s, 2) if eval_s > 0 and seq.n_predicted > 1 else None,
              "stop_reason": reason}
        if stop is not None:
            ev["stop"] = stop
        seq.session.send(ev)

    def _fail(self, seq: Sequence, message: str) -> None:
        kind = seq.kind
        self._release(seq)
        seq.session.send(error_event(message, seq.seq_id, kind))

    # ============================================================ ticks

    def has_work(self) -> bool:
        return bool(self.order)

    def tick(self) -> None:
        """Build one batch, decode it, then sample / score / finish what it produced."""
        ctx, batch = self.ctx, self.batch
        assert ctx is not None and batch is not None
        for seq in list(self.order):
            if seq.state == "generate" and seq.n_past >= ctx.n_ctx_seq:
                self._fail(seq, f"context full: sequence reached {ctx.n_ctx_seq} tokens "
                                f"(nCtx per sequence) after {seq.n_predicted} generated tokens")
        plan = self._plan(defer_prompts=False)
        job = self._start_masks(plan)  # runs while the decode does (mask_ahead.py)
        try:
            while plan:
                rc = ctx.decode(batch)
                if rc == 0:
                    break
                job.wait()  # the matchers must be idle before any sequence ends
                plan = self._recover(plan, rc)
        finally:
            job.wait()
        if not plan:
            return
        self.ticks += 1
        self._consume(plan, job)

    def _start_masks(self, plan: list) -> MaskJob:
        """Start filling the masks of the constrained sequences that sample this tick."""
        assert self.masks is not None
        return self.masks.start([(seq.slot, seq.matcher) for seq, what, _, n_out in plan
                                 if seq.matcher is not None and (what == "gen" or (
                                     what == "prompt" and n_out and seq.kind == "infer"))])

    def _plan(self, defer_prompts: bool) -> list[tuple[Sequence, str, int, int]]:
        """Fill the batch. Entries: (seq, what, first output row, number of outputs)."""
        batch = self.batch
        assert batch is not None
        batch.clear()
        plan = []
        row = 0
        for seq in self.order:
            if seq.state == "generate":
                batch.add([seq.next_token], seq.n_past, seq.slot, output_last=True)
                plan.append((seq, "gen", row, 1))
                row += 1
        now = time.perf_counter()
        for seq in prompt_order(self.order):
            if seq.state != "prompt" or batch.free == 0 or defer_prompts or seq.kv_wait:
                continue
            take = min(batch.free, len(seq.pending) - seq.fed)
            chunk = seq.pending[seq.fed:seq.fed + take]
            pos0 = seq.n_past
            if seq.t_prompt is None:
                seq.t_prompt = now
            if seq.kind == "score":
                first = seq.windows[seq.window][1]
                last_scored = len(seq.pending) - 2  # the row at p predicts token p + 1
                lo, hi = max(first, pos0), min(pos0 + take - 1, last_scored)
                batch.add(chunk, pos0, seq.slot, output_last=False)
                n_out = max(0, hi - lo + 1)
                if n_out:
                    batch.logits[batch.n - take + (lo - pos0): batch.n - take + (hi - pos0) + 1] = 1
                plan.append((seq, "score", row, n_out))
                row += n_out
            else:
                ends = seq.fed + take == len(seq.pending)
                needs_row = ends and seq.kind == "infer"
                batch.add(chunk, pos0, seq.slot, output_last=needs_row)
                plan.append((seq, "prompt", row, 1 if needs_row else 0))
                row += 1 if needs_row else 0
        return plan

    def _recover(self, plan: list, rc: int) -> list:
        """The decode failed: end only the sequences concerned, rebuild, and retry."""
        if rc != 1:  # aborted or an internal error: the sequences in the batch end
            for seq in {entry[0] for entry in plan}:
                self._fail(seq, f"decode failed (llama_decode returned {rc})")
            return self._plan(defer_prompts=False) if self.order else []
        prompt_seqs = [e[0] for e in plan if e[1] in ("prompt", "score")]
        gen_seqs = [e[0] for e in plan if e[1] == "gen"]
        if prompt_seqs and gen_seqs:
            for seq in prompt_seqs:  # let generation go on; retry prompts when cells free up
                seq.kv_wait = True
            return self._plan(defer_prompts=True)
        victims = prompt_seqs or gen_seqs
        victim = victims[-1] if prompt_seqs else max(victims, key=lambda s: s.n_past)
        self._fail(victim, "KV cache full: no room for this sequence's tokens "
                           f"(nCtx {self.ctx.n_ctx} cells shared by all sequences)")
        return self._plan(defer_prompts=False)

    def _consume(self, plan: list, job: MaskJob) -> None:
        ctx = self.ctx
        assert ctx is not None
        logits = ctx.logits()
        now = time.perf_counter()
        sampling: list[tuple[Sequence, int]] = []
        for seq, what, row, n_out in plan:
            if what == "gen":
                seq.tokens.append(seq.next_token)
                sampling.append((seq, row))
            elif what == "prompt":
                self._advance_prompt(seq)
                if seq.fed == len(seq.pending):
                    if seq.kind == "prefill":
                        seq.state = "held"
                        self.order.remove(seq)
                        ms = (now - seq.t_prompt) * 1000 if seq.t_prompt else 0.0
                        seq.session.send({"type": "prefilled", "seq_id": seq.seq_id,
                                          "tokens": seq.n_past, "prompt_ms": round(ms, 3)})
                    elif seq.max_tokens == 0:
                        seq.t_first = now
                        self._finish(seq, "max_tokens")
                    else:
                        seq.state = "generate"
                        seq.t_first = now
                        sampling.append((seq, row))
            else:
                self._advance_score(seq, logits[row:row + n_out])
        if sampling:
            self._sample(sampling, logits, job)

    def _advance_prompt(self, seq: Sequence) -> None:
        """Move the prompt tokens this tick's batch held for the sequence into its context."""
        batch = self.batch
        assert batch is not None
        # how many tokens of this sequence went into the batch: count them in the batch
        take = int(np.count_nonzero(batch.seq[:batch.n] == seq.slot))
        seq.tokens.extend(int(t) for t in seq.pending[seq.fed:seq.fed + take])
        seq.fed += take

    def _advance_score(self, seq: Sequence, rows: np.ndarray) -> None:
        batch = self.batch
        assert batch is not None
        pos0 = seq.n_past
        self._advance_prompt(seq)
        toks, first = seq.windows[seq.window]
        if len(rows):
            lo = max(first, pos0)
            seq.nll.extend(score_rows(rows, toks[lo + 1: lo + 1 + len(rows)]).tolist())
        if seq.fed == len(seq.pending):
            seq.window += 1
            assert self.ctx is not None
            self.ctx.seq_rm(seq.slot, -1, -1)
            seq.tokens = []
            if seq.window < len(seq.windows):
                seq.pending, seq.fed = seq.windows[seq.window][0], 0
            else:
                self._scored(seq)

    def _scored(self, seq: Sequence) -> None:
        nll = np.asarray(seq.nll, dtype=np.float64)
        mean = float(nll.mean()) if len(nll) else float("nan")
        ev = {"type": "scored", "seq_id": seq.seq_id, "tokens": len(nll), "nll": mean,
              "ppl": float(np.exp(mean)), "windows": len(seq.windows)}
        if seq.per_token:
            ev["token_nll"] = [round(x, 6) for x in seq.nll]
        session = seq.session
        self._release(seq)
        session.send(ev)

    def _sample(self, sampling: list[tuple[Sequence, int]], logits: np.ndarray, job: MaskJob) -> None:
        for seq, row in sampling:
            mask = None
            if seq.matcher is not None:
                mask = job.row(seq.slot)
                # _start_masks plans a superset of the sequences that sample: never unmasked
                assert mask is not None, f"no grammar mask planned for seq_id {seq.seq_id}"
            res = seq.sampler.sample(logits[row], mask)
            if res.empty:
                self._fail(seq, f"no token can be sampled: {res.reason}")
                continue
            self._accept(seq, int(res.token), res)

    def _accept(self, seq: Sequence, token: int, res: Any) -> None:
        model = self.model
        assert model is not None
        seq.sampler.accept(token)
        if model.is_eog(token):
            grammar_done = seq.matcher is not None and seq.matcher.is_accepting()
            seq.n_predicted += 0
            self._finish(seq, "grammar" if grammar_done else "eos")
            return
        if seq.matcher is not None and not seq.matcher.consume(token):
            self._fail(seq, f"grammar rejected token {token} (matcher: {seq.matcher.error()})")
            return
        piece = seq.utf8.feed(model.token_to_piece(token, special=True))
        ev: dict[str, Any] = {"type": "token", "seq_id": seq.seq_id, "token": token, "piece": piece}
        if seq.n_probs:
            ev["logprob"] = res.logprob
            ev["top"] = [{"token": t, "piece": self._piece(t), "logprob": lp} for t, lp in res.top]
            ev["steered_logprob"] = res.steered_logprob
            ev["steered_top"] = [{"token": t, "piece": self._piece(t), "logprob": lp}
                                 for t, lp in res.steered_top]
        seq.session.send(ev)
        seq.n_predicted += 1
        seq.next_token = token
        stop = seq.stops.feed(piece) if seq.stops else None
        if stop is not None:
            self._finish(seq, "stop", stop=stop)
        elif seq.matcher is not None and seq.matcher.is_stopped():
            self._finish(seq, "grammar")
        elif seq.n_predicted >= seq.max_tokens:
            self._finish(seq, "max_tokens")

    def _piece(self, token: int) -> str:
        assert self.model is not None
        return self.model.token_to_piece(token, special=True).decode("utf-8", "replace")

    # ============================================================ shutdown

    def shutdown(self) -> None:
        for seq in list(self.order):
            self._finish(seq, "shutdown", notify=False)
        if self.masks is not None:
            self.masks.close()
        if self.grammar_engine is not None:
            try:  # its tokenizer reads the model's vocabulary: let it finish first
                self.grammar_engine.wait(None)
            except Exception:  # noqa: BLE001 - a failed build is irrelevant at exit
                pass
        with self.model_lock:
            if self.ctx is not None:
                self.ctx.close()
            if self.model is not None:
                self.model.close()
            self.ctx = self.model = None
