"""clickpaca.llama.opdump: the recorder on the real model, and the comparison's pure parts."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.llama.opdump import Evaluation, Node, OpRecorder, compare


def node(name, data, ne, srcs=()):
    return Node(name, "MUL_MAT", ne, np.asarray(data, np.float32).reshape(ne[::-1]), list(srcs))


def test_compare_takes_the_token_slice_and_finds_the_source():
    """Token 1 of a 3-token micro-batch against token 0 of a 1-token one: the first node is
    equal there, the second differs (a source), the third only because its input does."""
    a, b = Evaluation(), Evaluation()
    a.nodes = [node("x", [[0, 0], [5, 6], [0, 0]], (2, 3, 1, 1)),
               node("y", [[0, 0], [1, 2], [0, 0]], (2, 3, 1, 1), [0]),
               node("z", [[0, 0], [3, 3], [0, 0]], (2, 3, 1, 1), [1])]
    b.nodes = [node("x", [[5, 6]], (2, 1, 1, 1)),
               node("y", [[1, 2.5]], (2, 1, 1, 1), [0]),
               node("z", [[3, 4]], (2, 1, 1, 1), [1])]
    diffs = compare(a, 3, 1, b, 1, 0)
    assert [(d.name, d.status) for d in diffs] == [("x", "same"), ("y", "source"), ("z", "differs")]
    assert diffs[1].max_abs == pytest.approx(0.5)


@pytest.mark.model
def test_the_same_decode_twice_has_no_source(model_path):
    model = core.Model(model_path, repack=False)
    runs = []
    try:
        toks = model.tokenize("The quick brown fox jumps over the lazy dog")
        for armed in (True, True, False):
            rec = OpRecorder(model.nat)
            ctx = core.Context(model, n_ctx=256, n_batch=64, n_seq_max=1, flash_attn="off",
                               eval_callback=rec.callback)
            batch = core.Batch(model.nat, 64)
            batch.add(toks, 0, 0)
            rec.armed = armed
            assert ctx.decode(batch) == 0
            runs.append((rec.evals, ctx.logits().copy()))
            ctx.close()
    finally:
        model.close()
    (ea, la), (eb, lb), (unrecorded, lc) = runs
    assert unrecorded == []  # not armed: the callback declines every node
    assert np.array_equal(la, lc)  # recording (node by node, no fusion) changes no bit
    assert len(ea) == len(eb) == 1 and len(ea[0].nodes) > 100  # every node of the graph was seen
    assert {"kq-0", "kq_soft_max-0", "ffn_out-0", "result_output"} <= {n.name for n in ea[0].nodes}
    n = len(toks)
    diffs = compare(ea[0], n, n - 1, eb[0], n, n - 1)
    assert not [d for d in diffs if d.status in ("source", "differs")]
    assert sum(d.status == "same" for d in diffs) > 100
    assert np.array_equal(la, lb)
    # the recorded final node is the logits the context hands out
    out = next(x for x in ea[0].nodes if x.name == "result_output")
    assert np.array_equal(out.data.reshape(-1, model.n_vocab)[-1], la[-1])
