"""`clickpaca results list|show|compare|export|plot`: read the results store.

Plain (markdown) tables by default, `--json` for scripts. Nothing here writes to the
store except through Store's migrations on open.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .report import load_pyplot, save_figure, draw_retrieval
from .table import fmt, markdown
from . import paired
from .compare import CompareError, compare, is_quality, parse_target
from .store import ResultsStoreError, Store


def add_parser(sub: Any) -> None:
    p = sub.add_parser("results", help="the local results store: list, show, compare, export, plot runs")
    p.add_argument("--db", help="results database (default: $CLICKPACA_RESULTS or ~/.cache/clickpaca/results.sqlite3)")
    rs = p.add_subparsers(dest="action", required=True)

    q = rs.add_parser("list", help="recorded runs, newest first")
    q.add_argument("--command", help="command prefix, e.g. ppl or 'bench decode'")
    q.add_argument("--model", help="part of the model path, or the start of its identity hash")
    q.add_argument("--build", help="build name, e.g. turboquant")
    q.add_argument("--since", help="UTC date or time, e.g. 2026-11-23")
    q.add_argument("--until", help="UTC date or time (exclusive)")
    q.add_argument("--text", help="part of the parameters, e.g. a text file name or a cache type")
    q.add_argument("--group", help="runs of one `bench all` / `make kv-study`")
    q.add_argument("--limit", type=int, default=50)
    q.add_argument("--json", action="store_true")

    q = rs.add_parser("show", help="one run: provenance, parameters, its table")
    q.add_argument("id", type=int)
    q.add_argument("--json", action="store_true")

    q = rs.add_parser("compare", help="paired statistics between runs or cache types")
    q.add_argument("targets", nargs="*", metavar="ID[:SERIES]",
                   help="the first is the baseline; one ppl run alone compares its types with its first; "
                        "none: the newest complete run (a bench run: against the one before it)")
    q.add_argument("--force", action="store_true", help="compare runs over different texts, windows, models")
    q.add_argument("--seed", type=int, default=paired.SEED)
    q.add_argument("--resamples", type=int, default=paired.RESAMPLES)
    q.add_argument("--block", type=int, default=paired.BLOCK, help="tokens per bootstrap block")
    q.add_argument("--json", action="store_true")

    q = rs.add_parser("export", help="one run as JSON (provenance, result, raw samples)")
    q.add_argument("id", type=int)
    q.add_argument("--out", help="file (default: stdout)")

    q = rs.add_parser("plot", help="a measure across runs or cache types, as a PNG")
    q.add_argument("ids", nargs="+", type=int)
    q.add_argument("--measure", default=None,
                   help="ppl (the default), kl or top1 (ppl runs, by cache type, 95%% CI bars), answer_logp "
                        "(the default), dlogp or accuracy (one kv-retrieval run, against haystack length), or "
                        "a speed series name")
    q.add_argument("--out", default="bench-results/results.png")
    p.set_defaults(func=run_results)


def run_results(args: argparse.Namespace) -> int:
    try:
        with Store(args.db) as store:
            return {"list": cmd_list, "show": cmd_show, "compare": cmd_compare, "export": cmd_export,
                    "plot": cmd_plot}[args.action](store, args)
    except (ResultsStoreError, CompareError) as e:
        print(f"clickpaca results: {e}", file=sys.stderr)
        return 2


def _series(run: dict) -> str:
    p = run.get("params") or {}
    bits = [f"{k}={','.join(map(str, p[k])) if isinstance(p[k], list) else p[k]}"
            for k in ("cache", "ctx", "chunks", "seqs", "tokens", "repeats") if p.get(k) is not None]
    return " ".join(bits)


def cmd_list(store: Store, args: argparse.Namespace) -> int:
    runs = store.runs(args.command, args.model, args.build, args.since, args.until, args.text, args.group,
                      args.limit)
    if args.json:
        print(json.dumps(runs, indent=2, default=str))
        return 0
    rows = [(r["id"], r["started_utc"], r["command"], r["status"], (r.get("model_path") or "-").rsplit("/", 1)[-1],
             r.get("builds") or "-", (r.get("git_commit") or "-")[:9] + ("+dirty" if r.get("git_dirty") else ""),
             r.get("run_group") or "", _series(r)) for r in runs]
    print(markdown(["id", "started (UTC)", "command", "status", "model", "builds", "commit", "group", "parameters"],
                   rows, align="rllllllll"))
    print(f"\n{len(runs)} run(s) in {store.path}")
    return 0


def cmd_show(store: Store, args: argparse.Namespace) -> int:
    run = store.run(args.id)
    if args.json:
        print(json.dumps(run, indent=2, default=str))
        return 0
    p = run["provenance"]
    git, m = p.get("git") or {}, p.get("machine") or {}
    model = p.get("model") or {}
    print(f"run {run['id']}: {run['command']} ({run['status']})")
    print(f"  time     {run['started_utc']} -> {run.get('ended_utc') or '-'} UTC")
    print(f"  code     clickpaca {p.get('clickpaca_version')} {git.get('commit')}"
          f"{' (dirty)' if git.get('dirty') else ''} {git.get('branch') or ''}")
    for name, b in (p.get("builds") or {}).items():
        b = b or {}
        print(f"  build    {name}: {b.get('flavor')} llama.cpp {b.get('commit')} b{b.get('build_number')} "
              f"preset {b.get('preset')} key {b.get('key')}")
    print(f"  model    {model.get('path')} ({model.get('size')} bytes, {str(model.get('edge_sha256'))[:16]})")
    def load(v: Any) -> str:
        return " ".join(f"{x:.2f}" for x in v) if v else "-"

    print(f"  machine  {m.get('cpu')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB; load average "
          f"{load(p.get('loadavg_start'))} at start, {load(p.get('loadavg_end'))} at end")
    print(f"  params   {json.dumps(run['params'], default=str)}")
    if run.get("run_group"):
        print(f"  group    {run['run_group']}")
    if run.get("error"):
        print(f"  error    {run['error']}")
    samples = store.samples(args.id)
    if samples:
        print("  samples  " + "; ".join(f"{s}: " + ", ".join(f"{k} x{len(v)}" for k, v in ms.items())
                                      for s, ms in list(samples.items())[:12])
              + (" ..." if len(samples) > 12 else ""))
    res = run.get("result") or {}
    if res.get("table_markdown"):
        print()
        print(res["table_markdown"])
    for n in res.get("notes") or []:
        print(f"\n- {n}")
    return 0


def _ci(lo_hi: Any, scale: float = 1.0, pct: bool = False) -> str:
    if not lo_hi:
        return "-"
    lo, hi = (x * scale for x in lo_hi)
    return f"[{lo:+.2f}%, {hi:+.2f}%]" if pct else f"[{fmt(lo, 3)}, {fmt(hi, 3)}]"


def format_compare(rep: dict[str, Any]) -> str:
    q = [p for p in rep["pairs"] if p["kind"] == "quality"]
    s = [p for p in rep["pairs"] if p["kind"] == "speed"]
    m = rep["method"]
    out = []
    if q:
        rows = []
        for p in q:
            kl = p.get("kl") or {}
            t1 = p.get("top1") or {}
            kd = p.get("kl_diff") or {}
            td = p.get("top1_diff") or {}
            kl_cell = (f"{fmt(kl['mean'])} {_ci(kl['ci'])}" if kl else
                       f"Δ {kd['diff']:+.4f} {_ci(kd['ci'])} {kd['verdict']}" if kd else "-")
            t1_cell = (f"{fmt(t1['mean'])} {_ci(t1['ci'])}" if t1 else
                       f"Δ {td['diff']:+.4f} {_ci(td['ci'])} {td['verdict']}" if td else "-")
            rows.append((p["a"], p["b"], p["tokens"], p["ppl_a"], p["ppl_b"],
                         f"{p['delta_ppl']:+.3f} {_ci(p['delta_ppl_ci'])}",
                         f"{100 * p['delta_ppl_rel']:+.2f}% {_ci(p['delta_ppl_rel_ci'], 100, pct=True)}",
                         kl_cell, t1_cell, p["verdict"]))
        out.append(f"Quality (paired per token; bootstrap {int(100 * m['level'])}% CI, {m['resamples']} "
                   f"resamples of {m['block']}-token blocks, seed {m['seed']})\n")
        out.append(markdown(["A", "B", "tokens", "PPL A", "PPL B", "ΔPPL (B-A) [95% CI]", "ΔPPL % [95% CI]",
                             "KL [95% CI]", "top-1 agree [95% CI]", "verdict"], rows, align="llrrrrrrrl"))
        for note in dict.fromkeys(p.get("kl_note") for p in q if p.get("kl_note")):
            out.append(f"\n- {note}")
    if s:
        rows = [(p["a"], p["b"], f"{p['rounds_a']}/{p['rounds_b']}", p["median_a"], p["median_b"],
                 f"{p['ratio']:.3f} {_ci(p['ci'])}", p["verdict"]) for p in s]
        out.append(f"\nSpeed (ratio of medians B/A; bootstrap {int(100 * m['level'])}% CI over rounds, "
                   f"seed {m['seed']})\n")
        out.append(markdown(["A", "B", "rounds A/B", "median A", "median B", "ratio [95% CI]", "verdict"], rows,
                            align="llrrrrl"))
    floors = {p.get("noise_floor_rel") for p in rep["pairs"]} - {None}
    out.append("\n- verdict: 'within noise' when the 95% interval includes zero (ratio: 1)"
               + (f" or the difference is below the recorded noise floor ({', '.join(map(str, floors))})"
                  if floors else "; no noise floor is recorded for this model and build"))
    for n in rep["notes"]:
        out.append(f"- {n}")
    return "\n".join(out)


def latest_targets(store: Store) -> list[str]:
    """The newest complete run alone (ppl), or with the complete run of the same command before it."""
    done = [r for r in store.runs(limit=500) if r["status"] == "complete"]
    if not done:
        raise CompareError(f"no complete run in {store.path}")
    last = done[0]
    if is_quality(last):
        return [str(last["id"])]
    before = next((r for r in done[1:] if r["command"] == last["command"]), None)
    if before is None:
        raise CompareError(f"run {last['id']} (`{last['command']}`) is the only one of its command: nothing to compare")
    return [str(before["id"]), str(last["id"])]


def cmd_compare(store: Store, args: argparse.Namespace) -> int:
    targets = args.targets or latest_targets(store)
    if not args.targets:
        print(f"comparing {' '.join(targets)} (the newest complete run)\n")
    rep = compare(store, targets, force=args.force, seed=args.seed, resamples=args.resamples,
                  block=args.block)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_compare(rep))
    return 0


def cmd_export(store: Store, args: argparse.Namespace) -> int:
    run = store.run(args.id)
    run["samples"] = {s: {k: v.tolist() for k, v in ms.items()} for s, ms in store.samples(args.id).items()}
    text = json.dumps(run, indent=2, default=str) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def plot_series(store: Store, ids: list[int], measure: str) -> dict[str, tuple[list[str], list[float], list]]:
    """run label -> (x labels, values, (lo, hi) intervals) of the measure."""
    out = {}
    for i in ids:
        run, smp = store.run(i), store.samples(i)
        xs, ys, cis = [], [], []
        if run["command"] == "ppl":
            ref = None
            for r in (run.get("result") or {}).get("rows") or []:
                name, x = r["cache"], smp.get(r["cache"], {})
                ref = ref or name
                if measure == "ppl" and x.get("token_nll") is not None:
                    st = paired.mean_ci(x["token_nll"])
                    ys.append(float(paired.np.exp(st["mean"])))
                    cis.append([float(paired.np.exp(c)) for c in st["ci"]])
                elif measure in ("kl", "top1") and x.get(f"token_{measure}") is not None and name != ref:
                    st = paired.mean_ci(x[f"token_{measure}"])
                    ys.append(st["mean"])
                    cis.append(st["ci"])
                else:
                    continue
                xs.append(name)
        else:
            for name, x in smp.items():
                if "rounds" in x and measure in name:
                    v = x["rounds"]
                    xs.append(name)
                    ys.append(float(paired.np.median(v)))
                    cis.append([float(v.min()), float(v.max())])
        if xs:
            out[f"run {i} ({run['started_utc'][:16]})"] = (xs, ys, cis)
    return out


def cmd_plot(store: Store, args: argparse.Namespace) -> int:
    first = store.run(args.ids[0])
    if first["command"] == "kv-retrieval":
        return plot_retrieval(first, args)
    measure = args.measure or "ppl"
    data = plot_series(store, args.ids, measure)
    if not data:
        raise CompareError(f"runs {args.ids} hold no samples of {measure!r}")
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=110)
    labels = list(dict.fromkeys(x for xs, _, _ in data.values() for x in xs))
    n = len(data)
    for j, (run, (xs, ys, cis)) in enumerate(data.items()):
        pos = [labels.index(x) + (j - (n - 1) / 2) * 0.12 for x in xs]
        err = [[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]]
        ax.errorbar(pos, ys, yerr=err, fmt="o", capsize=3, label=run)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    bars = "bootstrap 95% CI" if measure in ("ppl", "kl", "top1") else "min-max of rounds"
    save_figure(plt, fig, ax, args.out, "cache type / series", f"{measure} (bars: {bars})",
          f"{measure} across runs {', '.join(map(str, args.ids))}")
    return 0


def plot_retrieval(run: dict, args: argparse.Namespace) -> int:
    """A kv-retrieval run's figure, drawn again from the store (the docs' plots are these)."""
    if len(args.ids) != 1:
        raise CompareError(f"a kv-retrieval run is plotted alone (against haystack length), got runs {args.ids}")
    if not (run.get("result") or {}).get("rows"):
        raise CompareError(f"run {args.ids[0]} holds no retrieval rows (status {run['status']})")
    try:
        draw_retrieval(run["result"], args.measure or "answer_logp", args.out)
    except ValueError as e:
        raise CompareError(str(e)) from None
    return 0


__all__ = ["add_parser", "run_results", "format_compare", "parse_target"]
