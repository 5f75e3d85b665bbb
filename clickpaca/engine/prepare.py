"""The work proportional to a request's size, done on a client's reader thread before
the request reaches the engine.

The engine thread decodes for every client, so anything it does for one request that grows
with that request delays all the others (a 4 MB prompt's tokenizing blocked every sequence
for 9.5 s). So each request's own text is worked on here, on the thread that read it, and
the result travels beside the typed request as a `Prepared`: `infer` / `prefill` their
prompt (or formatted chat) tokenized with and without BOS, or the ProtocolError to answer
with; `score` its tokens; `grammar` the compiled grammar or its GrammarError; an `infer` with DRY its breaker
table (sampling/dry.py's Tables shares and bounds them), which the request's sampler holds
for its life, so the engine thread never makes one. One function does the work (`work_for`): readers call it through
`prepare`, and the engine calls it before every handler for what no reader did, so a
request is answered the same either way. State files are not read here: a `load` must see
every earlier `save`, so they go through the engine's own worker (engine/stateio.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..grammar.grammars import CompiledGrammar, GrammarError
from ..sampling import dry
from ..wire.protocol import GrammarRequest, InferRequest, PrefillRequest, ProtocolError, Request, ScoreRequest

if TYPE_CHECKING:
    from .runtime import Runtime


class SharedUse:
    """Many users at once (`with use:`: reader threads tokenizing with the model), or one
    `exclusive()` holder with no user (shutdown, closing the model)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._users = 0

    def __enter__(self) -> "SharedUse":
        with self._cond:
            self._users += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._users -= 1
            self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._cond.wait_for(lambda: self._users == 0)
            yield


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's tokens both ways: whether it continues a held sequence (then without
    BOS) is known only when the engine applies the request."""

    fresh: np.ndarray | None
    continuing: np.ndarray | None
    error: ProtocolError | None = None  # the messages could not be formatted

    def get(self, continuing: bool) -> np.ndarray:
        if self.error is not None:
            raise self.error
        return self.continuing if continuing else self.fresh


@dataclass(frozen=True, eq=False)
class Prepared:
    """A request's own work, kept beside it (the request holds what the client sent):
    the fields its type needs are set (an infer: `prompt`, and `dry` with DRY); none for
    the types with no work."""

    prompt: PromptTokens | None = None  # infer, prefill
    text: np.ndarray | None = None  # score: the text's tokens
    grammar: CompiledGrammar | GrammarError | None = None  # grammar: compiled, or why not
    dry: dry.Breakers | None = None  # an infer with DRY (beside `prompt`): its breaker table


NOTHING = Prepared()  # the work of a request that needs none


def work_for(req: Request, rt: "Runtime", done: Prepared | None = None, where: str = "engine") -> Prepared:
    """The request's own work: `done` when a reader did it, else done here: the
    prompt's tokens both ways (or the ProtocolError to answer with), the score text's
    tokens, the compiled grammar (or the GrammarError), DRY's breaker table. `where`:
    "reader" or "engine", the thread it runs on (DRY counts the tables the engine
    thread makes). Raises only on a bug."""
    if done is not None:
        return done
    if isinstance(req, (InferRequest, PrefillRequest)):
        try:
            text = rt.prompt_text(req)
            tokens = PromptTokens(rt.tokenize_prompt(text, False, req.seq_id, req.type),
                                  rt.tokenize_prompt(text, True, req.seq_id, req.type))
        except ProtocolError as e:
            tokens = PromptTokens(None, None, e)
        return Prepared(prompt=tokens, dry=_dry_breakers(req, rt, where) if isinstance(req, InferRequest) else None)
    if isinstance(req, ScoreRequest):
        return Prepared(text=rt.score_tokens(req.text))
    if isinstance(req, GrammarRequest):
        try:
            compiled = rt.grammars.compile(req.grammar, lenient=req.lenient, number_digits=req.numberDigits,
                                           strict=req.strict, validate=req.validate)
        except GrammarError as e:
            compiled = e
        return Prepared(grammar=compiled)
    return NOTHING


def _dry_breakers(req: InferRequest, rt: "Runtime", where: str) -> dry.Breakers | None:
    """DRY's breaker table for the request's sampler (None: DRY is off or has no
    breakers): shared with the requests alive that use the same set, else made here
    (~0.1 s for 64 breakers of 40 characters, plus ~3 s to read and index the vocabulary
    the first time); a reader may wait here for requests to end (dry.MAX_TABLE_BYTES)."""
    p = req.params
    if p.dry_multiplier != 0 and p.dry_penalty_last_n != 0 and p.dry_sequence_breakers:
        return dry.breakers(rt.step_vocab, p.dry_sequence_breakers, where)
    return None


def prepare(req: Request, runtime: Callable[[], "Runtime | None"], model_lock: SharedUse) -> Prepared | None:
    """`work_for` on a reader thread when a runtime is open (`runtime()`: the engine's,
    None before init and after shutdown; `model_lock` keeps shutdown from closing the
    model while a prompt or text is tokenized); None: nothing was done (no runtime, or a
    bug, which the engine thread's `work_for` then meets and reports). Never raises."""
    rt = runtime()
    if rt is None:
        return None
    try:
        if isinstance(req, GrammarRequest):  # compiles with the grammar engine, not the model
            return work_for(req, rt, where="reader")
        with model_lock:
            if runtime() is rt:
                return work_for(req, rt, where="reader")
    except Exception:  # noqa: BLE001 - the engine thread does it again and reports it
        pass
    return None
