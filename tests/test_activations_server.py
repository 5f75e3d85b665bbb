"""Per-sequence control vectors through the real server (docs/ACTIVATIONS.md, #28).

The activations build (native/activations) adds init's directions to each token scaled by
its sequence's strength. In deterministic mode, a sequence's numbers do not depend on its
batch neighbours, and a strength of 0 adds exactly 0: so strength 0 is bit for bit the run
without a vector, and an unsteered sequence beside a steered one is bit for bit the run
alone (`==` on the events). Against upstream's context-wide vector (llama_set_adapter_cvec
on the mainline build, scaled by s at init) a strength of s agrees up to the near-tie rule
(conftest.NEAR_TIE): another build and another graph. The mainline build refuses a
per-request strength, naming the field and the build that has it.

These need builds/activations (`make activations`; `make test` builds it): a missing build
fails the init, never skips.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest

from clickpaca.activations import cvec
from clickpaca.wire.client import Client, ServerError
from conftest import NEAR_TIE

pytestmark = [pytest.mark.model, pytest.mark.activations]

PROMPTS = ["The movie was", "My day at the office was", "The food at the restaurant"]
N_GEN = 12
N_TOP = 5
LAYERS = [3, 9]
N_EMBD = 640  # Gemma 3 270M


@pytest.fixture(scope="module")
def vector_path(tmp_path_factory) -> str:
    """A fixed random direction per layer, about the residual stream's size at these depths."""
    rng = np.random.default_rng(28)
    dirs = {il: rng.normal(scale=4.0, size=N_EMBD).astype(np.float32) for il in range(1, 18)}
    return str(cvec.write_gguf(tmp_path_factory.mktemp("cv") / "random.gguf", dirs, "gemma3"))


def spawn(build: str, **init) -> Client:
    c = Client.spawn("--allow-any-path")
    c.init(nCtx=2048, nSeqMax=8, build=build, deterministic=True, cacheTypeK="f16", cacheTypeV="f16",
           stateDir=tempfile.mkdtemp(prefix="clkp-state-"), **init)
    return c


@pytest.fixture(scope="module")
def plain():
    c = spawn("activations")
    yield c
    c.close()


@pytest.fixture(scope="module")
def steered(vector_path):
    c = spawn("activations", controlVector=vector_path, controlVectorLayers=LAYERS)
    yield c
    c.close()


def run_of(toks: list[dict]) -> list:
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def greedy(c: Client, seq_id: int, prompt: str, **params) -> list:
    c.infer(seq_id, prompt, maxTokens=N_GEN, temperature=0, nProbs=N_TOP, **params)
    toks, done = c.collect(seq_id, timeout=300)
    assert done["type"] == "done", done
    return run_of(toks)


def together(c: Client, reqs: dict[int, tuple[str, float | None]]) -> dict[int, list]:
    """Every infer in one write, so they share the ticks; each sequence's run."""
    lines = []
    for s, (prompt, strength) in reqs.items():
        r = {"type": "infer", "seq_id": s, "prompt": prompt, "maxTokens": N_GEN, "temperature": 0,
             "nProbs": N_TOP}
        if strength is not None:
            r["controlVectorStrength"] = strength
        lines.append(json.dumps(r).encode() + b"\n")
    c.send_raw(b"".join(lines))
    out = {}
    for s in reqs:
        toks, done = c.collect(s, timeout=300)
        assert done["type"] == "done", done
        out[s] = run_of(toks)
    return out


def test_ready_reports_the_vector(steered):
    assert steered.ready["build"] == "activations"
    assert steered.ready["controlVector"] == {"layers": LAYERS, "nLayers": 7, "strength": 1.0, "perSequence": True}


def test_strength_zero_is_bit_identical_to_no_vector(plain, steered):
    for prompt in PROMPTS:
        alone = greedy(plain, 0, prompt)
        assert greedy(steered, 0, prompt, controlVectorStrength=0) == alone
        # init's strength (1) steers a request that gives none: the vector is really there
        assert greedy(steered, 0, prompt) != alone


def test_a_steered_neighbour_leaves_an_unsteered_sequence_as_it_runs_alone(steered):
    alone = {p: greedy(steered, 0, p, controlVectorStrength=0) for p in PROMPTS}
    steered_alone = greedy(steered, 1, PROMPTS[0], controlVectorStrength=4)
    assert steered_alone[:4] != alone[PROMPTS[0]][:4]  # strength 4 moves the first tokens' numbers
    runs = together(steered, {0: (PROMPTS[0], 0), 1: (PROMPTS[0], 4), 2: (PROMPTS[1], 0), 3: (PROMPTS[1], -4),
                              4: (PROMPTS[2], 0), 5: (PROMPTS[2], 2)})
    assert runs[0] == alone[PROMPTS[0]] and runs[2] == alone[PROMPTS[1]] and runs[4] == alone[PROMPTS[2]]
    assert runs[1] == steered_alone  # and the steered one is itself batch-independent
    assert runs[3] != runs[2] and runs[5] != runs[4]


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)


