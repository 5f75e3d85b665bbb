"""`make gpu-check`: everything a GPU machine can prove that this project's machines cannot,
in one command (docs/GPU.md).

No GPU is at hand where clickpaca is developed, so the first GPU machine should need nothing
but this. With an NVIDIA GPU and a CUDA toolkit it builds linux-cuda for the local GPU's
architecture (mainline with llama-bench and llama-batched-bench, llama-server, the patched
flavour as a library; linked under builds/linux-cuda-sm<arch>/, beside the CPU builds),
generates their bindings, runs the tests marked `gpu` (tests/test_gpu.py), runs the
existing benches against llama.cpp's own tools, and writes summary.json and summary.md
(each step's command, exit status and seconds) under --out. Every step runs even when one
before it failed (except after a failed build), and the exit status says whether all passed
and the time budget held. The steps and the budget: docs/GPU.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..results.table import markdown

ROOT = Path(__file__).resolve().parent.parent.parent
BUDGET_S = 9 * 60
BENCH_TOOLS = "llama-bench,llama-batched-bench"


def preflight() -> tuple[str | None, str | None]:
    """(architecture, None), or (None, the one line saying what is missing): native/cudakit.py."""
    sys.path.insert(0, str(ROOT / "native"))
    import cudakit

    return cudakit.gpu_preflight()


def steps(out: Path, jobs: int) -> list[tuple[str, list[str], bool]]:
    """(name, command, a build: stop after it fails) in order."""
    py = sys.executable
    bench = [py, "-m", "clickpaca", "bench"]
    return [
        ("build mainline", [py, "native/build.py", "mainline", "--preset", "linux-cuda", "-j", str(jobs),
                            "--only-tools", BENCH_TOOLS], True),
        ("build llama-server", [py, "native/peer.py", "--preset", "linux-cuda", "-j", str(jobs),
                                "--only-tools", BENCH_TOOLS], True),
        ("build patched", [py, "native/build.py", "patched", "--preset", "linux-cuda", "-j", str(jobs),
                           "--only-tools", ""], True),
        ("bindgen", [py, "-m", "bindgen", "BUILDS/mainline", "BUILDS/patched"], True),
        ("tests marked gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py",
                              f"--junitxml={out / 'tests.xml'}"], False),
        ("decode vs llama-bench", [*bench, "decode", "--tokens", "128", "--repeats", "3",
                                   "--out", str(out / "decode")], False),
        ("64 sequences vs llama-batched-bench", [*bench, "batch", "--seqs", "1,8,64", "--tokens", "64",
                                                 "--repeats", "2", "--out", str(out / "batch")], False),
        ("64 sequences, 8 JSON schemas, vs llama-server", [*bench, "peer", "--loads", "greedy1,mixed",
                                                          "--mixed", "64", "--tokens-schema", "64",
                                                          "--repeats", "2", "--out", str(out / "peer")], False),
        ("sampler host time per tick / decode", [*bench, "sampler", "--seqs", "1,8,64",
                                                 "--out", str(out / "sampler")], False),
    ]


def run(out: Path, arch: str, jobs: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    builds = ROOT / "builds" / f"linux-cuda-sm{arch.replace(';', '-')}"
    env = dict(os.environ, PRESET="linux-cuda", CUDA_ARCH=arch, CLICKPACA_BUILDS=str(builds),
               CLICKPACA_GPU_BUILD="mainline", CLICKPACA_GPU_PATCHED="activations")
    t0 = time.monotonic()
    done = []
    for name, cmd, is_build in steps(out, jobs):
        cmd = [str(builds) + c[len("BUILDS"):] if c.startswith("BUILDS/") else c for c in cmd]
        log = out / "logs" / (name.split()[0] + "-" + str(len(done)) + ".log")
        s0 = time.monotonic()
        print(f"[gpu-check] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        done.append({"step": name, "command": cmd, "exit": rc, "seconds": round(time.monotonic() - s0, 1),
                     "log": str(log.relative_to(out))})
        print(f"[gpu-check] {name}: exit {rc} in {done[-1]['seconds']} s", file=sys.stderr, flush=True)
        if rc != 0 and is_build:
            break
    total = round(time.monotonic() - t0, 1)
    results = collect(out)
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().splitlines()
    summary = {"arch": arch, "gpus": gpus, "cores": jobs, "builds": str(builds), "steps": done,
               "total_seconds": total, "budget_seconds": BUDGET_S, "within_budget": total <= BUDGET_S,
               "passed": all(s["exit"] == 0 for s in done) and len(done) == len(steps(out, jobs)),
               "results": results, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(render(summary))
    return summary


BENCHES = ("decode", "batch", "peer", "sampler")


def collect(out: Path) -> dict:
    """Each bench's JSON under out/<bench>/ (results/report.py write_json): its file, table
    and notes, for the summary."""
    results = {}
    for sub in BENCHES:
        for p in sorted((out / sub).glob("*.json")) if (out / sub).exists() else []:
            data = json.loads(p.read_text())
            results[sub] = {"file": str(p.relative_to(out)), "table_markdown": data.get("table_markdown"),
                            "notes": data.get("notes")}
    return results


def render(summary: dict) -> str:
    rows = [[s["step"], s["exit"], f"{s['seconds']:.0f}"] for s in summary["steps"]]
    text = [f"# make gpu-check: {', '.join(summary['gpus']) or 'GPU'} (sm_{summary['arch']}), "
            f"{summary['cores']} cores\n",
            markdown(["step", "exit", "s"], rows),
            f"\nTotal {summary['total_seconds']:.0f} s (budget {summary['budget_seconds']} s: "
            f"{'held' if summary['within_budget'] else 'EXCEEDED'}); "
            f"{'all passed' if summary['passed'] else 'NOT all passed'}.\n"]
    for name, r in summary["results"].items():
        text.append(f"\n## {name}\n\n{r['table_markdown'] or '(no table)'}\n")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "gpu-check")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--preflight", action="store_true", help="only check for a GPU and nvcc (one line)")
    args = ap.parse_args(argv)
    arch, problem = preflight()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    if args.preflight:
        return 0
    summary = run(args.out, arch, args.jobs)
    print(render(summary))
    print(f"[gpu-check] written: {args.out / 'summary.json'}, {args.out / 'summary.md'}", file=sys.stderr)
    return 0 if summary["passed"] and summary["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
