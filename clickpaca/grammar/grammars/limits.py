"""What a grammar may hold before llguidance compiles it, and the thread it compiles on."""

from __future__ import annotations

import json
import queue
import re
import threading

from .formats import JSON_SCHEMA_HEADER, GrammarError


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


def on_big_stack(fn, *args):
    """fn(*args) on the compile thread (its stack holds what the limits allow)."""
    return _BigStack.run(fn, *args)
