"""Run llama.cpp's own tools of a build and parse what they print.

Every native run gets OMP_WAIT_POLICY=passive: OpenMP threads that spin while waiting
collapse throughput on a shared machine (see /work/shared/notes/groundwork.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from ...llama.cachetypes import attention
from ...llama.native import build_dir

PPL_FINAL_RE = re.compile(r"Final estimate:\s*PPL\s*=\s*([0-9.eE+-]+|nan|inf)(?:\s*\+/-\s*([0-9.eE+-]+))?")
PPL_CHUNK_RE = re.compile(r"\[(\d+)\]([0-9.eE+-]+|nan|inf),")


class ToolError(RuntimeError):
    """A native tool failed or printed nothing we could parse."""


def tool_path(tool: str, build: str = "mainline") -> Path:
    p = build_dir(build) / "bin" / tool
    if not p.exists():
        raise ToolError(f"{tool} not found in build {build!r} ({p}); run `make {build}`")
    return p


def native_env(extra: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_WAIT_POLICY"] = "passive"
    env.update(extra or {})
    return env


def run_tool(cmd: list[str], timeout: float = 3600) -> tuple[str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=native_env(), timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ToolError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {tail}")
    return proc.stdout, proc.stderr


# ------------------------------------------------------------------ llama-bench

def parse_llama_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench `-o json` (a JSON array) or `-o jsonl` (one object per line)."""
    text = text.strip()
    if not text:
        raise ToolError("llama-bench printed nothing")
    if text.startswith("["):
        recs = json.loads(text)
    else:
        recs = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    out = []
    for r in recs:
        out.append({
            "n_prompt": int(r.get("n_prompt", 0)), "n_gen": int(r.get("n_gen", 0)),
            "n_threads": r.get("n_threads"), "type_k": r.get("type_k"), "type_v": r.get("type_v"),
            "flash_attn": r.get("flash_attn"), "avg_ts": float(r["avg_ts"]),
            "stddev_ts": float(r.get("stddev_ts", 0.0)),
            "samples_ts": [float(x) for x in r.get("samples_ts", [])],
            "build_commit": r.get("build_commit"), "build_number": r.get("build_number"),
            "model_type": r.get("model_type"), "cpu_info": r.get("cpu_info"),
        })
    return out


def llama_bench_tg(model: str, n_gen: int, threads: int, build: str = "mainline",
                   repetitions: int = 1, extra: list[str] | None = None) -> dict[str, Any]:
    """Text-generation speed (tokens/s) of `llama-bench -p 0 -n N -t T`."""
    cmd = [str(tool_path("llama-bench", build)), "-m", model, "-p", "0", "-n", str(n_gen),
           "-t", str(threads), "-r", str(repetitions), "-o", "json", *(extra or [])]
    out, _ = run_tool(cmd)
    recs = [r for r in parse_llama_bench_json(out) if r["n_gen"] == n_gen and r["n_prompt"] == 0]
    if not recs:
        raise ToolError(f"llama-bench printed no tg{n_gen} record")
    rec = recs[0]
    rec["cmd"] = " ".join(cmd)
    return rec


def llama_bench_kv(model: str, n_prompt: int, n_gen: int, threads: int, cache_k: str, cache_v: str,
                   build: str = "mainline", repetitions: int = 3) -> dict[str, Any]:
    """Prompt and generation speed with a cache type pair: `llama-bench -fa 1 -p P -n G
    -ctk K -ctv V -r R` (records keyed `pp` and `tg`, per-repetition samples_ts in each);
    -fa 0 where flash attention would not compute a type as itself (cachetypes.attention)."""
    fa = "1" if attention(cache_k, cache_v) == "on" else "0"  # as the server runs the type
    cmd = [str(tool_path("llama-bench", build)), "-m", model, "-fa", fa, "-p", str(n_prompt), "-n", str(n_gen),
           "-t", str(threads), "-r", str(repetitions), "-ctk", cache_k, "-ctv", cache_v, "-o", "json"]
    out, _ = run_tool(cmd)
    recs = parse_llama_bench_json(out)
    pp = next((r for r in recs if r["n_prompt"] == n_prompt and r["n_gen"] == 0), None)
    tg = next((r for r in recs if r["n_gen"] == n_gen and r["n_prompt"] == 0), None)
    if pp is None or tg is None:
        raise ToolError(f"llama-bench printed no pp{n_prompt} / tg{n_gen} record")
    return {"pp": pp, "tg": tg, "cmd": " ".join(cmd)}


