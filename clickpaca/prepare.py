"""Slow, pure work done on a client's reader thread before a request reaches the engine.

The engine thread decodes for every client; anything slow it does for one request
delays all the others (tokenizing a 4 MB prompt blocked every sequence for 9.5 s,
compiling a 3,000-rule grammar for 8.7 s). Work that depends only on the request's own
text is done here instead, on the thread that read the request (stdio: the reader;
socket: that client's reader), and attached to the request under keys starting with
"_". The engine uses a result when it is there and computes it itself otherwise, so a
request is answered the same either way. llama_tokenize (a cffi call) and llguidance
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

from typing import Any

TOKENIZE_MIN_CHARS = 16 * 1024  # below this, tokenizing takes well under a tick


def _prompt_chars(req: dict) -> int:
    """The length of the prompt, or of the messages' contents (a chat template adds little)."""
    if req["messages"] is not None:
        return sum(len(m.content) for m in req["messages"])
    return len(req["prompt"])


def prepare(engine: Any, req: dict) -> dict:
    """Attach precomputed results to `req` (in place) when the engine is ready; never raises."""
    rt = engine.rt  # clickpaca.engine.Runtime, None before init and after shutdown
    if rt is None:
        return req
    kind = req["type"]
    try:
        if kind in ("infer", "prefill") and _prompt_chars(req) >= TOKENIZE_MIN_CHARS:
            with engine.model_lock:
                if engine.rt is rt:
                    text = rt.prompt_text(req)  # a ProtocolError: the engine reports it
                    req["_tokens"] = {False: rt.tokenize_prompt(text, continuing=False),
                                      True: rt.tokenize_prompt(text, continuing=True)}
        elif kind == "score" and len(req["text"]) >= TOKENIZE_MIN_CHARS:
            with engine.model_lock:
                if engine.rt is rt:
                    req["_tokens"] = rt.model.tokenize(req["text"], add_special=True, parse_special=False)
        elif kind == "grammar":
            from .grammars import GrammarError

            try:
                req["_compiled"] = rt.grammars.compile(req["grammar"])
            except GrammarError as e:
                req["_compiled"] = e
    except Exception:  # noqa: BLE001 - the engine will do the work itself and report
        for key in ("_tokens", "_compiled"):
            req.pop(key, None)
    return req
