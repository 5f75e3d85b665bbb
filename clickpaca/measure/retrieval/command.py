"""`clickpaca kv-retrieval`: the setups, the measuring loop, the table, the plot, the store.

Per haystack length: the haystack with its needles and the same-length control without
them; every setup prefills the haystack once and asks every question through forks
(runner.py). Setups, in order: the exact reference (f32 K/V, flash attention off:
attention in f32), the f16 default (the base of everything else), the control (the f16
default on the needle-free haystack: what the model answers without the fact, so that the
needle is shown to be used), the noise floor (the f16 default changed in one thing that
should not matter, as `clickpaca ppl --noise`; with `--noise-of TYPE`, that type's default
changed in the same things instead, run right after the type itself: its own run-to-run
noise, shown beside the types, not applied to them), then the other cache types. What the types
are read against runs first so that a long study stopped early still holds it: a run
stopped by SIGTERM or SIGINT (Ctrl-C) records the setups it finished, marked failed with
the setups it did not run. The table lists them as ref, base, types, control.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from ...llama import cachetypes, core, kvcenter
from ..common import model_path, out_dir, png
from ...llama.cachetypes import DEFAULT, EXACT, attention, build_for, pair_name, parse_pair
from ...results.report import RETRIEVAL_PLOTS, draw_retrieval, emit, machine
from ...results.stats import parse_list, progress
from ...results.table import fmt, markdown
from ..texts import read_text
from ...results import recording
from .haystack import assemble, depths, make_needles
from .runner import Setup, run
from .stats import above_noise, exact_match, floor, kl_rows, mean_ci, paired_diff

F32_REF = Setup(f"{EXACT} (flash attention off)", EXACT, EXACT, flash_attn="off")
BASE = Setup(DEFAULT)
NOISE = (
    Setup("prompt chunks of 64 (not 256)", chunk=64),
    Setup("questions one per decode (not all forks in one)", solo=True),
    Setup("cells after 100 of another sequence", offset=100),
    Setup("flash attention off", flash_attn="off"),
    Setup("weights not repacked", repack=False),
)
CONTROL = f"{DEFAULT}, needles removed"


class Stopped(RuntimeError):
    """The study was stopped (SIGTERM, SIGINT) after some setups; their rows were still emitted."""


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM stops the study as Ctrl-C does (a background job ignores SIGINT)."""
    raise KeyboardInterrupt("SIGTERM")


def plan(pairs: list[tuple[str, str]], ref: str, noise: bool,
         noise_of: tuple[str, str] | None = None,
         centered: list[tuple[str, str]] | tuple = ()) -> list[tuple[str, Setup]]:
    """(role, setup) in the order they run: ref, base, control, noise, the other types, then
    the `centered` pairs (K stored minus the center: `K+c/V`).
    noise_of: the floor of that type (one of `pairs`) instead of f16's: the type runs right
    before its noise rows, which leave out flash attention off for a quantized V (it needs it)."""
    if ref not in (DEFAULT, EXACT):
        raise ValueError(f"--ref: must be {DEFAULT} or {EXACT}, got {ref!r}")
    out: list[tuple[str, Setup]] = [("ref", F32_REF)] if ref == EXACT else []
    types = [Setup(pair_name(k, v), k, v, flash_attn=attention(k, v)) for k, v in pairs]
    if BASE in types:
        types.remove(BASE)
        out.append(("type", BASE))
    else:
        out.append(("base", Setup(f"{DEFAULT} default")))
    out.append(("control", BASE))
    of = floor_base(pairs, noise_of) if noise else None
    if of is not None and of != BASE:
        types.remove(of)
        out.append(("type", of))
    if noise:
        out += [("noise", n) for n in noise_setups(of or BASE)]
    out += [("type", t) for t in types]
    out += [("type", Setup(f"{k}+c/{v}", k, v, flash_attn=attention(k, v), centered=True)) for k, v in centered]
    return out


