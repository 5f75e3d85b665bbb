"""A compiled grammar and one sequence's matcher over it: the mask rows it fills, the
tokens it consumes, forces and rolls back; and reading a mask row (`allowed_ids`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from llguidance import LLMatcher

from ..json_keys import KeyTracker
from ...sampling import bitmask
from ..schema_check import SchemaCheck
from ..schema_coverage import Ignored
from .formats import short_error

if TYPE_CHECKING:
    from .grammar_engine import GrammarEngine


#: Set CLICKPACA_KEY_BAN=0 to let JSON objects repeat keys again (json_keys.py), for comparison.
KEY_BAN = os.environ.get("CLICKPACA_KEY_BAN", "1") != "0"


def allowed_ids(row: np.ndarray, n_vocab: int | None = None) -> np.ndarray:
    """The token ids (ascending) whose bits are set in one mask row (all of its bits
    without `n_vocab`): sampling/bitmask.py's, which expands only non-zero words."""
    n = n_vocab if n_vocab is not None else 32 * np.asarray(row).size
    return bitmask.allowed_ids(bitmask.as_words(row, n), n)


def is_allowed(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Bool array: which of the token ids `ids` the mask row allows (sampling/bitmask.py).

    The cheap path for samplers: take the top candidates from the logits first, keep the
    allowed ones, and fall back to `allowed_ids` only when none is.
    """
    return bitmask.allows(np.asarray(row).view(np.uint32), np.asarray(ids, dtype=np.int64))


class CompiledGrammar:
    """A validated grammar: a template matcher in its start state, never advanced itself."""

    __slots__ = ("engine", "format", "source", "grammar", "_template", "warnings", "ignored",
                 "check", "checks_outputs")

    def __init__(self, engine: GrammarEngine, fmt: str, source: str, grammar: str,
                 template: LLMatcher, warnings: list[str], ignored: list[Ignored] | None = None,
                 check: SchemaCheck | None = None) -> None:
        self.engine = engine
        self.format = fmt          # "gbnf" | "lark" | "json_schema"
        self.source = source       # the text given to compile()
        self.grammar = grammar     # llguidance's serialized grammar
        self._template = template
        self.warnings = warnings   # llguidance's grammar warnings (not errors)
        self.ignored = ignored or []  # what the grammar does not enforce (schema_coverage.py)
        self.check = check         # a JSON schema's validator of outputs (schema_check.py)
        self.checks_outputs = False  # every finished output is checked (set by compile)

    @property
    def enforced(self) -> bool:
        """Every keyword of the grammar is enforced (always, for GBNF and Lark)."""
        return not self.ignored

    def coverage_fields(self) -> dict:
        """`grammar_ready`'s account of a JSON schema: enforced, and what is not (empty
        for GBNF and Lark, which are enforced as written)."""
        if self.format != "json_schema":
            return {}
        return {"enforced": self.enforced, "ignored": [i.as_dict() for i in self.ignored]}

    def new_matcher(self) -> "Matcher":
        """An independent matcher at the grammar's start (a ~1 us deep copy)."""
        return Matcher(self._template.deep_copy(), self)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.format}, {len(self.source)} chars)"


