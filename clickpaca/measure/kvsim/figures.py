"""`python -m clickpaca.measure.kvsim.figures`: the two-model figures of docs/KV-RESEARCH.md.

One figure per measure, both models in each: KL against f16 over bits per value (the
perplexity study), Δ answer log-prob against haystack length (retrieval), and the simulated
types' KL (kvsim). Gemma's perplexity and retrieval figures come from docs/data (copied from
the earlier runs' tables, each with its command); SmolLM2's and both kvsim studies from the
JSON the commands wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ...llama.cachetypes import DEFAULT, EXACT


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ppl_points(smol_ppl: dict) -> tuple[list[tuple[str, float, float]], float]:
    """(cache, bits, KL vs f16) of a `clickpaca ppl --ref f32 --noise` JSON, and its floor."""
    pts = []
    for r in smol_ppl["rows"]:
        kl = r.get("kl_mean_ref2") if r.get("kl_ref2") == DEFAULT else None
        if r["cache"] in (DEFAULT, EXACT) or kl is None:
            continue
        pts.append((r["cache"], float(r["bpv"]), float(kl)))
    floor = max(n["kl_mean"] for n in smol_ppl["noise"])
    return pts, floor


def fig_ppl(gemma: dict, smol_ppl: dict, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    g = [(r["cache"], r["bits"], r["kl_f16"]) for r in gemma["ppl"]["rows"] if r["cache"] != DEFAULT]
    s, s_floor = ppl_points(smol_ppl)
    for pts, floor, label, m, c in ((g, gemma["ppl"]["floor"]["kl"], "Gemma 3 270M (1 KV head x 256)", "o", "C0"),
                                    (s, s_floor, "SmolLM2-135M (3 KV heads x 64)", "s", "C1")):
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], marker=m, color=c, label=label)
        for name, b, kl in pts:
            ax.annotate(name, (b, kl), textcoords="offset points", xytext=(4, 3), fontsize=7, color=c)
        ax.axhline(floor, color=c, ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (K and V averaged)")
    ax.set_ylabel("KL vs f16 (nats per token, mean)")
    ax.set_title("KV cache types, 4 windows of 512 tokens of Hamlet (dotted: each model's noise floor)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def retrieval_series(smol: dict) -> tuple[list[int], dict[str, list[float]], list[float]]:
    """lengths, {type: Δ log-prob vs f16 per length}, floor per length (the largest |Δ| of the
    noise rows) from a `clickpaca kv-retrieval` JSON."""
    rows = [r for r in smol["rows"] if r.get("role") == "type" and r["length"] != "all"]
    lengths = sorted({int(r["length"]) for r in rows})
    series: dict[str, list[float]] = {}
    for r in rows:
        if r["cache"] in (DEFAULT, EXACT) or not r.get("dlogp"):
            continue
        series.setdefault(r["cache"], [float("nan")] * len(lengths))[lengths.index(int(r["length"]))] = \
            float(r["dlogp"]["mean"])
    floor = [max((abs(n["dlogp"]["mean"]) for n in smol.get("noise", [])
                  if n.get("length") == L and n.get("dlogp")), default=0.0) for L in lengths]
    return lengths, series, floor


def fig_retrieval(gemma: dict, smol: dict, out: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    gr = gemma["retrieval"]
    lengths, series, floor = retrieval_series(smol)
    for ax, title, L, ser, fl in ((axes[0], "Gemma 3 270M (results run 36)", gr["lengths"], gr["dlogp"], gr["floor_dlogp"]),
                                  (axes[1], "SmolLM2-135M-Instruct", lengths, series, floor)):
        for name, ys in ser.items():
            ax.plot(L, ys, marker="o", label=name)
        ax.fill_between(L, [-f for f in fl], fl, color="grey", alpha=0.25, label="noise floor")
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("haystack length (tokens)")
        ax.set_yscale("symlog", linthresh=1)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("Δ answer log-prob vs f16 (nats, 12 needles)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fig_sim(sims: dict[str, dict], out: Path) -> None:
    plt = _plt()
    names: list[str] = []
    for d in sims.values():
        for r in d["rows"]:
            if "kl_f16" in r and r["name"] not in names and not r["name"].startswith("f16/f16"):
                names.append(r["name"])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(names) + 1.5))
    h = 0.8 / len(sims)
    for i, (model, d) in enumerate(sims.items()):
        by = {r["name"]: r for r in d["rows"]}
        ys = [j + i * h for j in range(len(names))]
        vals = [by[n]["kl_f16"] if n in by else 0 for n in names]
        err = [[by[n]["kl_f16"] - by[n]["kl_f16_ci"][0] if n in by else 0 for n in names],
               [by[n]["kl_f16_ci"][1] - by[n]["kl_f16"] if n in by else 0 for n in names]]
        ax.barh(ys, vals, height=h, xerr=err, label=model, color=f"C{i}")
        q4 = by.get("q4_0 (real)")
        if q4:
            ax.axvline(q4["kl_f16"] / 2, color=f"C{i}", ls="--", lw=1)
    ax.set_yticks([j + h / 2 for j in range(len(names))])
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("KL vs f16 (nats per token, mean, 95% CI); dashed: half of real q4_0's")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.kvsim.figures", description=__doc__)
    ap.add_argument("--gemma", default="docs/data/kv-gemma3-270m.json")
    ap.add_argument("--smollm2-ppl", required=True)
    ap.add_argument("--smollm2-retrieval", required=True, help="kv-retrieval JSON(s), comma-separated")
    ap.add_argument("--sim", nargs="*", default=[], metavar="MODEL=JSON[,JSON]")
    ap.add_argument("--out", default="docs")
    a = ap.parse_args(argv)
    gemma = json.loads(Path(a.gemma).read_text())
    out = Path(a.out)
    fig_ppl(gemma, json.loads(Path(a.smollm2_ppl).read_text()), out / "kv-two-models-kl.png")
    ret: dict = {"rows": [], "noise": []}
    for f in a.smollm2_retrieval.split(","):  # several runs (other lengths) in one figure
        d = json.loads(Path(f).read_text())
        ret["rows"] += d["rows"]
        ret["noise"] += d.get("noise", [])
    fig_retrieval(gemma, ret, out / "kv-two-models-retrieval.png")
    if a.sim:
        sims = {}
        for s in a.sim:  # MODEL=A.json[,B.json]: rows of later files added where new
            model, files = s.split("=", 1)
            rows: list = []
            for f in files.split(","):
                rows += [r for r in json.loads(Path(f).read_text())["rows"] if r["name"] not in {x["name"] for x in rows}]
            sims[model] = {"rows": rows}
        fig_sim(sims, out / "kv-sim.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
