"""The thin core and the commands of the foundation, on the real build and model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from clickpaca.llama.core import Batch, Context, ModelError, check_gguf, cache_types
from clickpaca.llama.models import DEFAULT_MODEL_FILE, resolve_model
from clickpaca.llama.native import build_dir
from conftest import TEST_BUILD

pytestmark = pytest.mark.model

STRINGS = ["Hello world", "  leading spaces", "naïve café — ünïcödé ✓", "日本語のテキスト",
           "<start_of_turn>user\nhi<end_of_turn>", "emoji 🦙🦙 and tabs\t\tend", "1234567890"]


def clickpaca(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clickpaca", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=300)


def native_tokenize(model_path, text: str) -> list[int]:
    exe = build_dir(TEST_BUILD) / "bin" / "llama-tokenize"
    out = subprocess.run([str(exe), "-m", str(model_path), "-p", text, "--ids", "--log-disable"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_model_facts(model):
    assert model.n_vocab == 262144
    assert model.bos == 2 and model.eos == 1 and model.add_bos
    assert list(model.eog_tokens) == [1, 106, 212]
    assert "gemma3" in model.description


@pytest.mark.parametrize("text", STRINGS)
def test_tokenize_detokenize_round_trip(model, text):
    toks = model.tokenize(text, add_special=False, parse_special=True)
    assert model.detokenize(toks, special=True) == text


def test_pieces_concatenate_to_the_text(model):
    text = "naïve café 日本語"
    toks = model.tokenize(text, add_special=False)
    assert b"".join(model.token_to_piece(int(t)) for t in toks).decode() == text


@pytest.mark.parametrize("text", ["Hello world", "naïve café — ünïcödé ✓", "  two  spaces", "<start_of_turn>user"])
def test_tok_command_equals_llama_tokenize(model_path, text):
    ours = clickpaca("tok", "--json", text)
    assert ours.returncode == 0, ours.stderr
    assert json.loads(ours.stdout)[0]["ids"] == native_tokenize(model_path, text)


def test_tok_ids_and_search(model_path):
    r = clickpaca("tok", str(model_path), "--id", "106", "9079")
    assert r.returncode == 0 and "<end_of_turn>" in r.stdout and "Paris" in r.stdout
    r = clickpaca("tok", "--search", "llama", "--json")
    hits = json.loads(r.stdout)
    assert hits and all("llama" in h["piece"] for h in hits)
    r = clickpaca("tok", "--id", "999999999")
    assert r.returncode != 0 and "outside the vocabulary" in r.stderr


def test_greedy_decode_equals_llama_completion(model, model_path):
    prompt = "The capital of France is"
    ctx = Context(model, n_ctx=512, n_seq_max=1, n_batch=64)
    batch = Batch(model.nat, 64)
    toks = model.tokenize(prompt)
    batch.add(toks, 0, 0)
    assert ctx.decode(batch) == 0
    out, pos = [], len(toks)
    for _ in range(32):
        t = int(np.argmax(ctx.logits()[0]))
        if model.is_eog(t):
            break
        out.append(t)
        batch.clear()
        batch.add([t], pos, 0)
        pos += 1
        assert ctx.decode(batch) == 0
    ctx.close()
    exe = build_dir(TEST_BUILD) / "bin" / "llama-completion"
    native = subprocess.run([str(exe), "-m", str(model_path), "-p", prompt, "-n", "32", "--temp", "0",
                             "-no-cnv", "--no-display-prompt", "-t", "2", "-c", "512"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert native.returncode == 0
    assert model.detokenize(out) == native.stdout.rstrip("\n")


def test_logits_view_is_zero_copy_and_shaped(model):
    ctx = Context(model, n_ctx=256, n_seq_max=2, n_batch=32)
    batch = Batch(model.nat, 32)
    batch.add(model.tokenize("a b c"), 0, 0, output_all=True)
    assert ctx.decode(batch) == 0
    lg = ctx.logits()
    assert lg.shape == (4, model.n_vocab) and not lg.flags.owndata
    assert np.isfinite(lg).all()
    assert ctx.seq_pos_max(0) == 3
    ctx.seq_cp(0, 1)
    assert ctx.seq_pos_max(1) == 3
    ctx.seq_rm(0)
    assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == 3
    ctx.close()


def resident_bytes(lo: int, hi: int) -> int:
    """Bytes of the whole pages in [lo, hi) that are in memory (mincore(2))."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-lo // page) * page, hi // page * page
    n = (hi - lo) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_release_logits_gives_the_rows_pages_back(model):
    """A decode that outputs 512 rows writes 512 MiB of logits into llama.cpp's output
    buffer, kept for the context's life; release_logits(64) gives back the pages past
    row 64 (found by address, whatever mapping the buffer shares) and keeps the first 64."""
    ctx = Context(model, n_ctx=1024, n_seq_max=1, n_batch=512)
    try:
        toks = model.tokenize(" ".join(f"word{i} is here." for i in range(95)))[:512]
        batch = Batch(model.nat, 512)
        batch.add(toks, 0, 0, output_all=True)
        assert ctx.decode(batch) == 0
        rows = ctx.n_outputs
        assert rows == len(toks) >= 400
        lg = ctx.logits()
        kept = lg[:64].copy()
        base = int(model.nat.ffi.cast("uintptr_t", model.nat.lib.llama_get_logits(ctx.ptr)))
        row = model.n_vocab * 4
        past = (base + 64 * row, base + rows * row)
        assert resident_bytes(*past) >= (rows - 65) * row  # written, so in memory
        freed = ctx.release_logits(64)
        assert freed >= (rows - 65) * row, (freed, rows)
        assert resident_bytes(*past) == 0
        assert np.array_equal(lg[:64], kept)
        assert not lg[65:rows - 1].any()  # fresh zero pages (the end rows' part pages stay)
        assert ctx.release_logits(64) == 0  # nothing written past 64 since
    finally:
        ctx.close()


def test_cache_types_come_from_the_build(model):
    types = cache_types(model.nat)
    assert {"f16", "q8_0", "q4_0"} <= set(types)
    assert types["f16"] == int(model.nat.lib.GGML_TYPE_F16)


def test_model_resolution_order(tmp_path, model_path):
    assert clickpaca("model").stdout.strip() == str(resolve_model())
    r = clickpaca("model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and "not found" in r.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    r = clickpaca("model", env={"CLICKPACA_MODEL": str(junk)})
    assert r.returncode == 1 and "not a GGUF" in r.stderr
    cache = tmp_path / "llama-cache"
    cache.mkdir()
    (cache / DEFAULT_MODEL_FILE).symlink_to(model_path)
    r = clickpaca("model", env={"LLAMA_CACHE": str(cache), "CLICKPACA_MODEL": ""})
    assert r.stdout.strip() == str(cache / DEFAULT_MODEL_FILE)


def test_check_gguf_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        check_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match="not a file"):
        check_gguf(tmp_path)
