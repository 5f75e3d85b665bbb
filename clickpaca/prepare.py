"""Slow, pure work done on a client's reader thread before a request reaches the engine.

The engine thread decodes for every client; anything slow it does for one request
delays all the others (tokenizing a 4 MB prompt blocked every sequence for 9.5 s,
compiling a 3,000-rule grammar for 8.7 s). Work that depends only on the request's own
text is done here instead, on the thread that read the request (stdio: the reader;
socket: that client's reader), and attached to a copy of the typed request in the
field protocol declares for it (`prompt_tokens`, `text_tokens`, `compiled`). The engine
uses a result when it is there and computes it itself otherwise, so a request is
answered the same either way. llama_tokenize (a cffi call) and llguidance
release the GIL, so the engine thread keeps decoding meanwhile.

- `infer` / `prefill` prompts (or chat messages, formatted by the same
  Runtime.prompt_text the engine uses) and `score` texts longer than
  TOKENIZE_MIN_CHARS: the token ids, both with and without BOS (whether the prompt
  continues a held sequence is known only when the engine applies it);
- `grammar`: the compiled grammar, or the GrammarError to answer with.

State files are not read here: a `load` must see the file of every `save` before it,
so they are written and read on the engine's own worker, in order (engine/stateio.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .protocol import GrammarRequest, InferRequest, PrefillRequest, Request, ScoreRequest

TOKENIZE_MIN_CHARS = 16 * 1024  # below this, tokenizing takes well under a tick


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's tokens both ways: whether it continues a held sequence (then without
    BOS) is known only when the engine applies the request."""

    fresh: np.ndarray
    continuing: np.ndarray

    def get(self, continuing: bool) -> np.ndarray:
        return self.continuing if continuing else self.fresh


def _prompt_chars(req: InferRequest | PrefillRequest) -> int:
    """The length of the prompt, or of the messages' contents (a chat template adds little)."""
    if req.messages is not None:
        return sum(len(m.content) for m in req.messages)
    return len(req.prompt)


def prepare(engine: Any, req: Request) -> Request:
    """`req`, or a copy with the precomputed work attached when the engine is ready;
    never raises."""
    rt = engine.rt  # clickpaca.engine.Runtime, None before init and after shutdown
    if rt is None:
        return req
    try:
        if isinstance(req, (InferRequest, PrefillRequest)) and _prompt_chars(req) >= TOKENIZE_MIN_CHARS:
            with engine.model_lock:
                if engine.rt is rt:
                    text = rt.prompt_text(req)  # a ProtocolError: the engine reports it
                    return dataclasses.replace(req, prompt_tokens=PromptTokens(
                        rt.tokenize_prompt(text, continuing=False), rt.tokenize_prompt(text, continuing=True)))
        elif isinstance(req, ScoreRequest) and len(req.text) >= TOKENIZE_MIN_CHARS:
            with engine.model_lock:
                if engine.rt is rt:
                    return dataclasses.replace(req, text_tokens=rt.model.tokenize(
                        req.text, add_special=True, parse_special=False))
        elif isinstance(req, GrammarRequest):
            from .grammars import GrammarError

            try:
                compiled = rt.grammars.compile(req.grammar, lenient=req.lenient,
                                               number_digits=req.numberDigits)
            except GrammarError as e:
                compiled = e
            return dataclasses.replace(req, compiled=compiled)
    except Exception:  # noqa: BLE001 - the engine will do the work itself and report
        pass
    return req
