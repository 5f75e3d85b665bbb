"""The same requests under several server configs, paired per prompt and recorded.

One server per config (cache types, builds, deterministic on or off: any `init`
fields), started one after another, so the configs never compete for the cores. Each
config's outputs are paired with the first config's (the baseline), prompt by prompt:
- first_divergence: the first position where the generated tokens differ (None when
  they are the same tokens);
- agreement: positions with the same token, over the longer of the two;
- dlogprob: the raw log-probability of the same token under both, along the common
  prefix (where both saw the same context), mean and max of |b - a|;
- margin: at the divergence, how far below the baseline's choice the baseline put the
  token the other config chose (from the baseline's `top`; None when not among them):
  a small margin is a near tie, a large one a real difference.

Every config also scores the same texts, the baseline's prompt + output (teacher
forcing), so their per-token NLL is paired token by token: the run is recorded as
command `sweep` with those series, and `clickpaca results compare ID` gives ΔPPL of each
config against the baseline with its bootstrap interval, as for `clickpaca ppl`.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..llama.cachetypes import DEFAULT
from .results import Generation, Results, Score

#: nProbs a sweep asks for when the caller did not (the margin needs alternatives).
SWEEP_NPROBS = 5


def config_label(cfg: Mapping[str, Any]) -> str:
    """A short name for a config: its cache types, build and mode."""
    k, v = cfg.get("cacheTypeK"), cfg.get("cacheTypeV")
    parts = []
    if k or v:
        parts.append(k if k == v or v is None else f"{k or DEFAULT}/{v or DEFAULT}")
    if cfg.get("build"):
        parts.append(str(cfg["build"]))
    if cfg.get("deterministic"):
        parts.append("deterministic")
    rest = sorted(set(cfg) - {"cacheTypeK", "cacheTypeV", "build", "deterministic"})
    parts += [f"{key}={cfg[key]}" for key in rest]
    return " ".join(parts) or "default"


def normalise_configs(configs: Any) -> dict[str, dict[str, Any]]:
    """label -> init fields. A string is a cache type for K and V ("q8_0"), or a K/V pair
    ("q8_0/q4_0"); a dict is init fields; a mapping of label -> either names them."""
    def one(c: Any) -> dict[str, Any]:
        if isinstance(c, str):
            k, _, v = c.partition("/")
            return {"cacheTypeK": k, "cacheTypeV": v or k}
        if isinstance(c, Mapping):
            return dict(c)
        raise TypeError(f"a sweep config is a cache type string or a dict of init fields, not {type(c).__name__}")

    if isinstance(configs, Mapping) and any(k in configs for k in ("cacheTypeK", "cacheTypeV", "build")):
        configs = [configs]  # one config, given as its init fields
    if isinstance(configs, Mapping):
        out = {str(label): one(c) for label, c in configs.items()}
    else:
        out = {}
        for c in configs:
            cfg = one(c)
            label = c if isinstance(c, str) else config_label(cfg)
            if label in out:
                raise ValueError(f"two sweep configs are both {label!r}: name them (a dict of label -> config)")
            out[label] = cfg
    if len(out) < 1:
        raise ValueError("a sweep needs at least one config")
    return out


def pair(a: Generation, b: Generation) -> dict[str, Any]:
    """How b's output compares with a's (see the module docstring)."""
    ta, tb = a.tokens, b.tokens
    n = min(len(ta), len(tb))
    div = next((i for i in range(n) if ta[i] != tb[i]), None)
    if div is None and len(ta) != len(tb):
        div = n  # the same tokens until one of them stopped
    common = n if div is None else div
    longest = max(len(ta), len(tb))
    same = sum(1 for x, y in zip(ta, tb) if x == y)
    row: dict[str, Any] = {"first_divergence": div, "common_prefix": common,
                           "agreement": same / longest if longest else 1.0,
                           "tokens_a": len(ta), "tokens_b": len(tb),
                           "dlogprob_mean": None, "dlogprob_max": None, "margin": None}
    if a.logprobs is not None and b.logprobs is not None and common:
        d = np.abs(np.asarray(b.logprobs[:common], np.float64) - np.asarray(a.logprobs[:common], np.float64))
        row["dlogprob_mean"], row["dlogprob_max"] = float(d.mean()), float(d.max())
    if div is not None and div < n and a.top is not None and a.logprobs is not None:
        alt = next((t["logprob"] for t in a.top[div] if t["token"] == tb[div]), None)
        if alt is not None:
            row["margin"] = float(a.logprobs[div] - alt)
    return row


@dataclass
class SweepResult:
    """generations[label] and scores[label] in prompt order; pairs: one row per
    (config other than the baseline, prompt); run_id: the results-store record."""

    labels: list[str]
    configs: dict[str, dict[str, Any]]
    ready: dict[str, dict[str, Any]]
    generations: dict[str, Results[Generation]]
    scores: dict[str, Results[Score]]
    pairs: list[dict[str, Any]] = field(default_factory=list)
    run_id: int | None = None

    @property
    def baseline(self) -> str:
        return self.labels[0]

    def to_records(self) -> list[dict[str, Any]]:
        return list(self.pairs)

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("to_pandas needs pandas: pip install 'clickpaca[pandas]'") from e
        return pd.DataFrame.from_records(self.to_records())

    def summary(self) -> list[dict[str, Any]]:
        """One row per config: its build and cache types, the score of the baseline's texts
        and, against the baseline, how many prompts kept the same tokens."""
        rows = []
        for label in self.labels:
            r = self.ready[label]
            sc = [s for s in self.scores[label] if s.ok and s.token_nll]
            nll = [x for s in sc for x in s.token_nll]
            mine = [p for p in self.pairs if p["config"] == label]
            rows.append({"cache": label, "build": r.get("build"), "cache_k": r.get("cacheTypeK"),
                         "cache_v": r.get("cacheTypeV"), "deterministic": r.get("deterministic"),
                         "tokens_scored": len(nll),
                         "mean_nll": float(np.mean(nll)) if nll else None,
                         "ppl": float(np.exp(np.mean(nll))) if nll else None,
                         "identical": sum(p["first_divergence"] is None for p in mine) if mine else None,
                         "errors": sum(not g.ok for g in self.generations[label])})
        return rows


def run_sweep(spawn: Callable[..., Any], configs: Any, prompts: Sequence[Any],
              init: Mapping[str, Any] | None = None, record: bool = True, progress: bool | None = None,
              spawn_args: Sequence[str] = (), steps: Sequence[Any] = (), **steering: Any) -> SweepResult:
    """Run `prompts` with `steering` on one server per config (see the module docstring).
    spawn: `Workbench.spawn` (what `Workbench.sweep` passes), started once per config."""
    cfgs = normalise_configs(configs)
    steering = {"nProbs": SWEEP_NPROBS, **steering}
    base = dict(init or {})
    labels = list(cfgs)

    def measure() -> SweepResult:
        res = SweepResult(labels, cfgs, {}, {}, {})
        texts: list[str] | None = None
        for label in labels:
            with spawn(*spawn_args, steps=steps, **{**base, **cfgs[label]}) as wb:
                res.ready[label] = wb.ready
                res.generations[label] = wb.generate(prompts, progress=progress, **steering)
                if texts is None:
                    texts = [_prompt_of(g) + g.text for g in res.generations[label]]
                res.scores[label] = wb.score(texts, progress=progress)
        for label in labels[1:]:
            for a, b in zip(res.generations[labels[0]], res.generations[label]):
                if a.ok and b.ok:
                    row = pair(a, b)
                else:
                    row = {"first_divergence": None, "error": a.error or b.error}
                sa, sb = res.scores[labels[0]][a.index], res.scores[label][a.index]
                row["dnll"] = (sb.nll - sa.nll) if sa.ok and sb.ok else None
                res.pairs.append({"config": label, "baseline": labels[0], "index": a.index,
                                  "prompt": _prompt_of(a), **row})
        return res

    if not record:
        return measure()
    from ..results.record import attach, recording

    params = {"configs": cfgs, "init": base, "steering": steering, "prompts": len(prompts),
              "model": base.get("modelPath"), "build": cfgs[labels[0]].get("build") or base.get("build")}
    with recording("sweep", argparse.Namespace(**params)) as state:
        res = measure()
        res.run_id = attach("sweep", _record_data(res, params))
    del state
    return res


def _prompt_of(g: Generation) -> str:
    p = g.request.get("prompt")
    if not isinstance(p, str):
        raise ValueError("a sweep takes prompts (text), not messages: its scores continue the prompt text")
    return p


def _record_data(res: SweepResult, params: dict[str, Any]) -> dict[str, Any]:
    """What the results store keeps: the per-config rows, the per-prompt pairs, and each
    config's per-token NLL of the baseline's texts (the paired series `compare` uses)."""
    base_scores = res.scores[res.baseline]
    texts = "\x00".join(s.text for s in base_scores)
    counts = np.asarray([s.tokens or 0 for s in base_scores], dtype="<i4")
    samples = {label: {"token_nll": [x for s in res.scores[label] if s.ok and s.token_nll for x in s.token_nll]}
               for label in res.labels}
    keys = {"text_sha256": hashlib.sha256(texts.encode("utf-8")).hexdigest(),
            "tokens_sha256": hashlib.sha256(counts.tobytes()).hexdigest(),
            "ctx": None, "chunks": len(base_scores)}
    return {"params": {**params, **keys}, "rows": res.summary(), "pairs": res.pairs, "samples": samples}
