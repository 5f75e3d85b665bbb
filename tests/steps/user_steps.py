"""User-defined sampler steps for tests/test_usersteps.py, loaded by `serve --steps`."""

import numpy as np

from clickpaca.sampling.usersteps import ELEMENTWISE, GENERAL, integer, param, real, step


def _boost_ids(p, ctx):
    return np.asarray([p.boost_token], dtype=np.int32)


@step("boost", ELEMENTWISE, params=[param("boostToken", -1, integer(-1), "the token to raise; -1 = off"),
                                   param("boostBy", 0.0, real(0, 100), "added to its logit")],
      off=lambda p, has_hist: p.boost_token < 0 or p.boost_by == 0, touches=_boost_ids)
def boost(ids, logits, p, ctx):
    """Add boostBy to one token's logit."""
    out = logits.copy()
    out[ids == p.boost_token] += p.boost_by
    return ids, out


@step("boom", GENERAL, params=[param("boomAt", 0, integer(0), "raise once the context holds this many tokens")])
def boom(ids, logits, p, ctx):
    """Raise once the context reaches boomAt tokens (0 = off)."""
    if len(ctx.history) >= p.boom_at:
        raise RuntimeError(f"the context reached {len(ctx.history)} tokens")
    return ids, logits


@step("outsider", GENERAL, params=[param("outsiderOn", 0, integer(0, 1), "1: return a token id not given")])
def outsider(ids, logits, p, ctx):
    """Return a candidate that was not among the inputs (a step must not add tokens)."""
    missing = int(np.setdiff1d(np.arange(ids.size + 1, dtype=np.int32), ids)[0])
    return np.append(ids, np.int32(missing)), np.append(logits, 0.0)
