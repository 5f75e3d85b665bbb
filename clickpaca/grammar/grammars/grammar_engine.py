"""`GrammarEngine`: llguidance's tokenizer for one model, built once from the model's own
vocabulary (in a background thread: `start`), grammar compilation with a bounded cache,
and a tick's mask rows for a whole batch (`fill_masks`: int32 words, bit j of word i =
token 32*i+j; serial by default, run during the decode by engine/mask_ahead.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

import llguidance.numpy as llg_np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from ..gbnf import gbnf_to_lark
from ..json_keys import KeyIndex
from ..json_schema import NUMBER_DIGITS
from ..schema_check import SchemaCheck
from ..schema_coverage import Ignored
from .formats import (FORMAT_NAMES, JSON_SCHEMA_HEADER, LARK_HEADER, GrammarError, detect_format,
                      lark_header_options, short_error)
from .limits import MAX_GRAMMAR_RULES, check_limits, on_big_stack
from .matcher import CompiledGrammar
from .schemas import JSON_DEFAULTS, schema_for_llguidance, schema_overrides

if TYPE_CHECKING:
    from .matcher import Matcher


#: From this many sequences per tick up, masks are computed on llguidance's thread pool;
#: 0 (the default) = never. Measured on the 2-core machine, the pool lost at every batch
#: size (1, 8, 64): docs/GRAMMARS.md. $CLICKPACA_GRAMMAR_PAR_MIN changes it.
PARALLEL_MIN_BATCH = int(os.environ.get("CLICKPACA_GRAMMAR_PAR_MIN", "0"))


class GrammarEngine:
    """llguidance's tokenizer for one model, grammar compilation and batch masks.

    `GrammarEngine(model)` builds the tokenizer now (seconds); `GrammarEngine.start(model)`
    returns at once and builds it in a daemon thread (`compile`, `fill_masks` and
    `tokenizer` wait for it; `ready` / `wait()` poll). Holds a reference to the model:
    the tokenizer keeps raw pointers to its vocabulary and to llama_tokenize.
    """

    def __init__(self, model: Any, *, n_threads: int | None = None, cache_size: int = 64,
                 cache_bytes: int = 32 << 20, _background: bool = False) -> None:
        self.model = model
        self.n_vocab = int(model.n_vocab)
        self.n_words = (self.n_vocab + 31) // 32
        self.n_threads = n_threads or min(2, os.cpu_count() or 1)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes  # the cached grammars' texts (source + serialized) together
        self._cache_held = 0
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()  # (text, options) -> compiled
        self._cache_lock = threading.Lock()
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._tok: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self.eog_tokens: np.ndarray = np.zeros(0, dtype=np.int32)
        self.key_index: KeyIndex | None = None  # quote-holding tokens (json_keys.py)
        self.eos: int = int(model.eos)
        self.build_seconds: float | None = None
        self._thread: threading.Thread | None = None
        if _background:
            self._thread = threading.Thread(target=self._build_guarded, name="grammar-tokenizer",
                                            daemon=True)
            self._thread.start()
        else:
            self._build_guarded()
            self._check_built()

    @classmethod
    def start(cls, model: Any, **kwargs: Any) -> "GrammarEngine":
        """Start building the tokenizer in a background thread; return immediately."""
        return cls(model, _background=True, **kwargs)

    # ------------------------------------------------------------ tokenizer

    def _build_guarded(self) -> None:
        t0 = time.perf_counter()
        try:
            self._build()
            self.build_seconds = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits
            self._build_error = e
        finally:
            self._ready.set()

    def _build(self) -> None:
        model = self.model
        ffi, lib = model.nat.ffi, model.nat.lib
        eog = np.asarray(model.eog_tokens, dtype=np.int32)
        if eog.size == 0:
            eog = np.array([self.eos], dtype=np.int32)
        control = int(lib.LLAMA_TOKEN_ATTR_CONTROL)
        user = int(lib.LLAMA_TOKEN_ATTR_USER_DEFINED)
        get_attr, vocab = lib.llama_vocab_get_attr, model.vocab
        tokens: list[bytes] = []
        for t in range(self.n_vocab):
            piece = model.token_to_piece(t, special=True)
            attr = int(get_attr(vocab, t))
            # Control tokens (and user-defined ones that look like <...>) are special:
            # llguidance recognises them by the 0xff prefix and never matches their text.
            if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            tokens.append(piece)
        vocab_ptr = int(ffi.cast("uintptr_t", vocab))
        tokenize_fptr = int(ffi.cast("uintptr_t", lib.llama_tokenize))
        tok = LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab_ptr,
                                        tokenize_fptr=tokenize_fptr,
                                        eos_token=[int(x) for x in eog])
        if tok.vocab_size != self.n_vocab:
            raise RuntimeError(f"llguidance tokenizer has {tok.vocab_size} tokens, "
                               f"the model {self.n_vocab}")
        self.eog_tokens = eog
        words = eog // 32
        self._eog_words = np.unique(words)
        self._eog_bits = np.array(
            [np.bitwise_or.reduce((np.uint32(1) << (eog[words == w] % 32).astype(np.uint32)))
             for w in self._eog_words], dtype=np.uint32)
        self._eos_word, self._eos_bit = divmod(int(tok.eos_token), 32)
        self._executor = LLExecutor(num_threads=self.n_threads)
        self.key_index = KeyIndex(tokens)
        self._tok = tok

    @property
    def ready(self) -> bool:
        """True once the tokenizer is built (or its build failed)."""
        return self._ready.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the tokenizer; True if ready. Raises if the build failed."""
        if not self._ready.wait(timeout):
            return False
        self._check_built()
        return True

    def _check_built(self) -> None:
        if self._build_error is not None:
            raise RuntimeError(f"building the grammar tokenizer failed: {self._build_error}") \
                from self._build_error

    @property
    def tokenizer(self) -> LLTokenizer:
        self.wait()
        assert self._tok is not None
        return self._tok

    # ------------------------------------------------------------ compile

    def compile(self, text: str, *, lenient: bool = False,
                number_digits: int | None = NUMBER_DIGITS, strict: bool = False,
                validate: bool = False) -> "CompiledGrammar":
        """Compile grammar text (format detected, see module doc); GrammarError if invalid.

        The options act on JSON schemas only (docs/GRAMMARS.md): by default unknown
        formats are annotations and a oneOf not proven disjoint compiles as anyOf (both
        listed in the result's `ignored`, schema_coverage.py); `lenient` also ignores the
        keywords llguidance does not implement; `strict` refuses all of these;
        `number_digits` bounds typed numbers' integral digits (None: unbounded);
        `validate` checks every finished output against the schema even when it is
        enforced whole (`checks_outputs`).
        """
        if not isinstance(text, str):
            raise GrammarError(f"grammar must be a string, got {type(text).__name__}")
        key = (text, bool(lenient), number_digits, bool(strict), bool(validate))
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(text, bool(lenient), number_digits, bool(strict))
        compiled.checks_outputs = compiled.format == "json_schema" and (bool(validate) or not compiled.enforced)
        with self._cache_lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cache_held -= _text_bytes(old)
            self._cache[key] = compiled
            self._cache_held += _text_bytes(compiled)
            while len(self._cache) > self.cache_size or self._cache_held > self.cache_bytes:
                self._cache_held -= _text_bytes(self._cache.popitem(last=False)[1])
        return compiled

    def cache_stats(self) -> dict[str, int]:
        """The compile cache's entries and texts' bytes, and their bounds."""
        with self._cache_lock:
            return {"entries": len(self._cache), "maxEntries": self.cache_size,
                    "bytes": self._cache_held, "maxBytes": self.cache_bytes}

    def _compile(self, text: str, lenient: bool, number_digits: int | None,
                 strict: bool) -> "CompiledGrammar":
        fmt = detect_format(text)
        if not text.strip():
            raise GrammarError("empty grammar", fmt)
        check_limits(text, fmt)
        return on_big_stack(self._compile_checked, text, fmt, lenient, number_digits, strict)

    def _compile_checked(self, text: str, fmt: str, lenient: bool,
                         number_digits: int | None, strict: bool) -> "CompiledGrammar":
        grammar, schema, ignored = self._to_llguidance(text, fmt, lenient, number_digits, strict)
        name = FORMAT_NAMES[fmt]
        tok = self.tokenizer
        # Never raises for grammar errors: the matcher enters an error state instead.
        matcher = LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {name}: {short_error(matcher.get_error())}", fmt)
        # Some problems (lexer/parser limits) only show when the first mask is computed.
        scratch = np.zeros(self.n_words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            raise GrammarError(f"invalid {name}: {short_error(matcher.get_error())}", fmt)
        if not scratch.any():
            raise GrammarError(f"invalid {name}: the grammar allows no token at the start", fmt)
        warnings = list(matcher.get_grammar_warnings())
        return CompiledGrammar(self, fmt, text, grammar, matcher, warnings, ignored,
                               SchemaCheck(schema).prepare() if fmt == "json_schema" else None)

    def _tokenize_special(self, text: str) -> list[int]:
        """Token ids of text with special tokens parsed (GBNF `<text>` token references)."""
        return [int(t) for t in self.model.tokenize(text, add_special=False, parse_special=True)]

    def _to_llguidance(self, text: str, fmt: str, lenient: bool, number_digits: int | None,
                       strict: bool = False) -> tuple[str, Any, list[Ignored]]:
        """(llguidance's grammar, the parsed schema or None, what it leaves unenforced)."""
        if fmt == "lark":
            return LLMatcher.grammar_from_lark(lark_header_options(text)), None, []
        if fmt == "json_schema":
            body = text.lstrip()[len(JSON_SCHEMA_HEADER):]
            try:
                schema = json.loads(body)
            except ValueError as e:
                raise GrammarError(f"invalid JSON after {JSON_SCHEMA_HEADER}: {e}", fmt) from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object (or true), got "
                                   f"{type(schema).__name__}", fmt)
            try:
                given, ignored = schema_for_llguidance(schema, lenient, strict, number_digits)
                return LLMatcher.grammar_from_json_schema(
                    given, defaults=JSON_DEFAULTS, overrides=schema_overrides(strict)), schema, ignored
            except (ValueError, TypeError) as e:
                raise GrammarError(f"invalid JSON schema: {e}", fmt) from None
        try:
            lark = gbnf_to_lark(text, self._tokenize_special, MAX_GRAMMAR_RULES)
        except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions
            hint = ""
            if "start" in text and ":" in text and "::=" not in text:
                hint = (f" (a grammar in llguidance's Lark dialect must start with "
                        f"'{LARK_HEADER} {{}}')")
            raise GrammarError(f"invalid GBNF grammar: {e}{hint}", fmt) from None
        return LLMatcher.grammar_from_lark(lark), None, []

    # ------------------------------------------------------------ masks

    def allocate_bitmask(self, n: int) -> np.ndarray:
        """A zeroed int32 [n, ceil(n_vocab/32)] array for `fill_masks`."""
        return np.zeros((n, self.n_words), dtype=np.int32)

    def fill_masks(self, matchers: Sequence["Matcher | None"], bitmask: np.ndarray,
                   rows: Sequence[int] | np.ndarray | None = None,
                   parallel: bool | None = None) -> None:
        """Compute the next-token mask of each matcher into its row of `bitmask`.

        matchers[i] goes to row rows[i] (default i); None entries are skipped (their rows
        are left as they are). Rows of matchers whose grammar may end get every EOG bit.
        parallel: None chooses (serial unless PARALLEL_MIN_BATCH is set and reached);
        True uses llguidance's LLExecutor pool. Each matcher may appear only once.
        """
        self.wait()
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.n_words:
            raise ValueError(f"bitmask must be int32 [n, {self.n_words}], got "
                             f"{bitmask.dtype} {list(bitmask.shape)}")
        if not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be C-contiguous")
        idx = range(len(matchers)) if rows is None else rows
        pairs = [(m.llg, int(r)) for m, r in zip(matchers, idx) if m is not None]
        keyed = [(m.keys, int(r)) for m, r in zip(matchers, idx) if m is not None and m.keys is not None]
        if not pairs:
            return
        n = bitmask.shape[0]
        for _, r in pairs:
            if not 0 <= r < n:
                raise IndexError(f"mask row {r} outside the bitmask's {n} rows")
        if parallel is None:
            parallel = 0 < PARALLEL_MIN_BATCH <= len(pairs)
        if parallel and len(pairs) > 1:
            assert self._executor is not None
            llg_np.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        else:
            nbytes = self.n_words * 4
            base = bitmask.ctypes.data
            for m, r in pairs:
                m.unsafe_compute_mask_ptr(base + r * nbytes, nbytes)
        self.add_eog(bitmask, np.fromiter((r for _, r in pairs), dtype=np.intp, count=len(pairs)))
        for keys, r in keyed:  # no repeated key (json_keys.py), beside llguidance's mask
            keys.ban(bitmask[r])

    def add_eog(self, bitmask: np.ndarray, rows: np.ndarray) -> None:
        u = bitmask.view(np.uint32)
        done = rows[(u[rows, self._eos_word] >> np.uint32(self._eos_bit)) & np.uint32(1) != 0]
        if done.size:
            for w, bits in zip(self._eog_words, self._eog_bits):
                u[done, w] |= bits


def _text_bytes(c: "CompiledGrammar") -> int:
    return len(c.source) + len(c.grammar)
