"""`score` against llama-perplexity on the same text, context and cache type."""

from __future__ import annotations

import re
import subprocess

import pytest

from clickpaca.measure import corpus
from clickpaca.llama.native import build_dir
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

pytestmark = pytest.mark.model


def native_ppl(model_path, text_file, ctx: int) -> float:
    exe = build_dir(TEST_BUILD) / "bin" / "llama-perplexity"
    out = subprocess.run([str(exe), "-m", str(model_path), "-f", str(text_file), "-c", str(ctx),
                          "-b", str(ctx), "-t", "2", "-fa", "on", "-ctk", TEST_CACHE_K, "-ctv", TEST_CACHE_V],
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    assert m, (out.stdout + out.stderr)[-3000:]
    return float(m.group(1))


def test_score_agrees_with_llama_perplexity(server, model_path, tmp_path):
    text = corpus.text("hamlet_gut.txt")[2000:14000]  # about 3,000 tokens: 5 windows of 512
    f = tmp_path / "hamlet.txt"
    f.write_text(text)
    scored = server.score(12, text, window=512)
    assert scored["type"] == "scored" and scored["windows"] >= 4
    assert scored["tokens"] == scored["windows"] * (512 - 1 - 256)
    theirs = native_ppl(model_path, f, 512)
    assert abs(scored["ppl"] - theirs) / theirs < 0.01, (scored["ppl"], theirs)


def test_score_on_a_held_or_running_seq_id_says_which(server):
    """A score never continues a sequence: on a held seq_id the error says it is held (it
    said "already active"), on a running one that it is active; both sequences go on."""
    held = server.request({"type": "prefill", "seq_id": 14, "prompt": "The capital of France is"})
    assert held["type"] == "prefilled"
    server.send({"type": "score", "seq_id": 14, "text": "Paris is the capital of France."})
    (ev,) = list(server.stream(14))
    assert ev == {"type": "error", "seq_id": 14, "request": "score",
                  "message": "seq_id: sequence 14 is held; a score takes a free seq_id (it never "
                             "continues a held sequence: free it first)"}, ev
    server.infer(14, " Paris", maxTokens=2)  # still held: it continues (and its end frees it)
    assert server.collect(14)[1]["type"] == "done"
    assert server.score(14, "Paris is the capital of France.")["type"] == "scored"  # free now
    server.infer(15, "Tell me a long story.", maxTokens=200, temperature=0.8, seed=2)
    server.send({"type": "score", "seq_id": 15, "text": "Paris is the capital of France."})
    events = list(server.stream(15))
    errors = [e for e in events if e["type"] == "error"]
    assert errors[0]["message"] == "seq_id: sequence 15 is already active", errors
    server.cancel(15)
    assert list(server.stream(15))[-1]["type"] == "done"


def test_score_short_text_and_per_token(server):
    scored = server.score(13, "The capital of France is Paris.", perToken=True)
    assert scored["windows"] == 1
    assert len(scored["token_nll"]) == scored["tokens"] == 7  # every token after <bos>
    assert scored["ppl"] > 1.0


def test_score_last_scores_the_tail_of_each_window(server):
    from clickpaca.wire.client import ServerError

    text = corpus.text("hamlet_gut.txt")[2000:6000]  # about 1,000 tokens: 3 windows of 256
    half = server.score(14, text, window=256, perToken=True)
    same = server.score(15, text, window=256, scoreLast=128, perToken=True)
    assert same["token_nll"] == half["token_nll"]  # window/2 is the default
    tail = server.score(14, text, window=256, scoreLast=32, perToken=True)
    assert tail["windows"] == half["windows"] >= 3
    assert tail["tokens"] == tail["windows"] * (32 - 1)
    per_window = 256 - 1 - 128
    # each window's last 31 scored tokens are the same positions seen through the same cells
    for w in range(half["windows"]):
        mine = tail["token_nll"][w * 31:(w + 1) * 31]
        theirs = half["token_nll"][(w + 1) * per_window - 31:(w + 1) * per_window]
        assert mine == theirs
    for bad in (256, 300):  # one rule (scoring.check_score_last), naming the field
        with pytest.raises(ServerError, match=rf"^scoreLast: must be 2 to window - 1 \(255\), got {bad}$"):
            server.score(15, text, window=256, scoreLast=bad)
    with pytest.raises(ServerError, match=r"^scoreLast: must be 2 to window - 1 \(\d+\), got 100000$"):
        server.score(15, text, scoreLast=100000)  # against the default window
    with pytest.raises(ServerError, match=r"^scoreLast: must be >= 2, got 1$"):
        server.score(15, text, window=256, scoreLast=1)  # at the edge: needs only the request
