"""Grammar text -> per-sequence matchers -> token masks for a whole batch (llguidance).

One `GrammarEngine` per loaded model holds llguidance's tokenizer, built once from the
model's own vocabulary and `llama_tokenize` in a background thread (`start`; `compile` waits
for it). `compile` detects the format from the text's first characters (``%llguidance``
Lark, ``%json_schema`` JSON schema, otherwise GBNF through gbnf.py), validates completely
(llguidance does not raise on a bad grammar, so its matcher and first mask are checked here)
and raises `GrammarError` with llguidance's message, or returns a cached `CompiledGrammar`.
JSON schemas get fixed separators and no free whitespace (`JSON_OVERRIDES`, `JSON_DEFAULTS`),
keywords llguidance lacks are rewritten where that is exact (schema_rewrite.py), what it
would not enforce is listed in `CompiledGrammar.ignored`, and no object repeats a key
(json_keys.py: a ban applied beside llguidance's mask).
`fill_masks` computes a tick's mask rows (int32 words, bit j of word i = token 32*i+j),
serially by default; the scheduler runs it during the decode (engine/mask_ahead.py).
docs/GRAMMARS.md, "How a grammar is compiled and masked", has the details and the costs.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import numpy as np

import llguidance.numpy as llg_np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from .gbnf import gbnf_to_lark
from .json_keys import KeyIndex, KeyTracker
from ..sampling import bitmask
from .json_schema import NUMBER_DIGITS, bound_numbers
from .schema_check import SchemaCheck
from .schema_coverage import (Ignored, approximated_one_ofs, coverage, pointer, strip,
                              unsupported_property_counts)
from .schema_rewrite import rewrite

__all__ = [
    "GrammarError", "GrammarEngine", "CompiledGrammar", "Matcher", "fill_masks",
    "allowed_ids", "is_allowed", "detect_format", "gbnf_to_lark", "JSON_DEFAULTS", "JSON_OVERRIDES",
]

#: Applied before a schema's own "x-guidance" options: fixed, json.dumps-like separators.
JSON_DEFAULTS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": "}
#: Applied after them: no free whitespace between JSON tokens, whatever the schema says.
JSON_OVERRIDES: dict[str, Any] = {"whitespace_flexible": False, "whitespace_pattern": None}

#: From this many sequences per tick up, masks are computed on llguidance's thread pool;
#: 0 (the default) = never. Measured on the 2-core machine, the pool lost at every batch
#: size (1, 8, 64): see the module doc. $CLICKPACA_GRAMMAR_PAR_MIN changes it.
PARALLEL_MIN_BATCH = int(os.environ.get("CLICKPACA_GRAMMAR_PAR_MIN", "0"))
#: Set CLICKPACA_KEY_BAN=0 to let JSON objects repeat keys again (json_keys.py), for comparison.
KEY_BAN = os.environ.get("CLICKPACA_KEY_BAN", "1") != "0"

# Limits checked before llguidance sees a grammar. llguidance compiles recursively along
# chains of rule references: on an 8 MiB stack a GBNF chain of 4,000 rules
# (`rI ::= "xI" rI+1 | "y"`) or a JSON schema chain of 1,000 `$ref`s overflows the stack
# and kills the process (SIGSEGV). Compilation therefore runs on its own thread with a
# COMPILE_STACK_MB stack, and the limits keep every grammar far inside what that stack
# holds and what compiles in reasonable time (3,000 chained rules took 8.7 s):
# MAX_GRAMMAR_BYTES, the text size (memory: ~65 MiB per MB of grammar was measured), is
# the protocol's, defined and checked there once: the edge refuses a longer grammar field
# before it reaches here.
MAX_GRAMMAR_RULES = 1000       # GBNF rules, Lark rules/terminals, JSON-schema subschemas
MAX_GRAMMAR_NESTING = 64       # brackets in one rule; objects/arrays in a JSON schema
COMPILE_STACK_MB = 256         # 4,000 chained rules and 1,000 $refs compile on 64 MiB
LARK_HEADER = "%llguidance"
JSON_SCHEMA_HEADER = "%json_schema"


class GrammarError(ValueError):
    """A grammar (GBNF, Lark or JSON schema) was rejected; the message says why."""

    def __init__(self, message: str, format: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.format = format


def detect_format(text: str) -> str:
    """'lark' (starts with %llguidance), 'json_schema' (starts with %json_schema) or 'gbnf'."""
    head = text.lstrip()
    if head.startswith(JSON_SCHEMA_HEADER):
        return "json_schema"
    if head.startswith(LARK_HEADER):
        return "lark"
    return "gbnf"


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


# ---------------------------------------------------------------------------- engine


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
        return _on_big_stack(self._compile_checked, text, fmt, lenient, number_digits, strict)

    def _compile_checked(self, text: str, fmt: str, lenient: bool,
                         number_digits: int | None, strict: bool) -> "CompiledGrammar":
        grammar, schema, ignored = self._to_llguidance(text, fmt, lenient, number_digits, strict)
        name = _FORMAT_NAMES[fmt]
        tok = self.tokenizer
        # Never raises for grammar errors: the matcher enters an error state instead.
        matcher = LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {name}: {_short(matcher.get_error())}", fmt)
        # Some problems (lexer/parser limits) only show when the first mask is computed.
        scratch = np.zeros(self.n_words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            raise GrammarError(f"invalid {name}: {_short(matcher.get_error())}", fmt)
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
            return LLMatcher.grammar_from_lark(_lark_header_options(text)), None, []
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
                    given, defaults=JSON_DEFAULTS, overrides=_schema_overrides(strict)), schema, ignored
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
        pairs = [(m._m, int(r)) for m, r in zip(matchers, idx) if m is not None]
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
        self._add_eog(bitmask, np.fromiter((r for _, r in pairs), dtype=np.intp, count=len(pairs)))
        for keys, r in keyed:  # no repeated key (json_keys.py), beside llguidance's mask
            keys.ban(bitmask[r])

    def _add_eog(self, bitmask: np.ndarray, rows: np.ndarray) -> None:
        u = bitmask.view(np.uint32)
        done = rows[(u[rows, self._eos_word] >> np.uint32(self._eos_bit)) & np.uint32(1) != 0]
        if done.size:
            for w, bits in zip(self._eog_words, self._eog_bits):
                u[done, w] |= bits


def _schema_overrides(strict: bool) -> dict:
    """llguidance's options for a schema: never its own lenient (the keywords to ignore are
    removed beforehand, so a keyword the walk missed is refused, not dropped silently);
    oneOf approximated unless strict."""
    return {**JSON_OVERRIDES, "lenient": False, "coerce_one_of": not strict}


def schema_for_llguidance(schema: dict, lenient: bool = False, strict: bool = False,
                          number_digits: int | None = NUMBER_DIGITS) -> tuple[dict, list[Ignored]]:
    """The schema llguidance is to compile, and what it will not enforce (sorted by path):

    - the keywords with an exact rewrite into what llguidance implements are rewritten
      (schema_rewrite.py), unless llguidance then refuses the schema for another reason
      (an allOf it cannot intersect): it is then prepared as written;
    - unknown formats (annotations, JSON Schema says) are removed, unless `strict`;
    - with `lenient`, the keywords llguidance does not implement are removed, and so are
      the minProperties/maxProperties it cannot compile where they stand;
    - typed numbers are bounded (json_schema.py);
    - unless `strict`, the oneOfs llguidance will compile as anyOf are listed.
    A `strict` schema is handed over whole (rewritten): llguidance refuses what it cannot
    enforce. Listed paths are the client's, also inside rewritten subschemas."""
    rewritten = rewrite(schema)
    if strict:
        given = rewritten.schema
        return (bound_numbers(given, number_digits) if number_digits is not None else given), []
    if rewritten.keywords:
        given, drop = _prepared(rewritten.schema, lenient, number_digits)
        err = _refusal(given, True)
        if err is None or err.startswith("Unimplemented keys"):
            return given, sorted((Ignored(pointer(rewritten.original_path(i.at)), i.keyword, i.reason, i.at)
                                  for i in drop), key=lambda i: (i.path, i.keyword))
    return _prepared(schema, lenient, number_digits)


