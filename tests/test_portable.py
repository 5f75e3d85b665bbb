"""PORTABLE=1: llama.cpp's runtime-dispatched CPU variants (GGML_BACKEND_DL with
GGML_CPU_ALL_VARIANTS), through the real server and the real default model.

The portable build is not part of `make test` (a full build with 14 CPU variants, 405
ninja steps against the native build's 159): the tests that need it are marked `portable`,
which `make test` deselects and `make test-portable` builds for and runs; without the
build they fail, saying what to run. The pure
logic (which variants are kept, the links in bin/) is tested in test_native_build.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bindgen.versions import native_build
from clickpaca.wire.client import Client
from clickpaca.llama.cpu import cpu_flags, variant_flags
from clickpaca.llama.native import Native
from conftest import NEAR_TIE

nb = native_build()

def runs_here(features: list[str], flags: set[str]) -> bool:
    return variant_flags(features) <= flags


def test_the_loaded_cpu_variant_is_named_from_its_module_file():
    def nat(backends):
        return Native("portable", Path("/b"), None, None, {}, {}, backends)

    assert nat({"CPU": "/c/builds/x/lib/libggml-cpu-haswell.so", "RPC": "/c/lib/libggml-rpc.so"}).cpu_variant == "haswell"
    assert nat({"CPU": "/c/lib/libggml-cpu-armv8.2_1.so"}).cpu_variant == "armv8.2_1"
    assert nat({}).cpu_variant is None  # a native build: the CPU backend is linked in


@pytest.fixture(scope="module")
def portable() -> Path:
    out = nb.finished_pinned_build("mainline", "linux-cpu", nb.cpu_options(amx=False, portable=True))
    if out is None:
        pytest.fail("no portable build in the cache: run `make test-portable`")
    if not (out / "bindings" / "_llama_cffi.py").exists():
        pytest.fail(f"the portable build has no bindings: `.venv/bin/python -m bindgen {out}`")
    return out


@pytest.fixture(scope="module")
def builds_root(portable, tmp_path_factory) -> Path:
    """A builds/ of its own holding the portable build as `portable` and the native one of
    this machine as `mainline` (from the cache: builds/mainline may be either)."""
    native = nb.finished_pinned_build("mainline", "linux-cpu", nb.cpu_options(amx=False, portable=False))
    assert native is not None, "make test builds the native mainline first"
    root = tmp_path_factory.mktemp("builds")
    (root / "portable").symlink_to(portable)
    (root / "mainline").symlink_to(native)
    return root


@pytest.mark.portable
def test_the_build_records_its_variants_without_amx(portable):
    cpu = json.loads((portable / "build-info.json").read_text())["cpu"]
    assert cpu["portable"] is True and cpu["amx"] is False and cpu["isa"] == []
    assert "sapphirerapids" in cpu["variants_left_out"] and "sapphirerapids" not in cpu["variants"]
    assert not any(f.startswith("AMX") for feats in cpu["variants"].values() for f in feats)
    lib = sorted(p.name for p in (portable / "lib").glob("libggml-cpu-*.so"))
    assert lib == sorted(f"libggml-cpu-{v}.so" for v in cpu["variants"])


@pytest.mark.portable
def test_its_own_tools_find_their_cpu_backend(portable, model_path):
    """llama-bench from bin/ (ggml searches the executable's directory): a prompt batch and
    a one-token decode, as the smoke test ran before the build counted as finished."""
    proc = subprocess.run([str(portable / "bin" / "llama-bench"), "-m", str(model_path), "-p", "16",
                           "-n", "1", "-r", "1", "-t", "2", "-o", "json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert {r["n_prompt"] for r in rows} == {0, 16} and all(r["avg_ts"] > 0 for r in rows)


@pytest.mark.portable
def test_clickpaca_loads_the_best_variant_this_cpu_runs_and_its_functions(portable, builds_root):
    """In clickpaca's own process: ggml loads the variant from lib/ (ggml_backend_load_all_from_path),
    it is one this CPU runs and none kept runs here with more features; ggml-cpu's and
    ggml-rpc's own functions (in the modules, not in anything libllama links) are reachable."""
    script = ("import json; from clickpaca.llama.native import load\n"
              "nat = load('portable'); lib = nat.lib\n"
              "print(json.dumps({'variant': nat.cpu_variant, 'backends': sorted(nat.backends),\n"
              "  'cpu_buft': lib.ggml_backend_cpu_buffer_type() != nat.ffi.NULL,\n"
              "  'rpc': hasattr(lib, 'ggml_backend_rpc_add_server')}))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CLICKPACA_BUILDS": str(builds_root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    variants = json.loads((portable / "build-info.json").read_text())["cpu"]["variants"]
    flags = cpu_flags()
    assert got["variant"] in variants and runs_here(variants[got["variant"]], flags)
    better = [v for v, feats in variants.items()
              if runs_here(feats, flags) and set(feats) > set(variants[got["variant"]])]
    assert better == [], f"ggml loaded {got['variant']}, but {better} run here with more"
    assert got["backends"] == ["CPU", "RPC"] and got["cpu_buft"] and got["rpc"]


def greedy(c: Client, prompt: str, n: int = 8) -> list[dict]:
    c.infer(0, prompt, maxTokens=n, temperature=0, nProbs=2)
    toks, done = c.collect(0)
    assert done["type"] == "done", done
    assert done["tokens_predicted"] == n
    return toks


@pytest.mark.portable
def test_the_portable_build_serves_an_infer_like_the_native_one(builds_root, portable):
    """`clickpaca serve` on the portable build: ready names the variant; a greedy run agrees
    with the native build's token for token up to a near tie (the variant is compiled with
    other flags than -march=native, so the bits may differ: NEAR_TIE, never ==)."""
    env = {"CLICKPACA_BUILDS": str(builds_root)}
    runs, readies = {}, {}
    for build in ("portable", "mainline"):
        c = Client.spawn(env=env)
        try:
            readies[build] = c.init(nCtx=1024, nSeqMax=2, build=build,
                                    stateDir=tempfile.mkdtemp(prefix="clkp-state-"))
            runs[build] = greedy(c, "The capital of France is")
        finally:
            c.close()
    cpu = readies["portable"]["cpu"]
    variants = json.loads((portable / "build-info.json").read_text())["cpu"]["variants"]
    assert cpu["portable"] is True and cpu["variant"] in variants
    assert cpu["features"] == sorted(variant_flags(variants[cpu["variant"]]))  # the variant's, not -march's
    assert "AMX" not in readies["portable"]["kernels"]["extraBufferTypes"]
    assert readies["mainline"]["cpu"]["variant"] is None
    for step, (p, m) in enumerate(zip(runs["portable"], runs["mainline"])):
        if p["token"] != m["token"]:
            gap = abs(m["top"][0]["logprob"] - m["top"][1]["logprob"])
            assert gap < NEAR_TIE, f"step {step}: {p['token']} against {m['token']}, {gap:.3f} nats apart"
            break
