#!/usr/bin/env python3
"""The GPU check from a pack (`make gpu-pack`): one command, no network, no compiler.

Why a script of its own: the machine that may be lent for it has a GPU, Python and
numpy, and nothing of this project's but the checkout and the pack a call carries; a loan
is 15 minutes with its start, so the run must fit in 6 and say, step by step, what it did
and how long it took against its budget. Standard library only until the wheels are in.

    python3 native/gpurun.py --pack gpu-pack --out "$OUT"  [--work DIR]

Steps (each with a budget in seconds; those needing a GPU are skipped by name where
nvidia-smi lists none): preflight (driver against the pack's toolkit, cuBLAS), unpack the
build, install the wheels into a target folder, make the twin model and check its sha256,
load the bindings, agree with the CPU reference, the tests marked gpu, bench decode
against llama-bench, bench batch 1/8/64 against llama-batched-bench, bench peer (64 mixed
JSON-schema requests) against llama-server, bench sampler's host share, pre-selection
against the host path at 8 and 64 sequences, the steering slots' cost against none.
Writes summary.json, summary.md and six logs to --out (8 files: what one call brings
back). Exit 0 when no step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
ROOT = NATIVE.parent
sys.path.insert(0, str(NATIVE))
import cudakit  # noqa: E402  (native/cudakit.py: the driver against the toolkit)
from build import cache_dir  # noqa: E402  (native/build.py: the cache clickpaca reads too)

GOAL_S = 360       # the run's goal: 6 minutes of a 15-minute loan, its start and a rerun kept
STOP_AT_S = 540    # after this, the steps left are skipped so the summary is written inside a 10-minute call
LOGS = ("setup", "tests", "decode", "batch", "peer", "sampler")
CHAINS = "greedy,default,temperature_only,n_probs_5,top_p_only,bias_penalties"


class Run:
    def __init__(self, pack: Path, out: Path, work: Path, only: set[str] | None = None,
                 stop_at: float = STOP_AT_S) -> None:
        self.pack, self.out, self.work = pack, out, work
        self.only, self.stop_at = only, stop_at
        self.manifest = json.loads((pack / "pack.json").read_text())
        self.site, self.builds, self.model = work / "site", work / "builds", work / "twin.gguf"
        self.results = work / "results"
        self.gpu = bool(cudakit.local_archs())
        self.steps: list[dict] = []
        self.t0 = time.monotonic()
        self.cuda_lib: str | None = None

    def env(self) -> dict:
        paths = [str(self.site), str(ROOT)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), CLICKPACA_BUILDS=str(self.builds),
                   CLICKPACA_MODEL=str(self.model), OMP_WAIT_POLICY="passive", PYTHONDONTWRITEBYTECODE="1",
                   CLICKPACA_GPU_BUILD="mainline", CLICKPACA_GPU_PATCHED="activations")
        if self.cuda_lib:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [self.cuda_lib, env.get("LD_LIBRARY_PATH")]))
        return env

    def step(self, name: str, budget: int, log: str, action, needs_gpu: bool = False, key: str | None = None) -> None:
        """`key`: the step's name for --only (the set-up steps have none: they always run)."""
        s0 = time.monotonic()
        row = {"step": name, "budget_s": budget, "log": f"{log}.log", "needs_gpu": needs_gpu, "key": key}
        if needs_gpu and not self.gpu:
            row.update(status="skipped", reason="needs a GPU: nvidia-smi lists none here", exit=None, seconds=0.0)
        elif key is not None and self.only is not None and key not in self.only:
            row.update(status="skipped", reason="not asked for (--only)", exit=None, seconds=0.0)
        elif time.monotonic() - self.t0 > self.stop_at:
            row.update(status="skipped", reason=f"out of time ({self.stop_at:.0f} s spent)", exit=None, seconds=0.0)
        else:
            with open(self.out / f"{log}.log", "a") as f:
                f.write(f"\n=== {name} (budget {budget} s)\n")
                f.flush()
                try:
                    rc = action(f, budget)
                except Exception as e:  # a step's failure is recorded, the next step still runs
                    f.write(f"{type(e).__name__}: {e}\n")
                    rc = 1
            secs = round(time.monotonic() - s0, 1)
            row.update(status="passed" if rc == 0 else "failed", exit=rc, seconds=secs,
                       over_budget=secs > budget)
        self.steps.append(row)
        print(f"[gpu-run] {name}: {row['status']} ({row['seconds']} s of {budget})", file=sys.stderr, flush=True)

    def sh(self, cmd: list[str], f, budget: int) -> int:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, env=self.env(), stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(60, 2 * budget)).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {max(60, 2 * budget)} s\n")
            return 124

    # ------------------------------------------------------------ the steps

    def preflight(self, f, budget) -> int:
        cuda = self.manifest["build"].get("cuda") or {}
        problem = cudakit.driver_problem(cudakit.driver_version(), cuda.get("version", "13.0"))
        if problem:
            f.write(problem + "\n")
            return 1
        self.cuda_lib = find_cublas()
        f.write(f"driver {cudakit.driver_version()} runs CUDA {cuda.get('version')}; cuBLAS: {self.cuda_lib}\n")
        if self.cuda_lib is None:
            f.write("no libcublas.so.13 and libcublasLt.so.13 here (CUDA_HOME, /usr/local/cuda*, the linker's "
                    "cache, pip's nvidia-cublas): the pack cannot carry them (540 MiB)\n")
            return 1
        return 0

    def unpack(self, f, budget) -> int:
        with tarfile.open(self.pack / "build.tar.xz") as tar:
            tar.extractall(self.work, filter="tar")
        build = self.work / "build"
        flavor = self.manifest["build"]["flavor"]
        names = ["mainline"] + (["patched", "activations", "kvcenter", "turboquant"] if flavor == "patched" else [])
        self.builds.mkdir(exist_ok=True)
        for n in names:
            (self.builds / n).unlink(missing_ok=True)
            (self.builds / n).symlink_to(build)
        # llama-server of the same tree: the peer bench checks it was made from builds/mainline
        peer = self.builds / "peer"
        shutil.rmtree(peer, ignore_errors=True)
        peer.mkdir()
        for sub in ("bin", "lib"):
            (peer / sub).symlink_to(build / sub)
        (peer / "build-info.json").write_text(json.dumps({"flavor": "peer", "mainline": str(build)}) + "\n")
        # the texts' sdist where clickpaca's corpus module looks for it (it checks the sha256)
        downloads = cache_dir() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        for item in sorted((self.pack / "files").glob("*")):
            shutil.copy2(item, downloads / item.name)
        f.write(f"{build}: {', '.join(sorted(p.name for p in (build / 'bin').iterdir()))}; builds {names} + peer\n")
        return 0

    def wheels(self, f, budget) -> int:
        """A wheel is a zip of its files (no build step): extracted into one target folder."""
        self.site.mkdir(exist_ok=True)
        for whl in sorted((self.pack / "wheels").glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                z.extractall(self.site)
            for data in self.site.glob("*.data"):
                for sub in ("purelib", "platlib"):
                    if (data / sub).is_dir():
                        shutil.copytree(data / sub, self.site, dirs_exist_ok=True)
                shutil.rmtree(data)
            f.write(f"{whl.name}\n")
        probe = "import cffi, pycparser, orjson, llguidance, jsonschema, gguf; print('imports ok')"
        return self.sh([sys.executable, "-c", probe], f, budget)

    def twin(self, f, budget) -> int:
        return self.sh([sys.executable, str(NATIVE / "twin.py"), "make", str(self.pack / "twin-recipe.json"),
                        str(self.model)], f, budget)

    def bindings(self, f, budget) -> int:
        code = ("from clickpaca.llama.native import load; from clickpaca.llama import gpu; n = load('mainline'); "
                "print(n.info['flavor'], n.info['preset'], 'GPUs:', len(gpu.local_gpus(n)))")
        return self.sh([sys.executable, "-c", code], f, budget)

    def agree(self, f, budget) -> int:
        return self.sh([sys.executable, "-m", "clickpaca.measure.gpuagree", "check", "--model", str(self.model),
                        "--build", "mainline", "--reference", str(self.pack / "reference.json")], f, budget)

    def tests(self, f, budget) -> int:
        return self.sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests/test_gpu.py"], f, budget)

    def steering_cost(self, f, budget) -> int:
        """Issue 57's cost goals on the GPU: each sequence its own slot vector on every
        layer, then gated, against no steering, alternating rounds (activations/cost.py)."""
        rc = 0
        for seqs in ("8", "64"):
            rc |= self.sh([sys.executable, "-m", "clickpaca.activations.cost", "--slots", "--seqs", seqs,
                           "--steps", "32", "--rounds", "7"], f, budget)
        return rc

    def bench(self, *args: str):
        def run(f, budget) -> int:
            return self.sh([sys.executable, "-m", "clickpaca", "bench", *args], f, budget)
        return run

    # ------------------------------------------------------------ the run

    def run(self) -> dict:
        r = self.results
        self.step("preflight: driver against the toolkit, cuBLAS", 5, "setup", self.preflight, needs_gpu=True)
        self.step("unpack the build", 5, "setup", self.unpack)
        self.step("install the wheels into a target folder", 5, "setup", self.wheels)
        self.step("make the twin model (sha256 as the recipe says)", 5, "setup", self.twin)
        self.step("load the bindings", 5, "setup", self.bindings)
        self.step("agree with the CPU reference (8 prompts, greedy)", 15, "setup", self.agree, key="agree")
        self.step("tests marked gpu", 50, "tests", self.tests, needs_gpu=True, key="tests")
        self.step("bench decode vs llama-bench", 15, "decode",
                  self.bench("decode", "--tokens", "128", "--repeats", "3", "--out", str(r / "decode")),
                  needs_gpu=True, key="decode")
        self.step("bench batch 1,8,64 vs llama-batched-bench", 25, "batch",
                  self.bench("batch", "--seqs", "1,8,64", "--tokens", "64", "--repeats", "2",
                             "--out", str(r / "batch")), needs_gpu=True, key="batch")
        self.step("bench peer: 64 mixed JSON-schema requests vs llama-server", 100, "peer",
                  self.bench("peer", "--loads", "mixed", "--mixed", "64", "--tokens-schema", "16", "--repeats", "1",
                             "--out", str(r / "peer")), needs_gpu=True, key="peer")
        self.step("bench sampler: the host's share of the tick", 15, "sampler",
                  self.bench("sampler", "--seqs", "1,8,64", "--out", str(r / "sampler")), needs_gpu=True, key="sampler")
        self.step("pre-selection vs the host path at 8 and 64 sequences", 75, "batch",
                  self.bench("batch", "--seqs", "8,64", "--tokens", "32", "--prompt-tokens", "32", "--repeats", "1",
                             "--preselect", "--chain", CHAINS, "--out", str(r / "preselect")),
                  needs_gpu=True, key="preselect")
        self.step("steering slots: 8 and 64 sequences, plain and gated, vs none", 20, "batch",
                  self.steering_cost, needs_gpu=True, key="steering")
        return self.summary()

    def summary(self) -> dict:
        m = self.manifest
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip().splitlines() if self.gpu else []
        total = round(time.monotonic() - self.t0, 1)
        s = {"pack": {"build": m["build"], "made_at": m["made_at"], "python_version": m["python_version"]},
             "model": {**m["model"], "what": f"synthetic twin of {m['model']['twin_of']} (native/twin.py): same "
                       "tensors and types, seeded random weights, the real tokenizer"},
             "gpus": gpus, "python": sys.version.split()[0], "steps": self.steps,
             "total_seconds": total, "budget_seconds": sum(x["budget_s"] for x in self.steps), "goal_seconds": GOAL_S,
             "within_goal": total <= GOAL_S, "failed": [x["step"] for x in self.steps if x["status"] == "failed"],
             "skipped": [x["step"] for x in self.steps if x["status"] == "skipped"],
             "results": collect(self.results), "preselect_row": preselect_row(self.results / "preselect"),
             "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (self.out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
        (self.out / "summary.md").write_text(render(s))
        return s


def find_cublas() -> str | None:
    """The folder holding libcublas.so.13 and libcublasLt.so.13 on this machine, or None."""
    want = ("libcublas.so.13", "libcublasLt.so.13")
    dirs = [Path(os.environ[v]) / sub for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v) for sub in ("lib64", "lib")]
    for root in sorted(Path("/usr/local").glob("cuda*")):
        dirs += [root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"]
    dirs += [Path(p) / "nvidia" / "cu13" / "lib" for p in sys.path if p]
    dirs += [Path(p) / "nvidia" / "cublas" / "lib" for p in sys.path if p]
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        dirs += [Path(line.split("=>")[-1].strip()).parent for line in cache.splitlines() if want[0] in line]
    except OSError:
        pass
    for d in dirs:
        if all((d / w).exists() for w in want):
            return str(d)
    return None


def preselect_row(folder: Path) -> dict | None:
    """What the CUDA row of clickpaca/llama/backends.py should say, from the pre-selection
    step's rows: on only where the pre-selection path was the faster (its median per-round
    ratio to the host path above 1) for every chain at every sequence count; None when the
    step left nothing."""
    files = sorted(folder.glob("*.json")) if folder.exists() else []
    rows = json.loads(files[0].read_text()).get("rows", []) if files else []
    ratios = [(r.get("seqs"), r.get("chain"), r.get("pre_ratio_to_default")) for r in rows]
    if not ratios or any(x is None for *_, x in ratios):
        return None
    on = all(x > 1 for *_, x in ratios)
    return {"on": on, "ratios": ratios,
            "evidence": f"measured: preselect / host {min(x for *_, x in ratios):.2f}-{max(x for *_, x in ratios):.2f} "
                        f"over {len(ratios)} chain x sequence rows (make gpu-check PACK=...)"}


def collect(results: Path) -> dict:
    """Each bench's JSON (results/report.py write_json): its table and notes."""
    out = {}
    for sub in sorted(p for p in results.iterdir() if p.is_dir()) if results.exists() else []:
        for p in sorted(sub.glob("*.json")):
            data = json.loads(p.read_text())
            out[sub.name] = {"table_markdown": data.get("table_markdown"), "notes": data.get("notes")}
    return out


def render(s: dict) -> str:
    lines = [f"# GPU check from a pack: {', '.join(s['gpus']) or 'no GPU here'}", "",
             f"Model: {s['model']['what']}, sha256 {s['model']['twin_sha256'][:16]}.",
             f"Build: {s['pack']['build']['flavor']} {s['pack']['build']['preset']} "
             f"{(s['pack']['build'].get('cuda') or {}).get('arch', '')} (pack made {s['pack']['made_at']}).", "",
             "| step | status | exit | s | budget s |", "|---|---|--:|--:|--:|"]
    for x in s["steps"]:
        status = x["status"] + (f" ({x['reason']})" if x.get("reason") else "")
        lines.append(f"| {x['step']} | {status} | {'' if x['exit'] is None else x['exit']} | {x['seconds']:.0f} "
                     f"| {x['budget_s']} |")
    lines += ["", f"Total {s['total_seconds']:.0f} s (budget {s['budget_seconds']} s, goal {s['goal_seconds']} s: "
              f"{'held' if s['within_goal'] else 'EXCEEDED'}); failed: {', '.join(s['failed']) or 'none'}; "
              f"skipped: {len(s['skipped'])}."]
    row = s.get("preselect_row")
    lines += ["", "Pre-selection default for CUDA (clickpaca/llama/backends.py): "
              + (f"{'on' if row['on'] else 'off'}, {row['evidence']}" if row else "not measured (the step left no rows)")]
    for name, r in s["results"].items():
        lines += ["", f"## {name}", "", r["table_markdown"] or "(no table)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="summary.json, summary.md and the six logs")
    ap.add_argument("--work", type=Path, help="where the build, wheels and model go (default: a folder beside --out)")
    ap.add_argument("--only", help="run only these steps after the set-up (comma list of agree, tests, decode, batch, "
                                   "peer, sampler, preselect, steering): a rerun of the ones that failed")
    ap.add_argument("--stop-at", type=float, default=STOP_AT_S,
                    help=f"seconds after which the steps left are skipped (default {STOP_AT_S})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out.parent / (args.out.name + "-work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    only = set(args.only.split(",")) if args.only else None
    s = Run(args.pack.resolve(), args.out.resolve(), work.resolve(), only, args.stop_at).run()
    print(render(s))
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