# ------------------------------------------------------------------ llama-batched-bench

_BB_MD_KEYS = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp",
               "S_PP t/s": "speed_pp", "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t",
               "S t/s": "speed"}


def parse_batched_bench(text: str) -> list[dict[str, Any]]:
    """llama-batched-bench output, `--output-format jsonl` or the default markdown table."""
    rows: list[dict[str, Any]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{"):
            r = json.loads(s)
            if "speed_tg" in r:
                rows.append({k: r[k] for k in ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp",
                                               "t_tg", "speed_tg", "t", "speed") if k in r})
            continue
        if not s.startswith("|"):
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if header is None:
            if "S_TG t/s" in cells:
                header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        rec = {}
        for h, c in zip(header, cells):
            key = _BB_MD_KEYS.get(h)
            if key:
                rec[key] = int(c) if key in ("pp", "tg", "pl", "n_kv") else float(c)
        if "speed_tg" in rec:
            rows.append(rec)
    if not rows:
        raise ToolError("llama-batched-bench printed no result rows")
    return rows


def batched_bench(model: str, npp: int, ntg: int, npl: int, threads: int,
                  build: str = "mainline", ctx: int | None = None,
                  extra: list[str] | None = None) -> dict[str, Any]:
    """One `llama-batched-bench -npp P -ntg G -npl N` row (S_TG t/s is `speed_tg`)."""
    n_ctx = ctx or npl * (npp + ntg) + 16
    cmd = [str(tool_path("llama-batched-bench", build)), "-m", model, "-c", str(n_ctx),
           "-npp", str(npp), "-ntg", str(ntg), "-npl", str(npl), "-t", str(threads), "-kvu",
           "--output-format", "jsonl", *(extra or [])]
    out, _ = run_tool(cmd)
    rows = [r for r in parse_batched_bench(out) if r.get("pl") == npl]
    if not rows:
        raise ToolError(f"llama-batched-bench printed no row for npl={npl}")
    rec = rows[0]
    rec["cmd"] = " ".join(cmd)
    return rec


# ------------------------------------------------------------------ llama-perplexity

def parse_perplexity(text: str) -> dict[str, Any]:
    """PPL (and its +/- error) from `Final estimate: PPL = x +/- y`, plus the running
    estimates printed per chunk as `[1]14.73,[2]17.86,...`."""
    m = PPL_FINAL_RE.search(text)
    if not m:
        raise ToolError("llama-perplexity printed no 'Final estimate: PPL = ...' line")
    chunks = [float(v) for _, v in PPL_CHUNK_RE.findall(text[:m.start()])]
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)) if m.group(2) else None,
            "chunk_estimates": chunks}


def perplexity(model: str, text_file: str, ctx: int, chunks: int, cache_k: str, cache_v: str,
               threads: int, build: str = "mainline") -> dict[str, Any]:
    cmd = [str(tool_path("llama-perplexity", build)), "-m", model, "-f", text_file, "-c", str(ctx),
           "--chunks", str(chunks), "-fa", attention(cache_k, cache_v), "-ctk", cache_k, "-ctv", cache_v,
           "-t", str(threads)]
    out, err = run_tool(cmd)
    rec = parse_perplexity(out + "\n" + err)
    rec["cmd"] = " ".join(cmd)
    return rec
