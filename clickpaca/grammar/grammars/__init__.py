"""Grammar text -> per-sequence matchers -> token masks for a whole batch (llguidance).

- formats.py: which format a text is (GBNF, Lark, JSON schema), `GrammarError`;
- limits.py: rules and nesting refused before compiling, and the big-stack compile thread;
- schemas.py: a JSON schema as llguidance is to compile it, and what it leaves unenforced;
- grammar_engine.py: `GrammarEngine`: the model's llguidance tokenizer, `compile` (cached),
  a tick's mask rows (`fill_masks`);
- matcher.py: `CompiledGrammar`, one sequence's `Matcher`, reading a mask row.

This package is the grammars' one public face: callers import from here. How a grammar
is compiled and masked, and the costs: docs/GRAMMARS.md.
"""

from ..gbnf import gbnf_to_lark
from .formats import JSON_SCHEMA_HEADER, LARK_HEADER, GrammarError, detect_format
from .grammar_engine import PARALLEL_MIN_BATCH, GrammarEngine
from .limits import COMPILE_STACK_MB, MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES, check_limits
from .matcher import KEY_BAN, CompiledGrammar, Matcher, allowed_ids, fill_masks, is_allowed
from .schemas import JSON_DEFAULTS, JSON_OVERRIDES, schema_for_llguidance, schema_overrides

__all__ = [
    "GrammarError", "GrammarEngine", "CompiledGrammar", "Matcher", "fill_masks",
    "allowed_ids", "is_allowed", "detect_format", "gbnf_to_lark", "JSON_DEFAULTS", "JSON_OVERRIDES",
]
