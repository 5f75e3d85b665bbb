"""clickpaca.activations.capture: node names, encoding, and rows copied from real decodes
(checked against opdump's full dump of the same node, and across sequences)."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.activations import capture as C
from clickpaca.llama.opdump import OpRecorder

GRAPH = ["norm-0", "attn_norm-0", "l_out-0", "attn_norm-1", "l_out-1", "result_norm", "node_9",
         "Kcur-0 (view)"]


def test_validate_names_the_unknown_node_and_lists_the_valid_ones():
    assert C.validate(["l_out-1", "l_out-1", "result_norm"], GRAPH) == ["l_out-1", "result_norm"]
    with pytest.raises(C.CaptureError) as e:
        C.validate(["l_out-7"], GRAPH)
    assert e.value.field == "capture"
    msg = str(e.value)
    assert "'l_out-7'" in msg and "l_out-{0..1}" in msg and "norm-0" in msg and "result_norm" in msg
    assert "node_9" not in msg and "(and 2 unnamed nodes and views)" in msg
    with pytest.raises(C.CaptureError, match="list of graph node names"):
        C.validate("l_out-1", GRAPH)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_encode_round_trip_states_the_shape(dtype, tmp_path):
    a = np.random.default_rng(0).normal(size=(3, 640)).astype(np.float32)
    p = C.encode(a, dtype)
    assert p["shape"] == [3, 640] and p["dtype"] == dtype
    back = C.decode(p)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, a.astype(dtype))
    f = C.payload(a, dtype, tmp_path / "cap.npy", max_inline_bytes=100)
    assert f["file"].endswith("cap.npy") and np.array_equal(np.load(f["file"]), a.astype(dtype))
    assert "data" in C.payload(a, dtype, tmp_path / "x.npy")  # small: inline
    with pytest.raises(C.CaptureError, match="captureDtype"):
        C.encode(a, "int8")


@pytest.fixture(scope="module")
def det_model(model_path):
    m = core.Model(model_path, repack=False)
    yield m
    m.close()


def _ctx(model, cb):
    return core.Context(model, n_ctx=256, n_batch=64, n_seq_max=2, flash_attn="off", eval_callback=cb)


@pytest.mark.model
def test_graph_nodes_are_the_models(det_model):
    names = C.graph_nodes(det_model)
    layers = det_model.n_layer
    assert {f"l_out-{i}" for i in range(layers)} <= set(names)
    assert {"attn_norm-0", "result_norm", "result_output"} <= set(names)
    assert f"l_out-{layers}" not in names
    # attention without FA: listed by the graph, laid out per head, so not offered (issue 43)
    off = C.graph(det_model, flash_attn="off")
    assert "kq_soft_max-0" not in off.names and "outermost dimension" in off.excluded["kq_soft_max-0"]
    g = C.graph(det_model)
    for name in ("Qcur-3", "Kcur-3", "Vcur-3", "norm-3"):  # one name, several nodes per decode
        assert name not in g.names and "gives this name to" in g.excluded[name]
    assert C.graph_nodes(det_model) is names  # listed once per setting


@pytest.mark.model
def test_captured_rows_equal_opdumps_full_dump_and_stay_per_sequence(det_model):
    """Two sequences in one batch: each gets only its rows, equal bit for bit to the same
    node in opdump's dump of the same decode settings (whole graph node by node), the
    last layer's (output rows only) included."""
    m = det_model
    t0, t1 = m.tokenize("The quick brown fox"), m.tokenize("Hello there my friend, how are")
    n0, n = len(t0), len(t0) + len(t1)
    nodes = ["attn_norm-0", "l_out-5", f"l_out-{m.n_layer - 1}"]

    def fill(batch):
        batch.add(t0, 0, 0)
        batch.add(t1, 0, 1, output_all=True)

    cap = C.Capture(m.nat)
    ctx = _ctx(m, cap.callback)
    batch = core.Batch(m.nat, 64)
    fill(batch)
    cap.arm(nodes, {"a": [n0 - 1], "b": list(range(n0, n))}, batch)
    assert ctx.decode(batch) == 0
    got = cap.take()
    logits = ctx.logits().copy()
    ctx.close()

    rec = OpRecorder(m.nat, keep=tuple(nodes))
    ctx = _ctx(m, rec.callback)
    batch = core.Batch(m.nat, 64)
    fill(batch)
    rec.armed = True
    assert ctx.decode(batch) == 0
    assert np.array_equal(ctx.logits(), logits)  # capturing changed no bit of the logits
    ctx.close()
    dump = {x.name: x.data for x in rec.evals[0].nodes if x.name in nodes}

    assert set(got) == {"a", "b"}
    for name in nodes[:2]:
        full = dump[name].reshape(n, -1)
        assert got["a"][name].shape == (1, m.n_embd) and got["b"][name].shape == (n - n0, m.n_embd)
        assert np.array_equal(got["a"][name], full[n0 - 1:n0])
        assert np.array_equal(got["b"][name], full[n0:n])
    last = dump[nodes[2]].reshape(-1, m.n_embd)  # the output rows: a's last token, then all of b
    assert last.shape[0] == 1 + n - n0
    assert np.array_equal(got["a"][nodes[2]], last[:1]) and np.array_equal(got["b"][nodes[2]], last[1:])
    assert not np.array_equal(got["a"]["l_out-5"][0], got["b"]["l_out-5"][-1])