def floor_base(pairs: list[tuple[str, str]], noise_of: tuple[str, str] | None) -> Setup:
    """The setup the noise rows vary: the f16 default, or the --noise-of type's own."""
    if noise_of is None or noise_of == (DEFAULT, DEFAULT):
        return BASE
    if noise_of not in pairs:
        raise ValueError(f"--noise-of: {pair_name(*noise_of)} is not one of --cache "
                         f"({', '.join(pair_name(k, v) for k, v in pairs)})")
    return Setup(pair_name(*noise_of), *noise_of, flash_attn=attention(*noise_of))


def noise_setups(of: Setup) -> list[Setup]:
    """NOISE applied to `of`'s cache types; flash attention off only where V is unquantized."""
    if of == BASE:
        return list(NOISE)
    return [dataclasses.replace(n, type_k=of.type_k, type_v=of.type_v)
            for n in NOISE if not (n.flash_attn == "off" and cachetypes.v_needs_flash_attn(of.type_v, "--noise-of"))]


#: Row order of the table: the reference, the base, the types, the control.
SHOWN = {"ref": 0, "base": 1, "type": 2, "control": 3}


def _breaks(model: core.Model, toks: np.ndarray) -> np.ndarray:
    return np.array([model.token_to_piece(int(t), special=False).endswith(b"\n") for t in toks], dtype=bool)


