"""Per-sequence sampler chains in pure numpy (no model needed).

    params = SamplerParams.from_request(request)  # checks every field (names it on error)
    sampler = SequenceSampler(params, V, prompt_tokens)  # and the vocabulary-dependent bounds
    result = sampler.sample(logits_row, grammar_bitmask_or_None)
    if result.empty: end the sequence with result.reason
    sampler.accept(result.token)

Order (``params.samplers`` may reorder or drop all but the grammar, which runs first):
grammar -> logit bias -> repetition penalties -> DRY -> top-n-sigma -> top-k ->
typical-p -> min-p -> top-p -> XTC -> temperature -> dynamic temperature -> mirostat
1.0 / 2.0 -> sample (llama.cpp's steps off unless asked for). ``registry`` holds one row
per step (its wire parameters, kind, state, superset hook, shared state, keep-one, batched
form; how to add a step), ``forms`` which batched passes a chain's forms add up to,
``table`` the built-in rows, ``params`` the frozen SamplerParams derived from the rows,
``steps`` and ``dry`` the definitions, ``cut`` the exact shortcuts,
``bitmask`` the grammar's allowed-token words, ``candidates`` a candidate set (explicit
or implicit) and its draw, ``chain`` the composition and per-sequence state, ``trace`` what each step
did to a token, ``oracle`` llama.cpp's C samplers through the bindings (tests, bench),
``vocab`` token text for steps that need it, ``batch`` one tick's rows at once (exactly
what per-sequence ``sample`` calls give), ``workers`` the threads it may spread them
over, ``route`` which path samples a row and the typed reasons a row takes the host
path, ``fastpath`` the chain on the values the decode pre-selected (llama/presample/),
``fastpath_touched`` and ``fastpath_dense`` its batched rows with logit bias and penalties
and its draws over the whole set,
``bench`` the microbenchmark, ``usersteps`` steps written by the user (`serve --steps`).
"""

from .chain import Candidates, SampleResult, SequenceSampler, apply_chain
from .params import BAN, FORCE, SamplerParamError, SamplerParams, protocol_names, step_names

__all__ = [
    "BAN", "FORCE", "step_names", "protocol_names",
    "SamplerParamError", "SamplerParams", "SequenceSampler", "SampleResult", "Candidates",
    "apply_chain",
]
