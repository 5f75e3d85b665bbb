"""`clickpaca results compare`: which series to pair, whether they may be paired, the numbers.

Targets are `ID` (a whole run) or `ID:SERIES` (one cache type of a ppl run, or one
speed measure of a bench run). The first target is the baseline:
- one ppl run alone: every cache type against the run's first (its KL reference);
- several runs: every series of the baseline against the same-named series of each
  other run (e.g. last week's kv-study against today's);
- explicit `ID:SERIES` targets: exactly those.
Quality pairs need the same model, text, windows and scored tokens; speed pairs the
same command, model and parameters. Anything else is refused with the reason unless
`force` is set; unequal token counts can never be paired.
"""

from __future__ import annotations

from typing import Any

from ..llama.cachetypes import EXACT
from . import paired
from .store import ResultsStoreError, Store

QUALITY_KEYS = {"model": "the model", "text_sha256": "the text", "ctx": "the window (--ctx)",
                "chunks": "the number of windows", "tokens_sha256": "the tokens scored",
                "score_last": "the scored tail (--score-last)"}
#: Parameters that do not change what a speed run measures.
SPEED_IGNORED = {"what", "model", "out", "plot", "text"}


class CompareError(ValueError):
    """The targets cannot be compared (the message says why)."""


def parse_target(t: str) -> tuple[int, str | None]:
    head, _, series = str(t).partition(":")
    try:
        return int(head), (series or None)
    except ValueError:
        raise CompareError(f"not a run id: {t!r} (ID or ID:SERIES)") from None


#: Commands whose series are per-token NLL of the same tokens (paired ΔPPL): `ppl`, and a
#: Workbench sweep (every config scores the baseline's texts; clickpaca/workbench/sweep.py).
QUALITY_COMMANDS = ("ppl", "sweep")


def is_quality(run: dict[str, Any]) -> bool:
    return run["command"] in QUALITY_COMMANDS


def quality_keys(run: dict[str, Any]) -> dict[str, Any]:
    params = (run.get("result") or {}).get("params") or {}
    keys = {k: params.get(k) for k in QUALITY_KEYS if k != "model"}
    keys["model"] = run.get("model_sha")
    return keys