class Matcher:
    """One sequence's grammar state. Not thread-safe; one per sequence."""

    __slots__ = ("llg", "grammar", "engine", "n_consumed", "keys")

    def __init__(self, m: LLMatcher, grammar: CompiledGrammar) -> None:
        self.llg = m  # llguidance's matcher
        self.grammar = grammar
        self.engine = grammar.engine
        self.n_consumed = 0
        # a JSON schema's keys, so that no object repeats one (json_keys.py); its ban is
        # applied wherever this matcher's mask is made
        index = grammar.engine.key_index
        self.keys = (KeyTracker(index) if KEY_BAN and grammar.format == "json_schema" and index is not None
                     else None)

    def fill_mask(self, row: np.ndarray) -> None:
        """Compute the next-token mask into one int32 row of ceil(n_vocab/32) words."""
        eng = self.engine
        if row.dtype != np.int32 or row.shape != (eng.n_words,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask row must be a contiguous int32 [{eng.n_words}] array")
        self.llg.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        eng.add_eog(row.reshape(1, -1), np.zeros(1, dtype=np.intp))
        if self.keys is not None:
            self.keys.ban(row)

    def mask(self) -> np.ndarray:
        """A fresh mask row (convenience for tests and one-off use)."""
        row = np.zeros(self.engine.n_words, dtype=np.int32)
        self.fill_mask(row)
        return row

    def consume(self, token: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar rejects it.

        Any end-of-generation token ends the grammar (accepted only where it may end).
        """
        ok = self.llg.consume_token(int(token))
        if ok:
            self.n_consumed += 1
            if self.keys is not None:
                self.keys.push(token)
        return ok

    def consume_many(self, tokens: Iterable[int]) -> bool:
        """Advance by several tokens (e.g. forced ones); False on the first rejection."""
        toks = [int(t) for t in tokens]
        ok = self.llg.consume_tokens(toks)
        if ok:
            self.n_consumed += len(toks)
            if self.keys is not None:
                for t in toks:
                    self.keys.push(t)
        return ok

    def is_accepting(self) -> bool:
        """The grammar may end here (an EOG token is allowed)."""
        return self.llg.is_accepting()

    def is_stopped(self) -> bool:
        """No further token is possible except EOG (also true in an error state)."""
        return self.llg.is_stopped()

    def error(self, verbose: bool = False) -> str | None:
        """llguidance's message if the matcher is in an error state, else None.

        verbose=False cuts llguidance's parser-state dump (<state>...</grammar>).
        """
        if not self.llg.is_error():
            return None
        msg = self.llg.get_error()
        return msg if verbose else short_error(msg)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (fast-forward), possibly empty."""
        return list(self.llg.compute_ff_tokens())

    def forced_bytes(self) -> bytes:
        return bytes(self.llg.compute_ff_bytes())

    def widen_forced(self, row: np.ndarray) -> np.ndarray | None:
        """`row` plus the shorter spellings of the bytes the grammar forces next, or None
        if there are none.

        Where the grammar forces bytes (an object's `{"a": ` in a JSON schema), llguidance's
        mask allows only the one token that spells them canonically (`{"`), though the
        matcher accepts the same bytes spelled by shorter tokens (`{`, then `"`). A
        logit_bias that bans the canonical token would leave nothing to sample; the
        sampler retries with this wider row instead (engine/jobs.py: InferJob.sampled)."""
        forced = self.forced_bytes()
        model = self.engine.model
        extra = []
        for k in range(1, len(forced)):
            toks = model.tokenize(forced[:k], add_special=False, parse_special=False)
            if len(toks) == 1 and self.llg.validate_tokens([int(toks[0])]) == 1:
                extra.append(int(toks[0]))
        if not extra:
            return None
        wider = row.copy()
        bits = wider.view(np.uint32)
        for t in extra:
            bits[t >> 5] |= np.uint32(1 << (t & 31))
        if self.keys is not None:  # a shorter spelling may close a repeated key
            self.keys.ban(wider)
        return wider

    def rollback(self, n: int) -> bool:
        """Undo the last n consumed tokens."""
        ok = self.llg.rollback(int(n))
        if ok:
            self.n_consumed = max(0, self.n_consumed - int(n))
            if self.keys is not None:
                self.keys.rollback(n)
        return ok

    def fork(self) -> "Matcher":
        """An independent copy of this matcher in its current state."""
        m = Matcher(self.llg.deep_copy(), self.grammar)
        m.n_consumed = self.n_consumed
        m.keys = self.keys.fork() if self.keys is not None else None
        return m


def fill_masks(matchers: Sequence[Matcher | None], bitmask: np.ndarray,
               rows: Sequence[int] | np.ndarray | None = None,
               parallel: bool | None = None) -> None:
    """`GrammarEngine.fill_masks` of the matchers' engine (all must share one engine)."""
    engine = next((m.engine for m in matchers if m is not None), None)
    if engine is None:
        return
    if any(m is not None and m.engine is not engine for m in matchers):
        raise ValueError("matchers of different grammar engines in one fill_masks call")
    engine.fill_masks(matchers, bitmask, rows, parallel)
