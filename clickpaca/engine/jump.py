"""Jump-forward: the tokens a grammar forces, found right after a sampled token.

Where a grammar allows one token only (a JSON schema's keys, quotes, colons, braces),
token-by-token generation spends a whole decode tick and a pass through the sampler on
a token the sampler cannot but draw. With `jumpForward` the infer job (jobs.py) asks
`forced_run` for those tokens as soon as it has accepted a sampled one; they join that
token's next decode as one chunk of its sequence (plan.py), as a prompt's chunk does.

A token joins the run only where token-by-token generation would draw it: llguidance
proposes it (`Matcher.forced_tokens`, its fast-forward tokens), and the mask made from
the matcher's state (EOG bits and the repeated-key ban included, grammar/json_keys.py)
allows exactly that one token, which no `logit_bias` bans and which is no EOG token. The
run stops at the first token that fails one of these; the next tick then samples there
as token-by-token would (a ban that leaves nothing still ends with `repeated_key`).

The random stream: a sampler draws exactly one uniform per sampled token (chain.py), so
each forced token takes one draw when it is emitted, and the first free token after the
run draws the same number it would have drawn token by token. Where the chain has a
stateful step (mirostat learns every drawn token) or the request asks for log-
probabilities or a trace, the sampler runs on the forced token's own logits row of the
chunk with its mask instead, which draws that uniform itself and makes the same state,
log-probabilities and trace as the token's own tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..sampling import BAN, SamplerParams
from ..sampling import registry as R
from ..sampling import usersteps


@dataclass(slots=True)
class Forced:
    """One token of a forced run."""

    token: int
    mask: np.ndarray | None  # its mask row, kept when the sampler runs on its row
    stopped: bool  # the grammar is stopped once it is consumed (the request ends there)


def user_steps(params: SamplerParams) -> list[str]:
    """The user-defined steps (`serve --steps`) the chain runs: a forced run is not
    offered to them (what such a step does with a one-token set is unknown)."""
    return [s.name for s in R.active(params, True) if getattr(s.run, "__module__", None) == usersteps.__name__]


def pairs(deterministic: bool, grammar) -> bool:
    """Whether a request's generated tokens are each decoded beside the token before it
    (engine/plan.py): in deterministic mode, where it has a grammar. Its rows then take a
    prompt's kernels, so its output is the same bits whether the grammar's forced tokens
    come in chunks (`jumpForward`) or one a tick. It doubles the rows a generated token
    costs (docs/DETERMINISM.md, "Cost"), so a request without a grammar, which never has
    a forced chunk, keeps one row."""
    return deterministic and grammar is not None


def needs_rows(params: SamplerParams) -> bool:
    """True when the sampler must run on each forced token's own row: log-probabilities
    or a trace are asked for, or a stateful step would learn the token."""
    return params.n_probs > 0 or bool(params.trace) or any(s.stateful for s in R.active(params, True))


def only_token(row: np.ndarray) -> int | None:
    """The one token a mask row (int32 words) allows, None if it allows none or several."""
    nz = np.flatnonzero(row)
    if nz.size != 1:
        return None
    w = int(row[nz[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(nz[0]) * 32 + w.bit_length() - 1


def forced_run(matcher, params: SamplerParams, limit: int, is_eog: Callable[[int], bool],
               keep_masks: bool) -> list[Forced]:
    """Consume into `matcher` the tokens its grammar forces next, at most `limit`, each
    one checked against the mask token-by-token generation would sample with (module
    doc); their list."""
    run: list[Forced] = []
    ids, bias = params.bias_arrays
    banned = set(ids[bias <= BAN].tolist()) if ids.size else set()
    while len(run) < limit:
        proposed = matcher.forced_tokens()
        if not proposed:
            break
        for t in proposed:
            if len(run) >= limit:
                break
            acted = matcher.keys.acted if matcher.keys is not None else 0
            mask = matcher.mask()
            if only_token(mask) != t or t in banned or is_eog(t):
                if matcher.keys is not None:  # the next tick makes this mask again and counts it then
                    matcher.keys.acted = acted
                return run
            if not matcher.consume(t):
                raise RuntimeError(f"grammar rejected forced token {t} (matcher: {matcher.error()})")
            run.append(Forced(t, mask if keep_masks else None, matcher.is_stopped()))
            if run[-1].stopped:
                return run
    return run