def _prepared(schema: dict, lenient: bool, number_digits: int | None) -> tuple[dict, list[Ignored]]:
    """`schema_for_llguidance` after the rewrites, not strict."""
    cov = coverage(schema)
    drop = cov.formats + (cov.unimplemented if lenient else [])
    given = strip(schema, drop) if drop else schema
    if number_digits is not None:
        given = bound_numbers(given, number_digits)
    if lenient and cov.property_counts:
        counts = unsupported_property_counts(given, cov.property_counts, lambda s: _refusal(s, True))
        if counts:
            drop += counts
            given = strip(given, counts)
    if cov.one_ofs:
        drop += approximated_one_ofs(given, cov.one_ofs, _refusal)
    return given, sorted(drop, key=lambda i: (i.path, i.keyword))


def _refusal(schema: dict, coerce_one_of: bool = False) -> str | None:
    """llguidance's error for the schema (oneOf approximated or not), or None."""
    grammar = LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_DEFAULTS, overrides={**_schema_overrides(not coerce_one_of)})
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else None


_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?[0-9]+)?[ \t]*:", re.M)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.M)


def _bracket_depth(text: str, fmt: str) -> int:
    """Deepest nesting of groups outside literals (a linear scan, no recursion).

    Literals skipped: quoted strings, GBNF character classes [...], Lark regexes /.../.
    """
    closing = {'"': '"', "'": "'"}
    if fmt == "gbnf":
        closing["["] = "]"
    else:
        closing["/"] = "/"
    depth = deepest = 0
    end = None
    escaped = False
    for ch in text:
        if end:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == end or ch == "\n":
                end = None
        elif ch in closing:
            end = closing[ch]
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == "#" and fmt == "gbnf":
            end = "\n"  # a comment
    return deepest