def measure(args: Any) -> dict[str, Any]:
    path = model_path(args)
    m0 = machine()
    threads = getattr(args, "threads", None)
    specs = [kvcenter.parse_pair(s, "--cache") for s in parse_list(args.cache, str)]  # K/V, or K+c/V
    pairs = [(k, v) for k, v, c in specs if not c]
    centered = [(k, v) for k, v, c in specs if c]
    center = kvcenter.read(args.center) if getattr(args, "center", None) else None
    if centered and center is None:
        raise ValueError("--cache: a centered pair (K+c/V) needs --center FILE (`clickpaca kv-center` writes one)")
    lengths = parse_list(args.lengths, int)
    types = [t for k, v, _ in specs for t in (k, v)]
    build = kvcenter.build_for_centered(*types) if centered else build_for(*types)
    from ..checks import noise_of as check_noise_of

    check_noise_of(args)  # also checked before any work (NEEDS); here for in-process callers
    noise_of = parse_pair(args.noise_of) if getattr(args, "noise_of", None) else None
    setups = plan(pairs, args.ref, bool(args.noise), noise_of, centered)
    floor_of = floor_name(setups, noise_of)
    text, text_path = read_text(args.text)
    needles = make_needles(args.needles, args.seed)
    models: dict[bool, core.Model] = {}
    try:
        models[True] = m = core.Model(path, build=build)
        if any(not s.repack for _, s in setups):
            models[False] = core.Model(path, build=build, repack=False)
        filler = m.tokenize(text, add_special=True, parse_special=False)
        if max(lengths) > len(filler):
            raise ValueError(f"--lengths: the text has {len(filler)} tokens, fewer than {max(lengths)}")
        breaks = _breaks(m, filler[:max(lengths)])
        filler = filler[:max(lengths)]
        tok = lambda s: m.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
        n_tok = [tok(n.fact + "\n") for n in needles]
        qa = [(tok("\n\n" + n.question), tok(n.answer)) for n in needles]
        split = [n.kind for n, (q, a) in zip(needles, qa)
                 if not np.array_equal(tok("\n\n" + n.question + n.answer), np.concatenate([q, a]))]
        max_new = max(len(a) for _, a in qa) + 2
        limit = m.n_ctx_train
        for L in lengths:
            if L + sum(len(q) + max_new for q, _ in qa) + 128 > limit:
                raise ValueError(f"--lengths: {L} with its questions exceeds the model's context ({limit})")
        records: list[dict[str, Any]] = []
        timings: list[dict[str, Any]] = []
        stopped = None
        for L in lengths:
            hay, starts = assemble(filler, breaks, n_tok, depths(len(needles)), L)
            control, _ = assemble(filler, breaks, [], [], L)
            kept: dict[str, list] = {}
            for role, s in setups:
                name = CONTROL if role == "control" else s.name
                progress(f"kv-retrieval: {L} tokens, {name} ({time.strftime('%H:%M:%S', time.gmtime())} UTC)")
                try:
                    answers, t = run(models[s.repack], s, control if role == "control" else hay, qa, max_new,
                                     threads, center)
                except KeyboardInterrupt as e:
                    stopped = _not_run(setups, lengths, L, name, str(e) or "SIGINT")
                    break
                timings.append({"setup": name, "length": L, **t})
                if role in ("ref", "base") or (role == "type" and s == BASE):
                    kept[role if role == "ref" else "base"] = [a.logp for a in answers]
                if name == floor_of:
                    kept["floor"] = [a.logp for a in answers]
                for i, (n, a) in enumerate(zip(needles, answers)):
                    text_out = m.detokenize(a.greedy)
                    rec = {"setup": name, "role": role, "cache": s.pair,
                           "length": L, "needle": i, "kind": n.kind, "depth": starts[i] / L,
                           "answer": n.answer.strip(), "greedy": text_out, "exact": exact_match(text_out, n.answer),
                           "answer_logp": a.answer_logp, "answer_tokens": len(a.logp)}
                    for ref_role, key in (("ref", "kl_f32"), ("base", "kl_f16")):
                        if ref_role in kept and role != "control":
                            rec[key] = float(kl_rows(kept[ref_role][i], a.logp).mean())
                    if role == "noise":
                        rec["kl_base"] = float(kl_rows(kept["floor"][i], a.logp).mean())
                    records.append(rec)
                del answers
            if stopped:
                break
            _partial(args, records, setups, lengths[:lengths.index(L) + 1], timings, floor_of)
    finally:
        for x in models.values():
            x.close()
    if stopped and not records:
        raise Stopped(stopped)
    lengths = [L for L in lengths if any(r["length"] == L for r in records)]
    rows, noise_rows = summarize(records, setups, lengths, floor_of)
    for r in rows + noise_rows:
        r["build"] = build
    samples: dict[str, dict[str, list]] = {}
    for r in records:
        d = samples.setdefault(r["setup"], {})
        for k in ("answer_logp", "exact", "kl_f32", "kl_f16"):
            if k in r:
                d.setdefault(k, []).append(float(r[k]))
    notes = [f"haystack: {text_path} from its start, {len(needles)} needles at depths "
             f"{', '.join(f'{d:.2f}' for d in depths(len(needles)))} (after the nearest line break); "
             "each haystack prefilled once per setup, every question through a fork of it",
             "answer log-prob: teacher-forced, summed over the answer's tokens (nats); accuracy: the greedy "
             "answer starts with the expected one; KL: mean over the answer's positions of KL(P_ref || P)",
             "intervals: 95% percentile bootstrap across needles; Δ vs f16 paired needle by needle",
             f"control: {CONTROL}: the f16 default on a haystack of the same length without the needles"]
    if noise_rows and floor_of != base_name(setups):
        notes.append(f"noise floor of {floor_of} (--noise-of): its default computation changed in one thing "
                     "that should not matter, KL and Δ log-prob against it (its own run-to-run noise; shown "
                     "beside the types, not applied to them)")
    elif noise_rows:
        notes.append("noise floor: the f16 default changed in one thing that should not matter; a type stands "
                     "above the noise when its KL vs f16 and its |Δ log-prob| exceed every noise row's and "
                     "its Δ interval excludes zero")
    if stopped:
        notes.append(stopped)
    if split:
        notes.append(f"question and answer tokenize differently joined than apart for: {', '.join(split)} "
                     "(the answer is scored as tokenized apart)")
    if center is not None:
        notes.append(f"K+c: keys stored minus the center {args.center} (digest {center.digest[:12]}; calibrated "
                     f"on {center.meta.get('text')} tokens {center.meta.get('window')}), in the graph (kvcenter)")
    return {"params": {"cache": [pair_name(k, v) for k, v in pairs] + [f"{k}+c/{v}" for k, v in centered],
                       "center": ({"path": args.center, "digest": center.digest} if center is not None else None),
                       "lengths": lengths, "needles": len(needles),
                       "seed": args.seed, "ref": args.ref, "noise": bool(args.noise), "noise_of": floor_of,
                       "text": text_path,
                       "model": path, "build": build, "threads": threads or os.cpu_count(),
                       "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()},
            "rows": rows, "noise": noise_rows, "needle_records": records, "timings": timings,
            "samples": samples, "notes": notes, "machine_start": m0, "server_problems": [],
            **({"stopped": stopped} if stopped else {})}


def _not_run(setups: list[tuple[str, Setup]], lengths: list[int], L: int, at: str, why: str = "SIGINT") -> str:
    """The note of a stopped study: which setups at which lengths did not run."""
    names = [CONTROL if role == "control" else s.name for role, s in setups]
    rest = [f"{n} at {L}" for n in names[names.index(at):]]
    rest += [f"every setup at {x}" for x in lengths[lengths.index(L) + 1:]]
    return f"stopped ({why}) during {at} at {L} tokens; not run: {', '.join(rest)}"


def _partial(args: Any, records: list[dict[str, Any]], setups: list[tuple[str, Setup]], done: list[int],
             timings: list[dict[str, Any]], floor_of: str) -> None:
    """After each length: the table so far in OUT/kv-retrieval-partial.md (a long study that
    is stopped keeps the lengths it finished; the store records the finished command only)."""
    from pathlib import Path

    rows, noise = summarize(records, setups, done, floor_of)
    out = {"params": {"ref": args.ref, "lengths": done, "noise_of": floor_of}, "rows": rows, "noise": noise,
           "timings": timings}
    p = Path(out_dir(args)) / "kv-retrieval-partial.md"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"lengths done: {done}\n\n{table(out)}\n")
    progress(f"kv-retrieval: wrote {p}")


