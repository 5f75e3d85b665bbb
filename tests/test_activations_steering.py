"""Each request's own steering vectors through the real server (activations/steering.py,
native/activations: K slots, a strengths input per token and layer, in-graph gates).

Deterministic mode, as tests/test_activations_server.py: a sequence's numbers do not
depend on its batch neighbours, and a slot at strength 0 adds exactly 0. So an unsteered
sequence beside steered ones is bit for bit its run alone, a steered one is bit for bit
its steered run alone, each trigger equals the run given the same positions by hand
(from / until as token indices), a gate that never opens is the unsteered run and one at
-inf the unconditional run (`==` on the events). Needs builds/activations: a missing
build fails the init, never skips.
"""

from __future__ import annotations

import json
import tempfile
import time

import numpy as np
import pytest

from clickpaca.activations import cvec
from clickpaca.activations.capture import decode, encode
from clickpaca.wire.client import Client, ServerError

pytestmark = [pytest.mark.model, pytest.mark.activations]

PROMPTS = ["The movie was", "My day at the office was", "The food at the restaurant"]
N_GEN = 10
N_EMBD = 640  # Gemma 3 270M
N_LAYER = 18


def directions(seed: int, scale: float = 4.0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {il: rng.normal(scale=scale, size=N_EMBD).astype(np.float32) for il in range(1, N_LAYER)}


@pytest.fixture(scope="module")
def vector_path(tmp_path_factory) -> str:
    return str(cvec.write_gguf(tmp_path_factory.mktemp("cv") / "a.gguf", directions(57), "gemma3"))


def spawn(build: str = "activations", **init) -> Client:
    c = Client.spawn("--allow-any-path")
    c.init(nCtx=2048, nSeqMax=8, build=build, deterministic=True, cacheTypeK="f16", cacheTypeV="f16",
           stateDir=tempfile.mkdtemp(prefix="clkp-state-"), **init)
    return c


@pytest.fixture(scope="module")
def srv(vector_path):
    c = spawn()
    c.vector("a", vector_path)
    c.vector("b", {str(il): v.tolist() for il, v in directions(58).items()})
    yield c
    c.close()


def run_of(toks: list[dict]) -> list:
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def infer_line(seq_id: int, prompt: str, steer: list | None, n: int = N_GEN) -> bytes:
    r = {"type": "infer", "seq_id": seq_id, "prompt": prompt, "maxTokens": n, "temperature": 0, "nProbs": 5}
    if steer is not None:
        r["steer"] = steer
    return json.dumps(r).encode() + b"\n"


def together(c: Client, reqs: dict[int, tuple[str, list | None]]) -> dict[int, list]:
    """Every infer in one write, so they share the ticks; each sequence's run."""
    c.send_raw(b"".join(infer_line(s, p, st) for s, (p, st) in reqs.items()))
    out = {}
    for s in reqs:
        toks, done = c.collect(s, timeout=300)
        assert done["type"] == "done", done
        out[s] = run_of(toks)
    return out


def alone(c: Client, prompt: str, steer: list | None = None, seq_id: int = 0) -> list:
    return together(c, {seq_id: (prompt, steer)})[seq_id]


def n_tokens(c: Client, prompt: str) -> int:
    ev = c.request({"type": "prefill", "seq_id": 7, "prompt": prompt})
    c.request({"type": "free", "seq_id": 7})
    return ev["tokens"]


def test_vector_ready_reports_layers_norms_and_slot(srv, vector_path):
    ev = srv.vector("c", vector_path)
    try:
        assert ev["layers"] == list(range(1, N_LAYER)) and ev["slot"] == 2
        want = {str(il): float(np.linalg.norm(v)) for il, v in directions(57).items()}
        assert ev["norms"].keys() == want.keys()
        assert all(abs(ev["norms"][k] - want[k]) < 1e-3 for k in want)
    finally:
        srv.free_vector("c")


def capture_payload(v: list[float]) -> dict:
    return encode(np.asarray(v, dtype=np.float32), "float32")


@pytest.mark.parametrize("vector, message", [
    ({"3": [1.0, 2.0]}, "vector: layer 3: shape [2], the model needs n_embd [640]"),
    ({"3": capture_payload([float("nan")] * N_EMBD)}, "vector: layer 3: must be finite numbers"),
    ({"40": [0.0] * N_EMBD}, "vector: layer 40: unknown, the model's are 1..17"),
    ({str(il): [0.0] * 4 for il in range(1, 30)}, "vector: 29 layers, the model has 17 that can be steered"),
    (__file__, f"vector: {__file__}: not a control-vector GGUF"),
])
def test_a_bad_vector_is_refused_naming_the_field(srv, vector, message):
    with pytest.raises(ServerError) as e:
        srv.vector("bad", vector)
    assert e.value.event["request"] == "vector" and e.value.event["message"].startswith(message), e.value.event
    assert alone(srv, PROMPTS[0], [{"vector": "a", "strength": 1}])  # the server goes on serving


def test_an_unknown_vector_is_refused_naming_the_entry(srv):
    srv.send_raw(infer_line(0, PROMPTS[0], [{"vector": "a", "strength": 1}, {"vector": "zz", "strength": 1}]))
    toks, ev = srv.collect(0, timeout=120)
    assert toks == [] and ev["type"] == "error"
    assert ev["message"].startswith("steer: [1].vector: unknown vector 'zz'"), ev


def test_neighbours_leave_each_sequence_as_it_runs_alone(srv):
    """Unsteered, steered, two vectors added, a trigger and a gate, in one batch."""
    a, b = {"vector": "a", "strength": 1.5}, {"vector": "b", "strength": -1.0, "layers": "4-12"}
    gated = {"vector": "b", "strength": 2.0, "when": {"vector": "a", "layer": 2, "above": 0.0}}
    reqs = {0: (PROMPTS[0], None), 1: (PROMPTS[0], [a]), 2: (PROMPTS[1], [a, b]),
            3: (PROMPTS[2], [dict(a, **{"from": "generated"})]), 4: (PROMPTS[1], [gated]), 5: (PROMPTS[2], None)}
    solo = {s: alone(srv, p, st) for s, (p, st) in reqs.items()}
    assert solo[1] != solo[0] and solo[2] != alone(srv, PROMPTS[1])  # the vectors really steer
    assert together(srv, reqs) == solo


def test_a_steered_prefill_is_never_another_prompts_prefix(srv):
    """A sequence prefilled with steering holds steered cells, and so does its fork: an
    unsteered infer whose prompt begins with that text computes its own cells, bit for bit
    as with nothing held (deterministic mode promises the same across reused state)."""
    prompt = PROMPTS[0] + " better than the book, and"
    cold = alone(srv, prompt)
    ev = srv.request({"type": "prefill", "seq_id": 6, "prompt": PROMPTS[0],
                      "steer": [{"vector": "a", "strength": 1.5}]})
    assert ev["type"] == "prefilled", ev
    assert srv.request({"type": "fork", "seq_id": 6, "dst_seq_id": 7})["type"] == "forked"
    held = [6, 7]
    try:
        assert alone(srv, prompt) == cold  # neither held sequence lent its cells
        srv.request({"type": "free", "seq_id": held.pop(0)})
        assert alone(srv, prompt) == cold  # the fork alone did not either
    finally:
        for s in held:
            srv.request({"type": "free", "seq_id": s})


def test_from_generated_equals_the_prompt_length_by_hand(srv):
    n = n_tokens(srv, PROMPTS[0])
    plain = alone(srv, PROMPTS[0])
    gen = alone(srv, PROMPTS[0], [{"vector": "a", "strength": 1.5, "from": "generated"}])
    assert gen == alone(srv, PROMPTS[0], [{"vector": "a", "strength": 1.5, "from": n}])
    assert gen[0] == plain[0]  # the prompt is unsteered: the first token's row is the plain one
    assert gen != plain


def test_until_equals_steering_the_first_tokens_by_hand(srv):
    n = n_tokens(srv, PROMPTS[1])
    steer = [{"vector": "a", "strength": 1.5, "until": n + 2}]
    got = alone(srv, PROMPTS[1], steer)
    ref = alone(srv, PROMPTS[1], [{"vector": "a", "strength": 1.5, "from": 0, "until": n + 2}])
    assert got == ref and got != alone(srv, PROMPTS[1], [{"vector": "a", "strength": 1.5}])
    # a window no token reaches is the unsteered run, bit for bit
    assert alone(srv, PROMPTS[1], [{"vector": "a", "strength": 1.5, "from": 5000}]) == alone(srv, PROMPTS[1])


def test_after_a_generated_token_starts_one_past_it(srv):
    """`after` the k-th generated token: the run equals steering from its position + 1 by
    hand, and the tokens up to the one after it are the unsteered run's."""
    n = n_tokens(srv, PROMPTS[2])
    plain = alone(srv, PROMPTS[2])
    k = 2
    token = plain[k][0]
    first = next(i for i, t in enumerate(plain) if t[0] == token)
    got = alone(srv, PROMPTS[2], [{"vector": "a", "strength": 2.0, "after": token}])
    assert got == alone(srv, PROMPTS[2], [{"vector": "a", "strength": 2.0, "from": n + first + 1}])
    assert got[:first + 2] == plain[:first + 2] and got != plain


def test_after_a_string_in_the_prompt(srv):
    prompt = "Review: The movie was"
    got = alone(srv, prompt, [{"vector": "a", "strength": 2.0, "after": "Review:"}])
    # "Review:" ends in the prompt's first tokens (BOS, "Review", ":"): steering from index 3
    n_head = n_tokens(srv, "Review:")
    assert got == alone(srv, prompt, [{"vector": "a", "strength": 2.0, "from": n_head}])
    assert got != alone(srv, prompt, [{"vector": "a", "strength": 2.0}])


def test_a_gate_that_never_opens_is_unsteered_and_at_minus_inf_unconditional(srv):
    entry = {"vector": "b", "strength": 2.0}
    plain = alone(srv, PROMPTS[0])
    never = alone(srv, PROMPTS[0], [dict(entry, when={"vector": "a", "layer": 1, "above": 1e30})])
    assert never == plain
    always = alone(srv, PROMPTS[0], [dict(entry, when={"vector": "a", "layer": 1, "above": "-inf"})])
    assert always == alone(srv, PROMPTS[0], [entry]) and always != plain


def traced(c: Client, L: int, above) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An infer gated at layer L with the trace captured: projection, gate, l_out-L per token."""
    c.send({"type": "infer", "seq_id": 0, "prompt": PROMPTS[1], "maxTokens": 6, "temperature": 0,
            "capture": [f"steer_proj-{L}", f"steer_gate-{L}", f"l_out-{L}"], "captureTokens": "all",
            "steer": [{"vector": "b", "strength": 2.0, "layers": f"{L}-17",
                       "when": {"vector": "a", "layer": L, "above": above}}]})
    _, done = c.collect(0, timeout=300)
    assert done["type"] == "done", done
    cap = done["capture"]["nodes"]
    proj = decode(cap[f"steer_proj-{L}"]).reshape(-1)
    return proj, decode(cap[f"steer_gate-{L}"]).reshape(-1), decode(cap[f"l_out-{L}"]).reshape(len(proj), -1)


def test_the_trace_reports_each_tokens_projection_and_gate(srv):
    """capture steer_proj-L / steer_gate-L: the gate opens exactly where the projection is
    above the threshold, and the projection is the residual's own: l_out-L times the
    direction where the gate is shut (l_out-L is after layer L's steering, which the
    gate adds only where open)."""
    L = 6
    n = n_tokens(srv, PROMPTS[1])
    proj, gate, _ = traced(srv, L, "-inf")
    assert gate.tolist() == [1.0] * len(proj)
    above = float(np.median(proj[:n]))  # the prompt's projections do not depend on the gate
    proj2, gate, resid = traced(srv, L, above)
    assert np.array_equal(proj2[:n], proj[:n])
    assert set(np.unique(gate)) <= {0.0, 1.0} and 0 < gate.sum() < len(gate)  # some open, some not
    assert np.array_equal(gate == 1.0, proj2 > above)
    want = resid.astype(np.float64) @ directions(57)[L].astype(np.float64)
    shut = gate == 0
    assert np.allclose(proj2[shut], want[shut], rtol=1e-3, atol=1e-2)


def test_a_vector_freed_mid_generation_steers_its_request_to_the_end(srv, vector_path):
    """free forgets the id at once; the slot keeps its directions for the request already
    using it, which runs as it runs alone; then the slot is free again."""
    srv.vector("f", vector_path)
    steer = [{"vector": "f", "strength": 1.5}]
    ref = alone(srv, PROMPTS[2], steer, seq_id=1)
    srv.send_raw(infer_line(1, PROMPTS[2], steer))
    assert srv.free_vector("f") == {"type": "vector_freed", "id": "f"}
    toks, done = srv.collect(1, timeout=300)
    assert done["type"] == "done" and run_of(toks) == ref
    srv.send_raw(infer_line(0, PROMPTS[2], steer))
    toks, ev = srv.collect(0, timeout=120)
    assert ev["type"] == "error" and ev["message"].startswith("steer: [0].vector: unknown vector 'f'")
    slot = srv.vector("f2", vector_path)["slot"]  # the freed slot, cleared, is reused
    srv.free_vector("f2")
    assert slot == 2


def test_full_slots_are_an_error_until_one_is_free(vector_path):
    c = spawn(vectorSlots=2)
    try:
        assert c.vector("x", vector_path)["slot"] == 0 and c.vector("y", vector_path)["slot"] == 1
        with pytest.raises(ServerError) as e:
            c.vector("z", vector_path)
        assert e.value.event["message"].startswith("id: all 2 vector slots are taken"), e.value.event
        c.send_raw(infer_line(0, PROMPTS[0], [{"vector": "x", "strength": 1}], n=300))
        c.free_vector("x")  # in use: the slot stays taken until the request ends
        with pytest.raises(ServerError):
            c.vector("z", vector_path)
        c.collect(0, timeout=300)
        assert c.vector("z", vector_path)["slot"] == 0
    finally:
        c.close()


def test_reserves_count_only_the_first_vector_and_the_first_gate(vector_path):
    c = spawn()
    try:
        assert c.vector("a", vector_path)["reserves"] == 1
        gated = [{"vector": "a", "strength": 1.0, "when": {"vector": "a", "layer": 3, "above": 0.0}}]
        together(c, {0: (PROMPTS[0], [{"vector": "a", "strength": 1.0}]), 1: (PROMPTS[1], gated),
                     2: (PROMPTS[2], None)})
        assert c.vector("b", vector_path)["reserves"] == 2
        together(c, {0: (PROMPTS[1], [{"vector": "b", "strength": -1.0}]), 1: (PROMPTS[0], gated)})
        c.free_vector("b")
        assert c.vector("b", vector_path)["reserves"] == 2  # strengths, triggers, slot contents: data
    finally:
        c.close()


def test_init_control_vector_and_steer_add_up_and_score_and_prefill_take_steer(vector_path):
    c = spawn(controlVector=vector_path, controlVectorLayers=[3, 9], controlVectorStrength=0.0)
    try:
        c.vector("a", vector_path)
        plain = alone(c, PROMPTS[0])
        assert alone(c, PROMPTS[0], [{"vector": "a", "strength": 0.0}]) == plain
        c.send({"type": "score", "seq_id": 0, "text": PROMPTS[0] + " good.", "steer": [{"vector": "a", "strength": 2}]})
        steered_nll = c.wait(0)["nll"]
        assert steered_nll != c.score(0, PROMPTS[0] + " good.")["nll"]
        ev = c.request({"type": "prefill", "seq_id": 1, "prompt": PROMPTS[0], "steer": [{"vector": "a", "strength": 2}]})
        assert ev["type"] == "prefilled"
    finally:
        c.close()


def test_mainline_refuses_steer_naming_the_build(vector_path):
    c = spawn("mainline")
    try:
        with pytest.raises(ServerError) as e:
            c.vector("a", vector_path)
        assert e.value.event["message"].startswith("vector: build 'mainline' lacks llama_steer_set_slots")
        assert "build 'activations' has it" in e.value.event["message"]
        c.send_raw(infer_line(0, PROMPTS[0], [{"vector": "a", "strength": 1}]))
        _, ev = c.collect(0, timeout=120)
        assert ev["type"] == "error" and ev["message"].startswith("steer: build 'mainline' lacks"), ev
    finally:
        c.close()


def test_a_socket_clients_end_frees_its_vectors(tmp_path, vector_path):
    """One slot: a client registers (as data: a socket client names no file of the
    server's), goes away; the next client's registration gets the slot."""
    from test_socket import sessions_of, start_server, stop_server

    data = {str(il): capture_payload(v.tolist()) for il, v in directions(57).items()}
    path = tmp_path / "s.sock"
    proc = start_server(path, build="activations", vectorSlots=1, deterministic=True,
                        cacheTypeK="f16", cacheTypeV="f16")
    try:
        c = Client.connect(path)
        with pytest.raises(ServerError) as e:
            c.vector("p", vector_path)
        assert e.value.event["message"].startswith("vector: a socket client sends the directions as data")
        assert c.vector("v", data)["slot"] == 0
        with Client.connect(path) as d:
            with pytest.raises(ServerError) as e:
                d.vector("w", data)
            assert e.value.event["message"].startswith("id: all 1 vector slots are taken")
            n = sessions_of(d)
            c.close()
            deadline = time.monotonic() + 120
            while sessions_of(d) >= n:  # the step that drops c's session (test_socket's way)
                assert time.monotonic() < deadline, "the closed client's session was never dropped"
                time.sleep(0.05)
            assert d.vector("w", data)["slot"] == 0
    finally:
        stop_server(proc, path)


def test_the_workbench_registers_a_vector_and_steers_with_it(srv, vector_path):
    """wb.vector reads the GGUF on the client's side and sends it as data; generate's steer
    gives the same tokens as the protocol run on a server of the same settings."""
    from clickpaca import Workbench

    steer = [{"vector": "a", "strength": 1.5}]
    with Workbench.spawn(build="activations", nCtx=2048, nSeqMax=8, deterministic=True, cacheTypeK="f16",
                         cacheTypeV="f16", stateDir=tempfile.mkdtemp(prefix="clkp-state-")) as wb:
        ready = wb.vector("a", vector_path)
        assert ready["layers"] == list(range(1, N_LAYER)) and ready["slot"] == 0
        steered, plain = wb.generate([{"prompt": PROMPTS[0], "steer": steer}, PROMPTS[0]], temperature=0,
                                     maxTokens=N_GEN, progress=False)
    assert steered.error is None and steered.tokens == [t[0] for t in alone(srv, PROMPTS[0], steer)]
    assert plain.tokens == [t[0] for t in alone(srv, PROMPTS[0])] != steered.tokens
