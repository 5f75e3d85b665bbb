"""Per-sequence sampler chains in pure numpy (no model needed).

    params = SamplerParams.from_request(request)  # checks every field (names it on error)
    sampler = SequenceSampler(params, V, prompt_tokens)  # and the vocabulary-dependent bounds
    result = sampler.sample(logits_row, grammar_bitmask_or_None)
    if result.empty: end the sequence with result.reason
    sampler.accept(result.token)

Order (``params.samplers`` may reorder or drop all but the grammar, which runs first):
grammar -> logit bias -> repetition penalties -> top-k -> min-p -> top-p -> temperature
-> sample. ``steps`` holds the definitions, ``table`` one row per step (name, kind, when it
is off, how it runs and is cut short), ``cut`` the exact shortcuts, ``chain`` the
composition and per-sequence state, ``bench`` the microbenchmark.
"""

from .chain import Candidates, SampleResult, SequenceSampler, apply_chain
from .params import (BAN, DEFAULT_SAMPLERS, FORCE, PROTOCOL_NAMES, STEP_NAMES, SamplerParamError,
                     SamplerParams)

__all__ = [
    "BAN", "FORCE", "DEFAULT_SAMPLERS", "STEP_NAMES", "PROTOCOL_NAMES",
    "SamplerParamError", "SamplerParams", "SequenceSampler", "SampleResult", "Candidates",
    "apply_chain",
]