def check_limits(text: str, fmt: str) -> None:
    """Refuse, before compiling, a grammar beyond MAX_GRAMMAR_RULES or _NESTING (its size,
    MAX_GRAMMAR_BYTES, is the protocol's one check, at the edge)."""
    if fmt == "json_schema":
        try:
            schema = json.loads(text.lstrip()[len(JSON_SCHEMA_HEADER):])
        except (ValueError, RecursionError):
            return  # _to_llguidance reports the JSON error
        nodes, deepest, stack = 0, 0, [(schema, 1)]
        while stack:
            v, d = stack.pop()
            if isinstance(v, dict):
                nodes += 1
                v = v.values()
            elif not isinstance(v, list):
                continue
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
        if nodes > MAX_GRAMMAR_RULES:
            raise GrammarError(f"{nodes} subschemas, the limit is {MAX_GRAMMAR_RULES}", fmt)
        if deepest > MAX_GRAMMAR_NESTING:
            raise GrammarError(f"grammar: nested {deepest} levels deep, the limit is "
                               f"{MAX_GRAMMAR_NESTING}", fmt)
        return
    rules = len((_LARK_RULE if fmt == "lark" else _GBNF_RULE).findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarError(f"{rules} rules, the limit is {MAX_GRAMMAR_RULES}", fmt)
    deepest = _bracket_depth(text, fmt)
    if deepest > MAX_GRAMMAR_NESTING:
        raise GrammarError(f"grammar: brackets nested {deepest} levels deep, the limit is "
                           f"{MAX_GRAMMAR_NESTING}", fmt)


class _BigStack:
    """One daemon thread with a COMPILE_STACK_MB stack that runs compilations in turn."""

    _lock = threading.Lock()
    _jobs: "queue.Queue | None" = None

    @classmethod
    def run(cls, fn, *args):
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.Queue()
                old = threading.stack_size(COMPILE_STACK_MB << 20)
                try:
                    threading.Thread(target=cls._serve, name="grammar-compile", daemon=True).start()
                finally:
                    threading.stack_size(old)
        done = threading.Event()
        box: list = []
        cls._jobs.put((fn, args, box, done))
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    @classmethod
    def _serve(cls) -> None:
        assert cls._jobs is not None
        while True:
            fn, args, box, done = cls._jobs.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()


def _on_big_stack(fn, *args):
    """fn(*args) on the compile thread (its stack holds what the limits allow)."""
    return _BigStack.run(fn, *args)


def _lark_header_options(text: str) -> str:
    """`%llguidance` alone on its line means `%llguidance {}` (llguidance wants a JSON object)."""
    lead = len(text) - len(text.lstrip())
    end = text.find("\n", lead)
    line = text[lead:] if end < 0 else text[lead:end]
    if line.strip() == LARK_HEADER:
        return text[:lead] + LARK_HEADER + " {}" + ("" if end < 0 else text[end:])
    return text


def _short(msg: str) -> str:
    """llguidance's message without its parser-state / grammar dump."""
    return msg.split("\n<state>", 1)[0].strip()


_FORMAT_NAMES = {"lark": "lark grammar", "json_schema": "JSON schema", "gbnf": "GBNF grammar"}


# ---------------------------------------------------------------------------- grammar


def _text_bytes(c: "CompiledGrammar") -> int:
    return len(c.source) + len(c.grammar)


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

    __slots__ = ("_m", "grammar", "engine", "n_consumed", "keys")

    def __init__(self, m: LLMatcher, grammar: CompiledGrammar) -> None:
        self._m = m
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
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        eng._add_eog(row.reshape(1, -1), np.zeros(1, dtype=np.intp))
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
        ok = self._m.consume_token(int(token))
        if ok:
            self.n_consumed += 1
            if self.keys is not None:
                self.keys.push(token)
        return ok

    def consume_many(self, tokens: Iterable[int]) -> bool:
        """Advance by several tokens (e.g. forced ones); False on the first rejection."""
        toks = [int(t) for t in tokens]
        ok = self._m.consume_tokens(toks)
        if ok:
            self.n_consumed += len(toks)
            if self.keys is not None:
                for t in toks:
                    self.keys.push(t)
        return ok

    def is_accepting(self) -> bool:
        """The grammar may end here (an EOG token is allowed)."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """No further token is possible except EOG (also true in an error state)."""
        return self._m.is_stopped()

    def error(self, verbose: bool = False) -> str | None:
        """llguidance's message if the matcher is in an error state, else None.

        verbose=False cuts llguidance's parser-state dump (<state>...</grammar>).
        """
        if not self._m.is_error():
            return None
        msg = self._m.get_error()
        return msg if verbose else _short(msg)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (fast-forward), possibly empty."""
        return list(self._m.compute_ff_tokens())

    def forced_bytes(self) -> bytes:
        return bytes(self._m.compute_ff_bytes())

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
            if len(toks) == 1 and self._m.validate_tokens([int(toks[0])]) == 1:
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
        ok = self._m.rollback(int(n))
        if ok:
            self.n_consumed = max(0, self.n_consumed - int(n))
            if self.keys is not None:
                self.keys.rollback(n)
        return ok

    def fork(self) -> "Matcher":
        """An independent copy of this matcher in its current state."""
        m = Matcher(self._m.deep_copy(), self.grammar)
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