def _row(recs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Summary of one setup at one length (or all lengths) against the base's same needles."""
    acc = [float(r["exact"]) for r in recs]
    lp = [r["answer_logp"] for r in recs]
    out: dict[str, Any] = {"needles": len(recs), "accuracy": mean_ci(acc), "answer_logp": mean_ci(lp)}
    if base and base is not recs:
        out["dlogp"] = paired_diff([r["answer_logp"] for r in base], lp)
        out["dacc"] = paired_diff([float(r["exact"]) for r in base], acc)
    for k in ("kl_f32", "kl_f16", "kl_base"):
        if all(k in r for r in recs) and recs:
            out[k] = mean_ci([r[k] for r in recs])
    return out


def base_name(setups: list[tuple[str, Setup]]) -> str:
    """The setup every type is read against: f16 (as a type, or the f16 default)."""
    return next(s.name for role, s in setups if role == "base" or (role == "type" and s == BASE))


def floor_name(setups: list[tuple[str, Setup]], noise_of: tuple[str, str] | None) -> str:
    """The setup the noise rows vary and are read against (the base, or the --noise-of type)."""
    of = floor_base([(s.type_k, s.type_v) for role, s in setups if role == "type"], noise_of)
    return base_name(setups) if of == BASE else of.name


def summarize(records: list[dict[str, Any]], setups: list[tuple[str, Setup]], lengths: list[int],
              floor_of: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows: every non-noise setup per length and over all lengths, noise rows per length).
    floor_of: the setup the noise rows are read against (default the base); a floor of
    another type is shown, not applied to the types' "above noise"."""
    def of(name: str, L: int | None) -> list[dict[str, Any]]:
        return [r for r in records if r["setup"] == name and (L is None or r["length"] == L)]

    base_at = base_name(setups)
    floor_of = floor_of or base_at
    rows, noise = [], []
    ran = {(r["setup"], r["length"]) for r in records}
    for L in lengths + [None]:
        base = of(base_at, L)
        nrows = []
        for role, s in setups:
            if role != "noise" or L is None or (s.name, L) not in ran:
                continue
            r = {"source": s.name, "length": L, **_row(of(s.name, L), of(floor_of, L))}
            nrows.append(r)
        fl = floor(nrows) if floor_of == base_at else floor([])
        noise += nrows
        for role, s in sorted((x for x in setups if x[0] != "noise"),
                              key=lambda x: (SHOWN[x[0]] if x[1] != BASE or x[0] == "control" else 1)):
            name = CONTROL if role == "control" else s.name
            if not of(name, L):  # not run (a stopped study)
                continue
            r = {"cache": name, "role": role, "length": L if L is not None else "all",
                 "build": None, **_row(of(name, L), base)}
            if role == "type" and s != BASE and L is not None:
                r["above_noise"] = above_noise(r, fl)
            if L is not None:
                r["floor"] = fl
            rows.append(r)
    return rows, noise


def _ci(d: dict[str, Any] | None, digits: int = 3) -> str:
    if not d or d.get("mean") is None:
        return "-"
    return f"{fmt(d['mean'], digits)} [{fmt(d['ci'][0], digits)}, {fmt(d['ci'][1], digits)}]"


def table(out: dict[str, Any]) -> str:
    ref = out["params"]["ref"] == EXACT
    head = ["K/V", "length", "needles", "accuracy", "answer log-prob", f"Δ log-prob vs {DEFAULT}",
            f"Δ accuracy vs {DEFAULT}"]
    head += [f"KL vs {EXACT}"] if ref else []
    head += [f"KL vs {DEFAULT}", "above noise"]
    body = []
    for r in out["rows"]:
        row = [r["cache"], r["length"], r["needles"], _ci(r["accuracy"], 2), _ci(r["answer_logp"]),
               _ci(r.get("dlogp")), _ci(r.get("dacc"), 2)]
        row += [_ci(r.get("kl_f32"))] if ref else []
        row += [_ci(r.get("kl_f16")), r.get("above_noise")]
        body.append(tuple(row))
    text = markdown(head, body, align="l" + "r" * (len(head) - 1))
    if out["noise"]:
        of = out["params"].get("noise_of") or DEFAULT
        text += f"\n\nNoise floor ({of} changed in one thing that should not matter, against it):\n\n" + markdown(
            ["changed", "length", "accuracy", f"Δ log-prob vs {of}", "Δ accuracy", f"KL vs {of}"],
            [(r["source"], r["length"], _ci(r["accuracy"], 2), _ci(r.get("dlogp")), _ci(r.get("dacc"), 2),
              _ci(r.get("kl_base"))) for r in out["noise"]], align="lrrrrr")
    t = {}
    for x in out.get("timings") or []:
        t.setdefault(x["length"], []).append(x["prefill_s"])
    if t:
        text += "\n\nPrefill seconds per setup (median, min-max): " + "; ".join(
            f"{L}: {np.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for L, v in t.items())
    return text


def plot(out: dict[str, Any], args: Any) -> None:
    for key, (name, _) in RETRIEVAL_PLOTS.items():
        draw_retrieval(out, key, png(args, name))


#: What `clickpaca kv-retrieval` checks before any work (measure/checks.py).
NEEDS = ("noise_of", "model", "cache+c", "text", "center if center")


def run_kv_retrieval(args: argparse.Namespace) -> int:
    from ..checks import Refused, check

    try:
        check(args, NEEDS)
    except Refused as e:
        print(f"clickpaca kv-retrieval: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with recording("kv-retrieval", args):
            out = measure(args)
            emit(out_dir(args), "kv-retrieval", out, table(out), "Retrieval from a held haystack per KV cache type")
            if args.plot:
                plot(out, args)
            if out.get("stopped"):
                raise Stopped(out["stopped"])
    except Stopped as e:
        print(f"clickpaca kv-retrieval: {e}", file=sys.stderr)
        return 130
    return 0