def reasons_not_comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why runs a and b do not measure the same thing (empty when they do)."""
    out = []
    if is_quality(a) != is_quality(b) or (not is_quality(a) and a["command"] != b["command"]):
        return [f"run {a['id']} is `{a['command']}`, run {b['id']} is `{b['command']}`"]
    if is_quality(a):
        ka, kb = quality_keys(a), quality_keys(b)
        for k, what in QUALITY_KEYS.items():
            if ka.get(k) != kb.get(k):
                out.append(f"{what} differs (run {a['id']}: {_short(ka.get(k))}, run {b['id']}: {_short(kb.get(k))})")
        return out
    if a.get("model_sha") != b.get("model_sha"):
        out.append(f"the model differs ({a.get('model_path')} vs {b.get('model_path')})")
    pa, pb = a.get("params") or {}, b.get("params") or {}
    for k in sorted(set(pa) | set(pb)):
        if k not in SPEED_IGNORED and pa.get(k) != pb.get(k):
            out.append(f"parameter {k} differs ({pa.get(k)!r} vs {pb.get(k)!r})")
    return out


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] if len(s) == 64 else s


def _series_names(run: dict[str, Any], samples: dict[str, Any]) -> list[str]:
    if is_quality(run):
        return [r["cache"] for r in (run.get("result") or {}).get("rows", []) if r.get("cache") in samples]
    return [k for k, v in samples.items() if "rounds" in v]


def pair_targets(runs: dict[int, dict], samples: dict[int, dict], targets: list[tuple[int, str | None]]
                 ) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """(baseline series, other series) pairs, as the module docstring says."""
    (ia, sa), rest = targets[0], targets[1:]
    names_a = _series_names(runs[ia], samples[ia])
    if not names_a:
        raise CompareError(f"run {ia} kept no samples to compare")
    if not rest:
        if not is_quality(runs[ia]):
            raise CompareError("a speed run is compared with another run: give two ids (or ID:SERIES pairs)")
        base = sa or names_a[0]
        return [((ia, base), (ia, n)) for n in names_a if n != base]
    pairs = []
    for ib, sb in rest:
        names_b = _series_names(runs[ib], samples[ib])
        if sa and sb:
            pairs.append(((ia, sa), (ib, sb)))
        elif sa or sb:
            pairs.append(((ia, sa or sb), (ib, sb or sa)))
        else:
            common = [n for n in names_a if n in names_b]
            if not common:
                raise CompareError(f"runs {ia} and {ib} have no series in common "
                                   f"({', '.join(names_a)} vs {', '.join(names_b)}): name them as ID:SERIES")
            pairs += [((ia, n), (ib, n)) for n in common]
    for (i, s) in {p for pair in pairs for p in pair}:
        if s not in samples[i]:
            raise CompareError(f"run {i} has no series {s!r} (it has: {', '.join(_series_names(runs[i], samples[i]))})")
    return pairs


def _reference(run: dict[str, Any]) -> str | None:
    """The series a run's per-token KL and top-1 were measured against: its first type, or
    with `--ref f32` the f32 reference row (then KL against the first type is a mean only)."""
    result = run.get("result") or {}
    rows = result.get("rows") or []
    if (result.get("params") or {}).get("ref") == EXACT:
        return next((r["cache"] for r in rows if (r.get("cache_k"), r.get("cache_v")) == (EXACT, EXACT)), None)
    return rows[0].get("cache") if rows else None


def _build_of(run: dict[str, Any], series: str) -> str | None:
    for r in (run.get("result") or {}).get("rows") or []:
        if r.get("cache") == series:
            return r.get("build")
    builds = (run.get("builds") or "").split(",")
    return builds[0] if builds and builds[0] else None


def quality_pair(store: Store, ra: dict, sa: str, xa: dict, rb: dict, sb: str, xb: dict,
                 **boot: Any) -> dict[str, Any]:
    # the server's `score` NLL; the in-process one when a side has no server NLL
    source = next((m for m in ("token_nll", "token_nll_inproc") if xa.get(m) is not None and xb.get(m) is not None),
                  None)
    if source is None:
        raise CompareError(f"{ra['id']}:{sa} and {rb['id']}:{sb} kept no per-token NLL of the same kind")
    nll_a, nll_b = xa[source], xb[source]
    if len(nll_a) != len(nll_b):
        raise CompareError(f"{ra['id']}:{sa} scored {len(nll_a)} tokens and {rb['id']}:{sb} {len(nll_b)}: "
                           "per-token differences cannot be paired")
    out: dict[str, Any] = {"kind": "quality", "nll_source": "server score" if source == "token_nll"
                           else "in-process", **paired.delta_ppl(nll_a, nll_b, **boot)}
    floor = store.noise_floor(ra.get("model_sha"), _build_of(rb, sb), "ppl_rel")
    rel_lo, rel_hi = out["delta_ppl_rel_ci"]
    out["noise_floor_rel"] = floor
    out["verdict"] = paired.verdict(rel_lo, rel_hi, out["delta_ppl_rel"], floor=floor)
    same_run = ra["id"] == rb["id"]
    ref = _reference(ra)
    f32_ref = ((ra.get("result") or {}).get("params") or {}).get("ref") == EXACT
    if same_run and (sa == ref or f32_ref):
        # KL(P_ref || P_b) and top-1 agreement were measured against the run's reference:
        # A itself, or the f32 reference of a --ref f32 run (named, since it is not A)
        if xb.get("token_kl") is not None:
            out["kl"] = paired.mean_ci(xb["token_kl"], **boot)
        if xb.get("token_top1") is not None:
            out["top1"] = paired.mean_ci(xb["token_top1"], **boot)
        out["kl_note"] = ("KL(A || B) and top-1 agreement of B with A, measured position by position in one run"
                          if sa == ref else
                          f"KL and top-1: of B against the run's reference ({ref}), not against A; "
                          "measured position by position in one run")
    elif (not same_run and _reference(ra) == _reference(rb)
          and all(x.get(m) is not None for x in (xa, xb) for m in ("token_kl", "token_top1"))):
        for key, metric in (("kl_diff", "token_kl"), ("top1_diff", "token_top1")):
            d = paired.paired_mean_diff(xa[metric], xb[metric], **boot)
            d["verdict"] = paired.verdict(*d["ci"], d["diff"])
            out[key] = d
        out["kl_note"] = ("KL and top-1: Δ = B - A of each against its own run's reference "
                          f"({_reference(ra)}), paired per token")
    return out


def speed_pair(store: Store, ra: dict, sa: str, xa: dict, rb: dict, sb: str, xb: dict,
               **boot: Any) -> dict[str, Any]:
    kw = {k: v for k, v in boot.items() if k in ("seed", "resamples")}
    out: dict[str, Any] = {"kind": "speed", **paired.ratio_of_medians(xa["rounds"], xb["rounds"], **kw)}
    floor = store.noise_floor(ra.get("model_sha"), _build_of(rb, sb), "speed_rel")
    lo, hi = out["ci"] or (None, None)
    out["noise_floor_rel"] = floor
    out["verdict"] = (paired.verdict(lo, hi, out["ratio"], zero=1.0, floor=floor) if out["ci"]
                      else "no interval (one round)")
    return out


def compare(store: Store, target_texts: list[str], force: bool = False, **boot: Any) -> dict[str, Any]:
    """The comparison report: {pairs, refused, notes}. Raises CompareError when refused."""
    targets = [parse_target(t) for t in target_texts]
    if not targets:
        raise CompareError("give at least one run id")
    runs, samples = {}, {}
    for i, _ in targets:
        if i not in runs:
            try:
                runs[i] = store.run(i)
            except ResultsStoreError as e:
                raise CompareError(str(e)) from None
            if runs[i]["status"] != "complete" and not force:
                raise CompareError(f"run {i} is {runs[i]['status']} (--force compares what it kept)")
            samples[i] = store.samples(i)
    notes: list[str] = []
    base = runs[targets[0][0]]
    for i, r in runs.items():
        if i == base["id"]:
            continue
        why = reasons_not_comparable(base, r)
        if why and not force:
            raise CompareError(f"runs {base['id']} and {i} do not measure the same thing: " + "; ".join(why)
                               + " (--force compares them anyway)")
        notes += [f"FORCED: {w}" for w in why]
        if base.get("builds") != r.get("builds"):
            notes.append(f"builds: run {base['id']} {base.get('builds')}, run {i} {r.get('builds')}")
        ma = (base.get("provenance") or {}).get("machine") or {}
        mb = (r.get("provenance") or {}).get("machine") or {}
        if (ma.get("cpu"), ma.get("cores")) != (mb.get("cpu"), mb.get("cores")):
            notes.append(f"machines differ: {ma.get('cpu')} x{ma.get('cores')} vs {mb.get('cpu')} x{mb.get('cores')}")
    out_pairs = []
    for (ia, sa), (ib, sb) in pair_targets(runs, samples, targets):
        fn = quality_pair if is_quality(runs[ia]) else speed_pair
        rec = fn(store, runs[ia], sa, samples[ia][sa], runs[ib], sb, samples[ib][sb], **boot)
        out_pairs.append({"a": f"{ia}:{sa}", "b": f"{ib}:{sb}", **rec})
    return {"pairs": out_pairs, "notes": notes,
            "method": {"seed": boot.get("seed", paired.SEED), "resamples": boot.get("resamples", paired.RESAMPLES),
                       "block": boot.get("block", paired.BLOCK), "level": paired.LEVEL}}