@pytest.mark.model
def test_a_sequences_rows_do_not_depend_on_its_neighbour(det_model):
    """The rows taken for one sequence are its own: a per-token node equals the same
    sequence decoded alone bit for bit (attn_norm-0 mixes no tokens)."""
    m = det_model
    t0, t1 = m.tokenize("Once upon a time"), m.tokenize("The weather today is")
    cap = C.Capture(m.nat)
    ctx = _ctx(m, cap.callback)
    batch = core.Batch(m.nat, 64)
    batch.add(t0, 0, 0)
    batch.add(t1, 0, 1)
    cap.arm(["attn_norm-0"], {1: list(range(len(t0), len(t0) + len(t1)))}, batch)
    assert ctx.decode(batch) == 0
    both = cap.take()[1]["attn_norm-0"]
    ctx.clear()
    batch.clear()
    batch.add(t1, 0, 1)
    cap.arm(["attn_norm-0"], {1: list(range(len(t1)))}, batch)
    assert ctx.decode(batch) == 0
    alone = cap.take()[1]["attn_norm-0"]
    ctx.close()
    assert np.array_equal(both, alone)


@pytest.mark.model
def test_unarmed_declines_and_bad_requests_are_errors(det_model):
    m = det_model
    cap = C.Capture(m.nat)
    ctx = _ctx(m, cap.callback)
    batch = core.Batch(m.nat, 64)
    toks = m.tokenize("Hello world")
    batch.add(toks, 0, 0)
    assert ctx.decode(batch) == 0  # unarmed: nothing copied, nothing raised
    assert cap.take() == {}
    ctx.clear()
    cap.arm([f"l_out-{m.n_layer - 1}"], {0: [0]}, batch)  # row 0 has no logits: not in that node
    assert ctx.decode(batch) == 0
    with pytest.raises(C.CaptureError, match="only the output rows"):
        cap.take()
    with pytest.raises(C.CaptureError, match="outside the batch"):
        cap.arm(["l_out-1"], {0: [len(toks)]}, batch)
    ctx.close()


@pytest.mark.model
def test_several_micro_batches_are_refused(det_model):
    m = det_model
    cap = C.Capture(m.nat)
    ctx = core.Context(m, n_ctx=256, n_batch=64, n_ubatch=4, n_seq_max=1, flash_attn="off",
                       eval_callback=cap.callback)
    batch = core.Batch(m.nat, 64)
    toks = m.tokenize("one two three four five six seven")
    batch.add(toks, 0, 0)
    cap.arm(["l_out-2"], {0: [len(toks) - 1]}, batch)
    assert ctx.decode(batch) == 0
    with pytest.raises(C.CaptureError, match="more micro-batches than the 1 expected"):
        cap.take()
    ctx.close()


def test_micro_batches_follow_llama_cpps_split():
    assert C.micro_batches([0, 0, 0, 1, 1], 2, streams=False) == [[0, 1], [2, 3], [4]]
    # one stream per sequence: consecutive ids in order of first appearance, equal shares
    assert C.micro_batches([0, 1, 2], 8, streams=True) == [[0, 1, 2]]
    assert C.micro_batches([1, 0], 8, streams=True) == [[0], [1]]
    assert C.micro_batches([0, 2, 1], 8, streams=True) == [[0, 2], [1]]
    assert C.micro_batches([0, 0, 0, 1], 8, streams=True) == [[0, 3], [1, 2]]
    assert C.micro_batches([3, 3, 3, 3, 3], 2, streams=True) == [[0, 1], [2, 3], [4]]


