"""One handler per request type but `init` and `quit` (the transport's), applied between ticks.

A handler gets the typed request the protocol layer has validated (every check that
needs only the request is done) and, beside it, the request's own work (a
prepare.Prepared: by the reader thread, else by the engine just before). It makes the checks that need the
server's state (is the seq_id in range and free, does the grammar exist, do the
logit_bias ids fit the vocabulary, does the prompt fit the context), each raising a
ProtocolError that names the field, and then either answers at once (grammar, cancel,
free, fork, stats), hands the file work to the state-file worker and answers when it
is done (save, load: statefiles.py, stateio.py), or sets up a sequence and starts its
job for the scheduler (infer, score, prefill: jobs.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..llama import features
from ..base.fieldcheck import show
from ..activations import steer, vector
from ..activations.slots import SlotsFull
from ..grammar.grammars import GrammarError
from ..wire.protocol import (REQUESTS, CancelRequest, ForkRequest, FreeRequest, GrammarRequest, InferRequest,
                             PrefillRequest, ProtocolError, ScoreRequest, StatsRequest, VectorRequest, forked_event,
                             freed_event, grammar_ready_event, stats_event, vector_freed_event, vector_ready_event)
from ..sampling import SamplerParamError, SequenceSampler
from ..sampling.fastpath import FastStats
from ..wire.scoring import windows_for
from .jobs import InferJob, PrefillJob, ScoreJob
from .prepare import Prepared
from . import jump, patches, readout
from .text import StopMatcher
from .accounting import MAX_GRAMMAR_TEXT_PER_SESSION, MAX_GRAMMARS_PER_SESSION, grammar_bytes
from .runtime import Runtime
from .sequences import Sequence, Sequences, Session
from .stateio import StateIO
from .statefiles import StateFileHandlers



class Handlers(StateFileHandlers):
    """The handlers of every request after init but quit (save and load: statefiles.py)."""

    def __init__(self, rt: Runtime, seqs: Sequences, io: StateIO,
                 stats: Callable[[Session], dict] | None = None) -> None:
        self.rt, self.seqs, self.io = rt, seqs, io
        self._stats = stats  # the engine's books (accounting.py)

    # ------------------------------------------------------------ grammars

    def grammar(self, session: Session, req: GrammarRequest, work: Prepared) -> None:
        if req.id not in session.grammars and len(session.grammars) >= MAX_GRAMMARS_PER_SESSION:
            raise ProtocolError(f"id: this session holds {MAX_GRAMMARS_PER_SESSION} grammars, the "
                                "limit (re-use an id to replace one)")
        compiled = work.grammar  # compiled by the reader, or the engine (prepare.work_for)
        if isinstance(compiled, GrammarError):
            raise ProtocolError(f"grammar: {compiled}")
        old = session.grammars.get(req.id)
        held = session.grammar_bytes - (grammar_bytes(old) if old is not None else 0) + grammar_bytes(compiled)
        if held > MAX_GRAMMAR_TEXT_PER_SESSION:
            raise ProtocolError(f"grammar: this session's grammars would hold {held} bytes of text, the "
                                f"limit is {MAX_GRAMMAR_TEXT_PER_SESSION} (re-use or replace an id)")
        session.grammar_bytes = held
        session.grammars[req.id] = compiled
        session.send(grammar_ready_event(req.id, **compiled.coverage_fields()))

    # ------------------------------------------------------------ steering vectors

    def _steering(self, field: str, seq_id: int, kind: str) -> Any:
        """The context's steering slots; the refusal naming `field` and the build that has them."""
        st = self.rt.steering
        if st is None:
            e = features.refusal("steer-slots", features.lacking("steer-slots", features.for_native(self.rt.model.nat)),
                                 self.rt.model.nat.name)
            raise ProtocolError(f"{field}: {e.reason}", seq_id, kind)
        return st

    def vector(self, session: Session, req: VectorRequest, work: Prepared) -> None:
        st = self._steering("vector", -1, "vector")
        if isinstance(req.vector, str) and session.namespace is not None:
            # a socket client names no file of the server's (state files are names in its
            # namespace, statedir.py): it sends the directions as data (wb.vector reads a
            # GGUF on the client's side)
            raise ProtocolError("vector: a socket client sends the directions as data ({layer: vector}); "
                                "a GGUF path is read on stdio only", -1, "vector")
        try:
            ready = st.register(session, req.id, req.vector)
        except KeyError:
            raise ProtocolError(f"id: vector {show(req.id)} is registered (free it first)", -1, "vector") from None
        except SlotsFull as e:
            raise ProtocolError(f"id: {e}", -1, "vector") from None
        except steer.SteerError as e:
            raise ProtocolError(str(e), -1, "vector") from None
        session.send(vector_ready_event(req.id, **ready))

    def _steer_for(self, session: Session, entries: tuple | None, seq_id: int, kind: str) -> Any:
        """A request's `steer` resolved against its session's vectors (None: it has none)."""
        if entries is None:
            return None
        st = self._steering("steer", seq_id, kind)
        try:
            return st.for_request(session, entries, self.rt.model.detokenize)
        except steer.SteerError as e:
            raise ProtocolError(str(e), seq_id, kind) from None

    # ------------------------------------------------------------ sequences that run

    def infer(self, session: Session, req: InferRequest, work: Prepared) -> None:
        rt, seqs = self.rt, self.seqs
        seq_id = req.seq_id
        seqs.check_id(seq_id, "infer")
        held = self._held_or_free(session, seq_id, "infer")
        try:  # the vocabulary-dependent checks: the rest was made at the edge (protocol)
            req.params.validate(rt.model.n_vocab)
        except SamplerParamError as e:
            raise ProtocolError(str(e), seq_id, "infer") from None
        compiled = None
        if req.grammar_id is not None:
            compiled = session.grammars.get(req.grammar_id)
            if compiled is None:
                raise ProtocolError(f"grammar_id: unknown grammar {show(req.grammar_id)} "
                                    "(send a grammar request first)", seq_id, "infer")
            if req.validate and compiled.check is None:
                raise ProtocolError(f"validate: grammar {show(req.grammar_id)} is not a JSON schema",
                                    seq_id, "infer")
        try:
            cvec = vector.for_request(rt.cvec, rt.model.nat, req.controlVectorStrength)
        except (features.FeatureMissing, steer.SteerError) as e:
            raise ProtocolError(str(e), seq_id, "infer") from None
        steering = self._steer_for(session, req.steer, seq_id, "infer")
        prompt = work.prompt.get(continuing=held is not None)  # both ways: prepare.work_for
        if held is None and len(prompt) == 0:
            raise ProtocolError("prompt: empty (nothing to continue from)", seq_id, "infer")
        self._check_fits(held, prompt, seq_id, "infer")
        if req.jumpForward:
            self._check_jump(req)
        rows = {"last": 1, "generated": req.maxTokens}.get(req.captureTokens, rt.ctx.n_ctx_seq)
        capture = readout.for_request(rt, req, session.namespace, min(rows, rt.ctx.n_ctx_seq))
        base = len(held.tokens) if held is not None else 0  # a patch names the positions of its prompt
        patch = patches.for_request(rt, req, session.namespace, base, base + len(prompt))
        seq = held if held is not None else seqs.new(session, seq_id, "infer")
        if held is not None:
            self._reopen_held(seq, prompt)
        else:
            seq.tokens, seq.n_past = prompt.tolist(), 0
            if req.reusePrefix and cvec is None and steering is None and patch is None:
                # a steered or patched prompt is computed steered or patched, never shared
                self._reuse_prefix(seq)
        self._no_lone_prompt_token(seq)
        seq.altered = seq.altered or patch is not None
        # The sampler reads the sequence's one history (the whole context: prompt, held,
        # forked or loaded tokens, then each accepted one), never a copy of it. It holds the
        # breaker table the preparation made (prepare.py) for the request's life.
        sampler = SequenceSampler(req.params, rt.model.n_vocab, vocab=rt.step_vocab, history=seq.tokens,
                                  prepared={"dry": work.dry} if work.dry is not None else None)
        seqs.start(seq, InferJob(n_prompt=len(seq.tokens) - seq.n_past, n_reused=seq.n_past, sampler=sampler,
                                 matcher=compiled.new_matcher() if compiled is not None else None,
                                 stops=StopMatcher(req.stop), max_tokens=req.maxTokens, capture=capture,
                                 patch=patch,
                                 steer=cvec, strength=req.controlVectorStrength,
                                 steering=steering,
                                 check=compiled.check if compiled is not None and (
                                     req.validate or compiled.checks_outputs) else None,
                                 paths=FastStats() if rt.ctx.presampler is not None else None,
                                 jump=req.jumpForward and compiled is not None,
                                 jump_rows=jump.needs_rows(req.params), jump_alone=rt.deterministic,
                                 pairs=jump.pairs(rt.deterministic, compiled)))

    def _check_jump(self, req: InferRequest) -> None:
        """jumpForward's limits (engine/jump.py): not with the decode's pre-selection (it
        orders the next row with its uniform before the decode, where forced tokens take
        theirs after it), an activation capture (a row a tick) or a user-defined step."""
        why = None
        if self.rt.ctx.presampler is not None:
            why = "not with init preselect (the pre-selection orders each row with its draw before the decode)"
        elif req.capture is not None or req.lens is not None:
            why = "not with capture or lens (they read one generated token a tick)"
        elif (users := jump.user_steps(req.params)):
            why = f"not with user-defined steps ({', '.join(users)}): what they do with a one-token set is unknown"
        if why is not None:
            raise ProtocolError(f"jumpForward: {why}", req.seq_id, "infer")

    def score(self, session: Session, req: ScoreRequest, work: Prepared) -> None:
        model, ctx, seqs = self.rt.model, self.rt.ctx, self.seqs
        seq_id = req.seq_id
        seqs.check_id(seq_id, "score")
        taken = session.seqs.get(seq_id)
        if taken is not None:  # a score starts from nothing: it never continues what a seq_id holds
            if taken.held:
                raise ProtocolError(f"seq_id: sequence {seq_id} is held; a score takes a free seq_id "
                                    "(it never continues a held sequence: free it first)", seq_id, "score")
            raise ProtocolError(f"seq_id: sequence {seq_id} is already active", seq_id, "score")
        window = req.window or min(512, ctx.n_ctx_seq)
        if window > ctx.n_ctx_seq:
            raise ProtocolError(f"window: {window} exceeds the context per sequence "
                                f"({ctx.n_ctx_seq})", seq_id, "score")
        tokens = work.text  # tokenized by the reader, or the engine (prepare.work_for)
        try:  # scoreLast against the window: scoring.check_score_last, the rule's one place
            windows = windows_for(tokens, window, model.bos if model.add_bos else None, req.scoreLast,
                                  field="scoreLast")
        except ValueError as e:
            raise ProtocolError(str(e), seq_id, "score") from None
        if not windows:
            raise ProtocolError("text: too short to score (needs at least 2 tokens)", seq_id, "score")
        rows = len(windows) if req.captureTokens == "last" else sum(len(w[0]) for w in windows)
        capture = readout.for_request(self.rt, req, session.namespace, rows)
        if req.patch is not None and len(windows) > 1:
            raise ProtocolError(f"patch: the text is scored in {len(windows)} windows; a patch names the "
                                "positions of one (a shorter text, or a larger window)", seq_id, "score")
        patch = patches.for_request(self.rt, req, session.namespace, 0, len(windows[0][0]))
        steering = self._steer_for(session, req.steer, seq_id, "score")
        seq = seqs.new(session, seq_id, "score")
        seq.tokens, seq.n_past = windows[0][0].tolist(), 0
        seqs.start(seq, ScoreJob(n_prompt=sum(len(w[0]) for w in windows), windows=windows,
                                 per_token=req.perToken, capture=capture, patch=patch, steering=steering))

    def prefill(self, session: Session, req: PrefillRequest, work: Prepared) -> None:
        seqs = self.seqs
        seq_id = req.seq_id
        seqs.check_id(seq_id, "prefill")
        held = self._held_or_free(session, seq_id, "prefill")
        steering = self._steer_for(session, req.steer, seq_id, "prefill")
        prompt = work.prompt.get(continuing=held is not None)  # both ways: prepare.work_for
        self._check_fits(held, prompt, seq_id, "prefill")
        capture = readout.for_request(self.rt, req, session.namespace,
                                      1 if req.captureTokens == "last" else len(prompt) + 1)
        base = len(held.tokens) if held is not None else 0
        patch = patches.for_request(self.rt, req, session.namespace, base, base + len(prompt))
        seq = held if held is not None else seqs.new(session, seq_id, "prefill")
        seq.tokens.extend(prompt.tolist())  # a held sequence's n_past stays: it continues
        self._no_lone_prompt_token(seq)
        seq.altered = seq.altered or patch is not None or steering is not None
        seqs.start(seq, PrefillJob(n_prompt=len(seq.tokens) - seq.n_past, capture=capture, patch=patch,
                                   steering=steering))

    def _held_or_free(self, session: Session, seq_id: int, kind: str) -> Sequence | None:
        """The held sequence to continue, None for a free seq_id; an active one is an error."""
        held = session.seqs.get(seq_id)
        if held is not None and not held.held:
            raise ProtocolError(f"seq_id: sequence {seq_id} is already active", seq_id, kind)
        return held

    def _check_fits(self, held: Sequence | None, prompt: np.ndarray, seq_id: int, kind: str) -> None:
        n_ctx_seq = self.rt.ctx.n_ctx_seq
        total = (held.n_past if held else 0) + len(prompt)
        if total >= n_ctx_seq:
            raise ProtocolError(f"prompt: {total} tokens do not fit the context "
                                f"({n_ctx_seq} tokens per sequence)", seq_id, kind)

    def _reopen_held(self, seq: Sequence, prompt: np.ndarray) -> None:
        """Continue a held sequence: re-feed its last token so there is a logits row."""
        seq.n_past -= 1
        self.rt.ctx.seq_rm(seq.slot, seq.n_past, -1)
        seq.tokens.extend(prompt.tolist())

    def _no_lone_prompt_token(self, seq: Sequence) -> None:
        """Deterministic mode: a prompt of one token to feed after others re-feeds the one
        before it too. Attention over a sequence's single token in a micro-batch takes
        another kernel path than over two or more (docs/DETERMINISM.md), so that token's
        cells would differ from the ones a cold run computes in a longer chunk."""
        if self.rt.deterministic and len(seq.tokens) - seq.n_past == 1 and seq.n_past > 0:
            seq.n_past -= 1
            self.rt.ctx.seq_rm(seq.slot, seq.n_past, -1)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Share the cells of the held sequence with the longest common prompt prefix."""
        ctx, model = self.rt.ctx, self.rt.model
        best, best_n = None, 0
        for other in seq.session.seqs.values():
            if other is seq or not other.held or not other.tokens or other.altered:
                continue
            m = min(len(other.tokens), len(seq.tokens) - 1)
            a = np.asarray(other.tokens[:m], np.int32)
            diff = np.flatnonzero(a != np.asarray(seq.tokens[:m], np.int32))
            n = int(diff[0]) if len(diff) else m
            if n < len(other.tokens) and ctx.seq_pos_min(other.slot) > max(
                    0, n - model.nat.lib.llama_model_n_swa(model.ptr)):
                continue  # cells before n left its sliding window (a loaded state keeps the last)
            if n > best_n:
                best, best_n = other, n
        if self.rt.deterministic and best_n < 2:
            return  # a one-token prefix was computed alone: a cold run computes it in a chunk
        if best is not None and best_n > 0:
            if ctx.kv_unified:
                ctx.seq_cp(best.slot, seq.slot, 0, best_n)
            else:  # one stream per sequence: llama.cpp copies only whole streams; cut the copy
                ctx.seq_cp(best.slot, seq.slot, -1, -1)
                ctx.seq_rm(seq.slot, best_n, -1)
            seq.n_past = best_n

    # ------------------------------------------------------------ running and held sequences

    def cancel(self, session: Session, req: CancelRequest, work: Prepared) -> None:
        seq = session.seqs.get(req.seq_id)
        if seq is None or seq.job is None:
            raise ProtocolError(f"seq_id: sequence {req.seq_id} is not running "
                                "(use free to release a held sequence)", req.seq_id, "cancel")
        self.seqs.finish(seq, "cancelled")

    def free(self, session: Session, req: FreeRequest, work: Prepared) -> None:
        if req.vector is not None:  # a running request that uses it keeps it to its end (slots.py)
            if not self._steering("vector", -1, "free").free(session, req.vector):
                raise ProtocolError(f"vector: unknown vector {show(req.vector)}", -1, "free")
            session.send(vector_freed_event(req.vector))
            return
        seq = session.seqs.get(req.seq_id)
        if seq is None:
            raise ProtocolError(f"seq_id: sequence {req.seq_id} holds nothing", req.seq_id, "free")
        if seq.job is None:  # held, or loading (a load in progress then answers with an error)
            self.seqs.release(seq)
        else:
            self.seqs.finish(seq, "cancelled")
        session.send(freed_event(req.seq_id))

    def fork(self, session: Session, req: ForkRequest, work: Prepared) -> None:
        seqs = self.seqs
        src = session.seqs.get(req.seq_id)
        dst_id = req.dst_seq_id
        try:
            seqs.check_id(dst_id, "fork", "dst_seq_id")
        except ProtocolError as e:
            e.seq_id = req.seq_id  # answer on the request's seq_id, where the client waits
            raise
        if src is None or not src.held:
            raise ProtocolError(f"seq_id: sequence {req.seq_id} holds no state to fork "
                                "(prefill it first)", req.seq_id, "fork")
        if dst_id in session.seqs:
            raise ProtocolError(f"dst_seq_id: sequence {dst_id} is in use", req.seq_id, "fork")
        dst = seqs.new(session, dst_id, "fork")  # starts held: a fork is how a sequence starts, not a kind
        self.rt.ctx.seq_cp(src.slot, dst.slot, -1, -1)
        dst.tokens, dst.n_past = list(src.tokens), src.n_past
        dst.altered = src.altered  # the same cells: a patched or steered prefix stays unshared
        session.send(forked_event(src.seq_id, dst_id, dst.n_past))

    def stats(self, session: Session, req: StatsRequest, work: Prepared) -> None:
        session.send(stats_event(**(self._stats(session) if self._stats is not None else {})))


#: Request type -> its handler, called with the session, the request and its work (a
#: prepare.Prepared, empty for the types with none): every request of the protocol's list (REQUESTS) but
#: `init` and `quit`, whose rules are the transport's (server.Rules): stdio applies init
#: (Engine.init) and ends at quit, the socket server compares init with what it runs and
#: ends the client's connection at quit.
HANDLERS: dict[str, Callable[[Handlers, Session, Any], None]] = {
    "grammar": Handlers.grammar,
    "vector": Handlers.vector,
    "infer": Handlers.infer,
    "score": Handlers.score,
    "prefill": Handlers.prefill,
    "cancel": Handlers.cancel,
    "free": Handlers.free,
    "fork": Handlers.fork,
    "save": Handlers.save,
    "load": Handlers.load,
    "stats": Handlers.stats,
}
TRANSPORT_RULES = {"init", "quit"}
if set(HANDLERS) != set(REQUESTS) - TRANSPORT_RULES:  # a request added to the protocol needs a handler
    raise ImportError(f"engine handlers {sorted(HANDLERS)} do not match the protocol's requests "
                      f"{sorted(set(REQUESTS) - TRANSPORT_RULES)}")
