"""The built-in sampler steps: one registry row each (``registry`` says what a row holds).

Each row names the step, its kind and wire parameters (checks, defaults, misspellings,
meaning), when it is an identity for the given params (the chain skips it then), when
it truncates, how it runs from the params (``steps`` holds the definitions), which
tokens it touches when elementwise, how the chain finds a superset of what it keeps
without scanning the row when it is the first truncation, and what an empty candidate
set after it means, whether it reads state shared between sequences (``shared_state``:
DRY, through the vocabulary), whether it keeps a one-token set (``keeps_one``), and its
form in the batched passes (``batched``: keep k, keep a mass share, divide, or touch a
few ids, with the touched form's arithmetic in ``steps`` beside the scalar one; which
passes a chain of forms takes is forms.py's one decision). Adding a step is one
definition in ``steps`` and one ``register(Step(...))`` here (or anywhere: see
``registry``). The rows live in the registry only: read them with
``registry.steps()`` / ``registry.by_name()``; the names bound here (``TEMPERATURE``, ...)
are the rows other modules refer to by identity.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from . import dry as D
from . import steps as S
from .bitmask import allows
from .candidates import dense_exp, gather
from .cut import RowView, isin_sorted, upper_ids
from .registry import (CONSTRAINT, DIVIDE, ELEMENTWISE, GENERAL, KEEP_K, KEEP_MASS, SCALE, TOUCH, TRUNCATION,
                       Batched, Param, SamplerParamError, Step, aliases, choice_strings, integer, is_int,
                       is_real, real, register, register_chain_param, show, to_float)
from . import registry as R

if TYPE_CHECKING:
    from .params import SamplerParams

__all__ = ["Step", "LOGIT_BIAS", "TEMPERATURE", "XTC", "MIROSTAT", "MIROSTAT_V2", "MIN_TEMPERATURE", "N_PROBS_MAX",
           "CONSTRAINT", "ELEMENTWISE", "TRUNCATION", "SCALE", "GENERAL"]

#: (view, params, tau, words, frac, touched, touched logits) -> (ids, rest_mass)
Cut = Callable[[RowView, "SamplerParams", float, "np.ndarray | None", float, np.ndarray, np.ndarray],
               tuple[np.ndarray, float]]


# ------------------------------------------------------------------ parameter checks of their own


def _norm_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    """Accept the protocol's list of {"token": id, "bias": x} objects, {id: bias} (ids may
    be decimal strings, as JSON object keys are) or a list of [id, bias] pairs; return
    sorted (id, bias) pairs. Duplicates are an error rather than silently summed or
    overwritten."""
    if v is None:
        return ()
    if isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, (list, tuple)):
        items = []
        for pair in v:
            if isinstance(pair, Mapping):
                if set(pair) != {"token", "bias"}:
                    raise SamplerParamError(name, f"entries must be {{\"token\": id, \"bias\": x}}, got {show(pair)}")
                items.append((pair["token"], pair["bias"]))
                continue
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SamplerParamError(name, f"list entries must be [tokenId, bias] pairs, got {show(pair)}")
            items.append((pair[0], pair[1]))
    else:
        raise SamplerParamError(name, f"must be an object {{tokenId: bias}} or a list of [tokenId, bias], got {type(v).__name__}")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str):
            s = key.strip()
            if not (s.isascii() and s.isdigit()) or len(s) > 12:  # (int() refuses 4,300 digits)
                raise SamplerParamError(name, f"token id must be a non-negative integer of at most 12 digits, "
                                              f"got {show(key)}")
            tok = int(s)
        elif is_int(key):
            tok = int(key)
        else:
            raise SamplerParamError(name, f"token id must be an integer, got {show(key)}")
        if tok < 0:
            raise SamplerParamError(name, f"token id must be >= 0, got {tok}")
        if not is_real(bias):
            raise SamplerParamError(name, f"bias for token {tok} must be a number, got {show(bias)}")
        b = to_float(bias)
        if math.isnan(b):
            raise SamplerParamError(name, f"bias for token {tok} must not be NaN")
        if tok in out:
            raise SamplerParamError(name, f"token {tok} given more than once")
        out[tok] = b
    return tuple(sorted(out.items()))



def _norm_samplers(name: str, v: Any) -> tuple[str, ...]:
    """A list of step names (or aliases), each at most once, the grammar only first;
    None (the default) is every registered step in the default order."""
    if v is None:
        return tuple(s.name for s in R.steps())
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise SamplerParamError(name, f"must be a list of step names, got {show(v)}")
    known = aliases()
    out = []
    if v and v[-1] == "sample":  # the draw itself: always the chain's end, accepted there
        v = v[:-1]
    for s in v:
        canon = known.get(s) if isinstance(s, str) else None
        if canon is None:
            where = " ('sample' is the fixed last step: only there)" if s == "sample" else ""
            raise SamplerParamError(name, f"unknown step {show(s)}{where}; known: "
                                    f"{', '.join(x.name for x in R.steps())}")
        if canon in out:
            raise SamplerParamError(name, f"step {show(canon)} listed more than once")
        out.append(canon)
    if "grammar" in out and out[0] != "grammar":
        raise SamplerParamError(name, "'grammar' must come first: the grammar is always applied before every other step")
    return tuple(out)


#: Below this a positive temperature is greedy (0): dividing logits by it overflows
#: float32 (|logit + bias| up to 1e18 / 1e-20 stays under 3.4e38), and greedy is its limit.
MIN_TEMPERATURE = 1e-20
_real_temperature = real()


def _temperature(name: str, v: Any) -> float:
    """A finite real; a positive one below MIN_TEMPERATURE is greedy (0)."""
    x = _real_temperature(name, v)
    return 0.0 if 0 < x < MIN_TEMPERATURE else x


_temperature.range = _real_temperature.range  # for the docs table


def _seed(name: str, v: Any) -> int | None:
    return None if v is None else integer(0)(name, v)


# ------------------------------------------------------------------ cuts (first truncation)


def _upper_k(k: int) -> Cut:
    """Any k-truncation: the upper set of at least k raw tokens."""
    def cut(view, p, tau, words, frac, touched, t_logits):
        return upper_ids(view, k(p), words, frac, touched), 0.0
    return cut


def _largest(view: RowView, tau: float, words, frac: float, touched: np.ndarray,
             t_logits: np.ndarray) -> float:
    """The largest candidate logit: the best allowed untouched raw token (over tau) or a
    touched one (-inf when there is none)."""
    top = upper_ids(view, 1, words, frac, touched)
    best = float(gather(view.row, top, tau).max()) if top.size else -math.inf
    return max(best, float(t_logits.max())) if t_logits.size else best


def _allowed_ge(view: RowView, t: float, words, touched: np.ndarray) -> np.ndarray:
    """ids of the allowed raw tokens outside ``touched`` with row[i] >= t."""
    ids = view.ge(t)
    if words is not None:
        ids = ids[allows(words, ids)]
    if touched.size:
        ids = ids[~isin_sorted(ids, touched)]
    return ids


def _min_p_cut(view: RowView, p: "SamplerParams", tau: float, words, frac: float,
               touched: np.ndarray, t_logits: np.ndarray) -> tuple[np.ndarray, float]:
    """Every raw token within log(min_p) of the largest candidate logit."""
    vmax = _largest(view, tau, words, frac, touched, t_logits)
    if not vmax > -math.inf:
        return upper_ids(view, view.n, words, frac, touched), 0.0
    t = (vmax + math.log(p.min_p)) * tau
    t -= (abs(t) + 1.0) * 1e-6  # a slightly larger superset absorbs rounding
    return _allowed_ge(view, t, words, touched), 0.0


def _nucleus_cut(view: RowView, p: "SamplerParams", tau: float, words, frac: float,
                 touched: np.ndarray, t_logits: np.ndarray) -> tuple[np.ndarray, float]:
    """Untouched allowed tokens that, with the touched ones, form a superset of the
    nucleus, and the mass of the allowed untouched tokens left out. One exp pass."""
    ref = _largest(view, tau, words, frac, touched, t_logits)
    if not ref > -math.inf:
        return upper_ids(view, view.n, words, frac, touched), 0.0
    buf, z_out = dense_exp(view, tau, words, touched, ref)
    t_e = np.exp(t_logits - ref)
    target = float(S.top_p_target(t_e, p.top_p, z_out)) * (1 + 1e-5)  # the step's target, with room
    for delta in (6.0, 12.0, 24.0, 48.0):
        t_v = ref - delta
        ids = _allowed_ge(view, t_v * tau, words, touched)
        mass = float(np.add.reduce(buf[ids], dtype=np.float64))
        if mass + float(t_e[t_logits >= t_v].sum()) >= target:
            return ids, max(z_out - mass, 0.0)
    return upper_ids(view, view.n, words, frac, touched), 0.0


# ------------------------------------------------------------------ the rows

register(Step("grammar", CONSTRAINT, run=None, off=lambda p, has_hist: True,
              empty="the grammar allows no token"))
LOGIT_BIAS = register(Step(
    "logit_bias", ELEMENTWISE, alias="logitBias",
    params=(Param("logit_bias", "logit_bias", (), _norm_bias, ("logitBias",),
                  "list of `{\"token\": id, \"bias\": x}`; `-1e9` bans, `+1e9` forces", shown="none"),),
    run=lambda ids, logits, p, ctx: S.logit_bias(ids, logits, *p.bias_arrays),
    off=lambda p, has_hist: not p.logit_bias,
    touches=lambda p, ctx: p.bias_arrays[0],
    empty="logit_bias bans every token still allowed", preselected=True,
    batched=Batched(TOUCH, touch=lambda v, ids, rows, m, p, counts: S.logit_bias_touched(v, ids, rows, m,
                                                                                         *p.bias_arrays),
                    carries=lambda p: not bool((p.bias_arrays[1] >= S.FORCE).any()))))
PENALTIES = register(Step(
    "penalties", ELEMENTWISE,
    params=(Param("penalty_repeat", "penaltyRepeat", 1.0, real(0.0, None, lo_open=True),
                  ("repeat_penalty", "penalty_repeat"),
                  "llama.cpp semantics: a positive logit is divided by it, a negative one multiplied"),
            Param("penalty_freq", "penaltyFreq", 0.0, real(), ("frequency_penalty", "penalty_freq"),
                  "subtracted once per occurrence"),
            Param("penalty_present", "penaltyPresent", 0.0, real(), ("presence_penalty", "penalty_present"),
                  "subtracted once if present"),
            Param("penalty_last_n", "penaltyLastN", 64, integer(-1), ("repeat_last_n", "penalty_last_n"),
                  "how many of the latest context tokens (prompt included) the penalties look at; "
                  "-1 = whole context, 0 = off")),
    run=lambda ids, logits, p, ctx: S.penalties(ids, logits, *ctx.hist, p.penalty_repeat,
                                                p.penalty_freq, p.penalty_present),
    off=lambda p, has_hist: not has_hist or not p.penalties_active,
    touches=lambda p, ctx: ctx.hist[0], preselected=True,
    batched=Batched(TOUCH, counts=True,
                    touch=lambda v, ids, rows, m, p, counts: S.penalties_touched(
                        v, counts, p.penalty_repeat, p.penalty_freq, p.penalty_present))))
register(Step(
    "dry", ELEMENTWISE,
    params=(Param("dry_multiplier", "dryMultiplier", 0.0, real(0.0), ("dry_multiplier",),
                  "DRY: penalty multiplier; 0 = off"),
            Param("dry_base", "dryBase", 1.75, real(1.0), ("dry_base",),
                  "DRY: the penalty grows as base^(repeat length - allowed length)"),
            Param("dry_allowed_length", "dryAllowedLength", 2, integer(0), ("dry_allowed_length",),
                  "DRY: repetitions up to this length are not penalised"),
            Param("dry_penalty_last_n", "dryPenaltyLastN", -1, integer(-1), ("dry_penalty_last_n",),
                  "DRY: how many of the latest context tokens (prompt included) it scans; -1 = whole "
                  "context, 0 = off"),
            Param("dry_sequence_breakers", "drySequenceBreakers", ("\n", ":", "\"", "*"),
                  choice_strings(D.MAX_BREAKERS, D.MAX_BREAKER_CHARS), ("dry_sequence_breakers",),
                  "DRY: strings (at most 64, each 1-40 characters) no repetition reaches across",
                  shown='`["\\n", ":", "\\"", "*"]`')),
    run=lambda ids, logits, p, ctx: D.apply(ids, logits, *D.penalties_for(p, ctx)),
    off=lambda p, has_hist: p.dry_multiplier == 0 or p.dry_penalty_last_n == 0,
    touches=lambda p, ctx: D.penalties_for(p, ctx)[0],
    shared_state=True))  # the vocabulary's memo (breakers) and dry's one-call memo
register(Step(
    "top_n_sigma", TRUNCATION, alias="topNSigma",
    params=(Param("top_n_sigma", "topNSigma", -1.0, real(), ("top_n_sigma",),
                  "keep logits >= max - n * std of the candidates' logits; <= 0 = off"),),
    run=lambda ids, logits, p, ctx: S.top_n_sigma(ids, logits, p.top_n_sigma),
    off=lambda p, has_hist: p.top_n_sigma <= 0,
    truncates=lambda p, n_allowed: p.top_n_sigma > 0, keeps_one=True))
register(Step(
    "top_k", TRUNCATION, alias="topK",
    params=(Param("top_k", "topK", 40, integer(0), ("top_k",), "1 = greedy, 0 = off"),),
    run=lambda ids, logits, p, ctx: S.top_k(ids, logits, p.top_k),
    off=lambda p, has_hist: p.top_k <= 0,
    truncates=lambda p, n_allowed: 0 < p.top_k < n_allowed,
    cut=_upper_k(lambda p: p.top_k), keeps_one=True, preselected=True,
    batched=Batched(KEEP_K, value=lambda p: p.top_k)))
register(Step(
    "typical_p", GENERAL, alias="typicalP",
    params=(Param("typical_p", "typicalP", 1.0, real(0.0, 1.0), ("typical_p", "typ_p"),
                  "locally typical sampling: keep the tokens closest to the entropy up to this mass; "
                  "1 = off"),),
    run=lambda ids, logits, p, ctx: S.typical_p(ids, logits, p.typical_p),
    off=lambda p, has_hist: p.typical_p >= 1,
    truncates=lambda p, n_allowed: p.typical_p < 1))
register(Step(
    "min_p", TRUNCATION, alias="minP",
    params=(Param("min_p", "minP", 0.0, real(0.0, 1.0), ("min_p",), "0 = off"),),
    run=lambda ids, logits, p, ctx: S.min_p(ids, logits, p.min_p),
    off=lambda p, has_hist: p.min_p <= 0,
    truncates=lambda p, n_allowed: p.min_p > 0,
    cut=_min_p_cut, keeps_one=True, preselected=True))
register(Step(
    "top_p", TRUNCATION, alias="topP",
    params=(Param("top_p", "topP", 0.95, real(0.0, 1.0), ("top_p",), "1 = off"),),
    run=lambda ids, logits, p, ctx: S.top_p(ids, logits, p.top_p, ctx.rest_mass),
    off=lambda p, has_hist: p.top_p >= 1,
    truncates=lambda p, n_allowed: p.top_p < 1,
    cut=_nucleus_cut, keeps_one=True, preselected=True,
    batched=Batched(KEEP_MASS, value=lambda p: p.top_p)))
XTC = register(Step(
    "xtc", GENERAL,
    params=(Param("xtc_probability", "xtcProbability", 0.0, real(0.0, 1.0), ("xtc_probability",),
                  "XTC: the chance, per token, that it runs; 0 = off"),
            Param("xtc_threshold", "xtcThreshold", 0.1, real(0.0, 1.0), ("xtc_threshold",),
                  "XTC: it removes every token at or above this probability but the least likely "
                  "of them; > 0.5 = off")),
    run=lambda ids, logits, p, ctx: S.xtc(ids, logits, p.xtc_probability, p.xtc_threshold,
                                          ctx.uniform(XTC) if ids.size >= 2 else None),
    off=lambda p, has_hist: p.xtc_probability <= 0 or p.xtc_threshold > 0.5,
    truncates=lambda p, n_allowed: p.xtc_probability > 0 and p.xtc_threshold <= 0.5))
TEMPERATURE = register(Step(
    "temperature", SCALE, alias="temp",
    params=(Param("temperature", "temperature", 0.7, _temperature, ("temp",),
                  "<= 0 is greedy; so is a positive value below 1e-20 (dividing the logits by it would "
                  "overflow; greedy is its limit); with `dynatempRange` the middle of the dynamic range"),),
    # with dynatempRange > 0 the dynatemp step applies the temperature instead
    run=lambda ids, logits, p, ctx: (S.temperature(ids, logits, p.temperature) if p.dynatemp_range <= 0
                                     else (ids, logits)),
    off=lambda p, has_hist: p.temperature == 1.0 or p.dynatemp_range > 0,
    truncates=lambda p, n_allowed: p.temperature <= 0,
    cut=_upper_k(lambda p: 1), keeps_one=True, preselected=True,  # greedy: the canonical first candidate
    batched=Batched(DIVIDE, value=lambda p: p.temperature)))
register(Step(
    "dynatemp", GENERAL, alias="dynaTemp",
    params=(Param("dynatemp_range", "dynatempRange", 0.0, real(0.0), ("dynatemp_range",),
                  "dynamic temperature: when > 0, the temperature step is replaced by one between "
                  "temperature -+ range, higher for a flatter distribution"),
            Param("dynatemp_exponent", "dynatempExponent", 1.0, real(0.0), ("dynatemp_exponent",),
                  "dynamic temperature: the exponent on the normalised entropy")),
    run=lambda ids, logits, p, ctx: (S.dynatemp(ids, logits, p.temperature, p.dynatemp_range,
                                                p.dynatemp_exponent) if p.dynatemp_range > 0 else (ids, logits)),
    off=lambda p, has_hist: p.dynatemp_range <= 0,
    truncates=lambda p, n_allowed: p.temperature - p.dynatemp_range <= 0))  # may reach greedy


def _mirostat_run(version: int):
    def run(ids, logits, p, ctx):
        if p.mirostat != version:
            return ids, logits
        st = ctx.state(MIROSTAT if version == 1 else MIROSTAT_V2, p)
        if version == 1:
            ids, logits = S.mirostat(ids, logits, st["mu"], 100, ctx.n_vocab or ids.size)
        else:
            ids, logits = S.mirostat_v2(ids, logits, st["mu"])
        st["last"] = (ids, logits)
        return ids, logits
    return run


def _mirostat_sampled(st: dict, token: int, p) -> None:
    """mu -= eta * (surprise of the drawn token under mirostat's output - tau)."""
    ids, logits = st.pop("last")
    s = S.surprise(ids, logits, token)
    if math.isfinite(s):
        st["mu"] -= p.mirostat_eta * (s - p.mirostat_tau)


MIROSTAT = register(Step(
    "mirostat", TRUNCATION,
    params=(Param("mirostat", "mirostat", 0, integer(0, 2), (),
                  "1 = mirostat 1.0, 2 = mirostat 2.0 (the steps `mirostat`, `mirostat_v2`); 0 = off"),
            Param("mirostat_tau", "mirostatTau", 5.0, real(0.0), ("mirostat_tau",),
                  "mirostat: target surprise (bits); mu starts at 2 tau"),
            Param("mirostat_eta", "mirostatEta", 0.1, real(0.0), ("mirostat_eta",),
                  "mirostat: learning rate of mu")),
    run=_mirostat_run(1), off=lambda p, has_hist: p.mirostat != 1,
    truncates=lambda p, n_allowed: True,
    state=lambda p: {"mu": 2.0 * p.mirostat_tau}, sampled=_mirostat_sampled))
MIROSTAT_V2 = register(Step(
    "mirostat_v2", TRUNCATION, alias="mirostatV2",
    run=_mirostat_run(2), off=lambda p, has_hist: p.mirostat != 2,
    truncates=lambda p, n_allowed: True,
    state=lambda p: {"mu": 2.0 * p.mirostat_tau}, sampled=_mirostat_sampled))

register_chain_param(Param("seed", "seed", None, _seed, (), "per-sequence RNG seed: same seed + same input = same output",
                           shown="random"))
#: nProbs: the log-probabilities of at most this many tokens in each token event (the
#: bound's one definition and, in its row's check, its one check).
N_PROBS_MAX = 100
register_chain_param(Param("n_probs", "nProbs", 0, integer(0, N_PROBS_MAX), ("n_probs",),
                           f"when > 0 (<= {N_PROBS_MAX}), token events carry log-probabilities (below)"))
register_chain_param(Param("samplers", "samplers", None, _norm_samplers, (), "order of the steps (below)",
                           shown="full chain"))
register_chain_param(Param("trace", "trace", False, R.boolean, (),
                           "token events carry what every step did (below); costs a few full-row passes per step"))