@pytest.mark.model
@pytest.mark.parametrize("streams", [False, True])
def test_rows_of_several_micro_batches_equal_opdumps_dump(det_model, streams):
    """A batch llama.cpp splits (small nUbatch; one KV stream per sequence with the slots
    out of order): each key's rows equal opdump's per-evaluation dump of the same decode."""
    m = det_model
    t0, t1 = m.tokenize("one two three four five"), m.tokenize("six seven eight")
    nodes = ("attn_norm-1", "l_out-4", f"l_out-{m.n_layer - 1}")

    def decode(cb):
        ctx = core.Context(m, n_ctx=256, n_batch=64, n_ubatch=4 if not streams else 64, n_seq_max=2,
                           flash_attn="off", kv_unified=not streams, eval_callback=cb)
        batch = core.Batch(m.nat, 64)
        batch.add(t1, 0, 1)  # slot 1 first: with streams, two micro-batches
        batch.add(t0, 0, 0, output_all=True)
        return ctx, batch

    cap = C.Capture(m.nat)
    ctx, batch = decode(cap.callback)
    ub = C.micro_batches(batch.seq[:batch.n], 4 if not streams else 64, streams)
    assert len(ub) > 1
    n1 = len(t1)
    cap.arm_each({"a": (nodes, list(range(n1, batch.n))), "b": (nodes[:2], list(range(n1)))}, batch, ub)
    assert ctx.decode(batch) == 0
    got = cap.take()
    ctx.close()

    rec = OpRecorder(m.nat, keep=nodes)
    ctx, batch = decode(rec.callback)
    rec.armed = True
    assert ctx.decode(batch) == 0
    ctx.close()
    assert len(rec.evals) == len(ub)
    full = {name: {} for name in nodes}
    logits = batch.logits[:batch.n]
    for rows, ev in zip(ub, rec.evals):
        out = [r for r in rows if logits[r]]
        for x in ev.nodes:
            if x.name in nodes:
                data = x.data.reshape(-1, m.n_embd)
                order = rows if len(data) == len(rows) else out
                full[x.name].update(zip(order, data))
    for key, rows_, names in (("a", range(n1, batch.n), nodes), ("b", range(n1), nodes[:2])):
        for name in names:
            assert np.array_equal(got[key][name], np.stack([full[name][r] for r in rows_])), (key, name)


def test_a_rows_bytes_span_its_lower_dimensions():
    f32 = 4
    assert C.row_bytes([640, 7, 1, 1], [4, 2560, 17920, 17920], 1, f32) == 2560
    # a view whose rows sit further apart than they are long: the row only, not the gap
    assert C.row_bytes([64, 3, 5, 1], [4, 512, 2048, 10240], 2, f32) == 63 * 4 + 2 * 512 + 4


@pytest.mark.model
def test_rows_copied_as_from_a_device_equal_the_host_copy(det_model, monkeypatch):
    """The device path (ggml_backend_tensor_get, row by row: what a GPU build's capture
    takes) run on this CPU build's tensors gives the host path's rows bit for bit."""
    m = det_model
    t0, t1 = m.tokenize("The quick brown fox"), m.tokenize("Hello there my friend")
    nodes = ["attn_norm-0", "l_out-3", f"l_out-{m.n_layer - 1}"]

    def run(on_host: bool):
        cap = C.Capture(m.nat)
        monkeypatch.setattr(cap, "on_host", lambda t: on_host)
        ctx = _ctx(m, cap.callback)
        batch = core.Batch(m.nat, 64)
        batch.add(t0, 0, 0)
        batch.add(t1, 0, 1, output_all=True)
        cap.arm(nodes, {"a": [len(t0) - 1], "b": list(range(len(t0), len(t0) + len(t1)))}, batch)
        assert ctx.decode(batch) == 0
        got = cap.take()
        ctx.close()
        return got

    host, device = run(True), run(False)
    assert set(host) == set(device) == {"a", "b"}
    for key in host:
        for name in nodes:
            assert host[key][name].shape == device[key][name].shape
            assert np.array_equal(host[key][name], device[key][name])