@pytest.mark.parametrize("s", [3.0, -2.0])
def test_strength_s_matches_the_context_wide_vector_scaled_by_s(steered, vector_path, s):
    """Upstream's llama_set_adapter_cvec (mainline, the vector scaled by s at init) against
    the patched build at strength s: the same tokens up to a near tie, logprobs close."""
    wide = spawn("mainline", controlVector=vector_path, controlVectorLayers=LAYERS, controlVectorStrength=s)
    try:
        assert wide.ready["controlVector"]["perSequence"] is False
        for i, prompt in enumerate(PROMPTS):
            ref = greedy(wide, 0, prompt)
            got = greedy(steered, i, prompt, controlVectorStrength=s)
            step = first_difference(ref, got)
            upto = len(ref) if step is None else step
            assert np.allclose([x[1] for x in ref[:upto]], [x[1] for x in got[:upto]], atol=1e-3), prompt
            if step is not None:
                top = dict(ref[step][2])
                assert got[step][0] in top and top[ref[step][0]] - top[got[step][0]] < NEAR_TIE, (prompt, step)
    finally:
        wide.close()


def test_mainline_refuses_a_per_request_strength_and_steers_context_wide(vector_path, plain):
    c = spawn("mainline", controlVector=vector_path, controlVectorLayers=LAYERS)
    try:
        c.infer(0, PROMPTS[0], maxTokens=4, controlVectorStrength=2)
        toks, ev = c.collect(0, timeout=120)
        assert toks == [] and ev["type"] == "error" and ev["request"] == "infer" and ev["seq_id"] == 0
        assert ev["message"].startswith("controlVectorStrength: build 'mainline' lacks llama_set_adapter_cvec_seq")
        assert "build 'activations' has it" in ev["message"]
        # the context-wide vector (init's, strength 1) still steers every sequence
        assert greedy(c, 0, PROMPTS[0]) != greedy(plain, 0, PROMPTS[0])
    finally:
        c.close()


def test_a_strength_without_a_vector_is_refused(plain):
    plain.infer(0, PROMPTS[0], maxTokens=4, controlVectorStrength=1)
    _, ev = plain.collect(0, timeout=120)
    assert ev["type"] == "error" and ev["message"].startswith("controlVectorStrength: this context has no control vector")


@pytest.mark.parametrize("init, message", [
    ({"controlVector": "/nonexistent/v.gguf"}, "controlVector: /nonexistent/v.gguf: no such file"),
    ({"controlVector": {"3": [1.0, 2.0]}}, "controlVector: layer 3: shape [2], the model needs [640]"),
    ({"controlVector": {"3": [0.0] * N_EMBD}, "controlVectorLayers": [3, 18]}, "controlVectorLayers: [3, 18] outside 1..17"),
])
def test_a_bad_vector_fails_init_naming_the_field(init, message):
    c = Client.spawn("--allow-any-path")
    try:
        with pytest.raises(ServerError) as e:
            c.init(nCtx=256, nSeqMax=2, build="activations", **init, timeout=120)
        assert e.value.event["request"] == "init" and e.value.event["message"].startswith(message), e.value.event
    finally:
        c.close()


def test_directions_as_data_equal_the_file(steered, vector_path):
    """A capture payload or a list per layer, sent in init, steers as the GGUF does."""
    from clickpaca.activations.capture import encode

    dirs = cvec.read_gguf(vector_path)
    data = {str(il): (encode(v, "float32") if il % 2 else v.tolist()) for il, v in dirs.items()}
    c = spawn("activations", controlVector=data, controlVectorLayers=LAYERS)
    try:
        assert greedy(c, 0, PROMPTS[0], controlVectorStrength=2) == greedy(steered, 0, PROMPTS[0], controlVectorStrength=2)
    finally:
        c.close()


def test_a_sequence_gets_inits_strength_back_when_its_request_ends(steered):
    """The slot a steered request used is back at init's strength for the next request."""
    default = greedy(steered, 0, PROMPTS[1])
    greedy(steered, 0, PROMPTS[1], controlVectorStrength=-4)
    assert greedy(steered, 0, PROMPTS[1]) == default
    steered.send_raw(json.dumps({"type": "infer", "seq_id": 0, "prompt": PROMPTS[1], "maxTokens": 200,
                                 "controlVectorStrength": -4}).encode() + b"\n"
                     + json.dumps({"type": "cancel", "seq_id": 0}).encode() + b"\n")
    assert steered.wait(0, timeout=120)["stop_reason"] == "cancelled"  # ended early
    assert greedy(steered, 0, PROMPTS[1]) == default
