"""Issue 43, "hostile clients, round three": the findings of the fuzz run over the fields
added since round two, each replayed on a real server.

(The tick's failure isolation is tests/test_tick_failures.py; two servers on one state
directory, tests/test_statedir_shared.py.)
"""

from __future__ import annotations

import pytest

from clickpaca.wire.client import Client

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


# ------------------------------------------------------------------ the smaller findings


@pytest.fixture(scope="module")
def bare():
    """A stdio server not initialised yet: a failed init leaves it so, for the next."""
    c = Client.spawn("--allow-any-path")
    yield c
    c.close()


def init_error(c: Client, **init) -> str:
    from clickpaca.wire.client import ServerError
    from conftest import TEST_BUILD

    with pytest.raises(ServerError) as e:
        c.init(nCtx=256, nSeqMax=2, build=TEST_BUILD, timeout=120, **init)
    assert e.value.event["request"] == "init", e.value.event
    return e.value.event["message"]


def test_a_control_vector_path_too_long_names_the_field(bare, tmp_path):
    long_name = str(tmp_path / ("v" * 300 + ".gguf"))
    msg = init_error(bare, controlVector=long_name)
    assert msg.startswith("controlVector: ") and "File name too long" in msg, msg
    assert len(msg) < 600  # the path is shortened in the message
    msg = init_error(bare, controlVector="/" + "d/" * 3000 + "v.gguf")
    assert msg.startswith("controlVector: a path of at most 4096 bytes"), msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_a_gguf_with_unusable_directions_is_refused_at_init(bare, tmp_path, bad):
    """The same rule as directions given as data (activations/wire.values)."""
    import numpy as np

    from clickpaca.activations import cvec

    d = np.zeros(640, np.float32)
    d[7] = bad
    path = cvec.write_gguf(tmp_path / "bad.gguf", {3: d, 4: np.ones(640, np.float32)}, "gemma3")
    msg = init_error(bare, controlVector=str(path))
    assert msg.startswith(f"controlVector: {path}: layer 3: "), msg
    assert ("finite" in msg) if bad != 3e38 else ("within +-1e+06" in msg), msg
    assert init_error(bare, controlVector={"3": [bad] * 640}).startswith("controlVector: layer 3: ")


def test_a_negative_payload_shape_is_refused(bare):
    from clickpaca.activations.capture import encode
    import numpy as np

    payload = encode(np.ones(640, np.float32), "float32")
    assert init_error(bare, controlVector={"3": {**payload, "shape": [-640]}}) == \
        "controlVector: layer 3: shape must be [n_embd] or [1, n_embd], got [-640]"
    assert init_error(bare, controlVector={"3": {**payload, "shape": [1, -640]}}).startswith(
        "controlVector: layer 3: shape must be")


def test_a_5000_digit_key_names_the_field(bare):
    msg = init_error(bare, controlVector={"9" * 5000: [1.0] * 640})
    assert msg.startswith("controlVector: layer ") and "not a layer number" in msg, msg
    bare.infer(0, "x", logit_bias={"9" * 5000: 1.0})
    _, ev = bare.collect(0, timeout=60)
    assert ev["type"] == "error" and ev["message"].startswith("logit_bias: token id"), ev


def test_capture_names_listed_are_capturable_and_the_others_say_why(tmp_path):
    """Qcur-N, Kcur-N, Vcur-N, norm-N and the cache views are not offered (llama.cpp
    names several nodes so, or they have no token dimension): asking for one says why.
    Every name the error lists as valid is captured, in requests of 64 names."""
    from clickpaca.activations import capture as C
    from clickpaca.llama import core
    from conftest import TEST_BUILD

    c = spawn_capture(tmp_path)
    try:
        for name in ("Qcur-3", "Kcur-3", "Vcur-3", "norm-3", "cache_k_l0 (view)"):
            c.infer(0, PROMPT, maxTokens=1, capture=[name])
            _, ev = c.collect(0, timeout=120)
            assert ev["type"] == "error" and ev["message"].startswith(f"capture: node {name!r} is not captured: "), ev
        model = core.Model(c.ready["model"]["path"], build=TEST_BUILD)
        try:
            names = C.graph(model, "on" if c.ready["kernels"]["flashAttn"] else "off").names
        finally:
            model.close()
        for i in range(0, len(names), 64):
            chunk = names[i:i + 64]
            c.infer(0, PROMPT, maxTokens=1, capture=chunk, captureTokens="last", captureDtype="float16")
            _, ev = c.collect(0, timeout=300)
            assert ev["type"] == "done" and sorted(ev["capture"]["nodes"]) == sorted(chunk), ev.get("message")
    finally:
        c.close()


def spawn_capture(tmp_path) -> Client:
    from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

    c = Client.spawn()
    c.init(nCtx=512, nSeqMax=2, build=TEST_BUILD, cacheTypeK=TEST_CACHE_K, cacheTypeV=TEST_CACHE_V,
           capture=True, stateDir=str(tmp_path / "state"))
    return c


# ------------------------------------------------------------------ memory


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_large_captures_memory_comes_back_when_it_ends(tmp_path):
    """A score capturing l_out-17 (a last-layer node: every row asks for logits) over a
    window of ~500 tokens writes ~500 MiB of logits rows into llama.cpp's output buffer,
    which it keeps for the context's life. Once the request is over the server gives
    those pages back (core.Context.release_logits; which pages, by address: test_core's
    test_release_logits_gives_the_rows_pages_back), so the same request again does not
    raise the process's RSS where it ends. The server says how many rows it holds (`stats`
    `logitsRows`): at most max(64, nSeqMax) once the request is over."""
    c = spawn_capture_big(tmp_path)
    try:
        text = " ".join(f"word{i} is here." for i in range(95))  # one window of ~500 tokens
        pid = c.proc.pid
        ends = []
        for _ in range(2):
            ev = c.score(1, text, window=512, capture=["l_out-17"], captureTokens="all")
            rows = ev["capture"]["nodes"]["l_out-17"]["shape"][0]
            assert ev["type"] == "scored" and rows >= 400, ev["tokens"]
            c.send({"type": "stats"})
            held = c.wait_misc({"stats"}, 120)["logitsRows"]
            assert held["held"] <= 64 and held["bytes"] == held["held"] << 20, held  # 512 before
            ends.append(rss_of(pid))
        assert ends[1] - ends[0] <= 64 << 20, [e >> 20 for e in ends]
    finally:
        c.close()


def spawn_capture_big(tmp_path) -> Client:
    from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

    c = Client.spawn()
    c.init(nCtx=2048, nSeqMax=4, nBatch=512, build=TEST_BUILD, cacheTypeK=TEST_CACHE_K, cacheTypeV=TEST_CACHE_V,
           capture=True, stateDir=str(tmp_path / "state-big"))
    return c
