"""clickpaca.activations.patching: rows written into graph nodes through the live eval
callback (the activations build's llama_set_eval_callback), on the real model: later nodes
read the written values, and unpatched rows are untouched.

Each check runs in a child process of its own: one process loads one build, and the other
tests of this process use mainline's."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from clickpaca.activations import capture as C, patching as P
from clickpaca.llama import core

pytestmark = [pytest.mark.model, pytest.mark.activations]

A, B = "The Eiffel Tower is located in the city of", "The Colosseum is located in the city of"


def _in_child(check, model_path) -> None:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        ex.submit(_with_rig, check.__name__, str(model_path)).result()


def _with_rig(name: str, model_path: str) -> None:
    with _rig(model_path) as rig:
        globals()[name](rig)


@contextmanager
def _rig(model_path):
    m = core.Model(model_path, build="activations", repack=False)
    cap = C.Capture(m.nat)
    cap.writer = P.Writer(m.nat)
    ctx = core.Context(m, n_ctx=256, n_batch=64, n_seq_max=2, flash_attn="off")
    m.nat.lib.llama_set_eval_callback(ctx.ptr, cap.callback, m.nat.ffi.NULL)
    a, b = m.tokenize(A), m.tokenize(B)
    assert len(a) == len(b)  # the two prompts are the same length in tokens
    yield m, cap, ctx, a, b
    ctx.close()
    m.close()


def _run(rig, seqs, writes=None, names=()):
    """Decode `seqs` (token lists, one sequence each, every row with logits) in one batch:
    (captured rows per sequence, patch errors, logits)."""
    m, cap, ctx, *_ = rig
    ctx.seq_rm(-1, -1, -1)
    b = core.Batch(m.nat, 64)
    starts = [b.add(list(t), 0, s, output_all=True) for s, t in enumerate(seqs)]
    rows = {s: list(range(st, st + len(t))) for s, (st, t) in enumerate(zip(starts, seqs))}
    if names:
        cap.arm(names, rows, b)
    if writes:
        cap.writer.arm({s: [P.Write(n, np.asarray(rows[s])[pos], v, mode) for n, pos, v, mode in ws]
                        for s, ws in writes.items()}, [np.arange(b.n)], b.logits[:b.n] != 0)
    assert ctx.decode(b) == 0
    got = cap.take() if names else {}
    errors = cap.writer.settle()
    cap.writer.disarm()
    return got, errors, ctx.logits().copy()


def test_a_replaced_node_is_what_every_later_node_reads(model_path):
    _in_child(replaced_node_is_what_every_later_node_reads, model_path)


def test_a_patch_stays_in_its_sequence(model_path):
    _in_child(patch_stays_in_its_sequence, model_path)


def test_rows_a_node_does_not_hold_fail_only_their_key(model_path):
    _in_child(rows_a_node_does_not_hold_fail_only_their_key, model_path)


@pytest.mark.parametrize("streams", [False, True])
def test_a_batch_split_into_micro_batches_is_patched_row_by_row(model_path, streams):
    _in_child(micro_batches_split_ok if not streams else micro_batches_streams_ok, model_path)


def micro_batches_split_ok(rig):
    _micro_batches(rig, streams=False)


def micro_batches_streams_ok(rig):
    _micro_batches(rig, streams=True)


def _micro_batches(rig, streams: bool):
    """A batch llama.cpp splits (nUbatch 4; or one KV stream per sequence with the slots out
    of order): sequence 0's prompt patched at every position with B's l_out-5 rows gives, bit
    for bit, the logits of the same batch layout with B's tokens in its place, and the other
    sequence's logits are unchanged."""
    m, cap, _, a, b = rig
    other = m.tokenize("six seven eight nine")
    n_ub = 64 if streams else 4

    def decode(first, writes=None, names=()):
        ctx = core.Context(m, n_ctx=256, n_batch=64, n_ubatch=n_ub, n_seq_max=2, flash_attn="off",
                           kv_unified=not streams)
        m.nat.lib.llama_set_eval_callback(ctx.ptr, cap.callback, m.nat.ffi.NULL)
        batch = core.Batch(m.nat, 64)
        batch.add(list(other), 0, 1, output_all=True)  # slot 1 first: with streams, two micro-batches
        batch.add(list(first), 0, 0, output_all=True)
        ub = C.micro_batches(batch.seq[:batch.n], n_ub, streams)
        assert len(ub) > 1
        rows = list(range(len(other), batch.n))
        if names:
            cap.arm_each({0: (names, rows)}, batch, ub)
        if writes is not None:
            cap.writer.arm({0: [P.Write("l_out-5", np.asarray(rows), writes)]}, ub, batch.logits[:batch.n] != 0)
        try:
            assert ctx.decode(batch) == 0
            got = cap.take() if names else {}
            errors = cap.writer.settle()
            cap.writer.disarm()
            return got, errors, ctx.logits().copy()
        finally:
            ctx.close()

    got_b, _, lb = decode(b, names=("l_out-5",))
    _, _, la = decode(a)
    _, errors, lp = decode(a, writes=got_b[0]["l_out-5"])
    assert errors == {}
    assert np.array_equal(lp, lb) and not np.array_equal(lp, la)
    k = len(other)
    assert np.array_equal(lp[:k], la[:k])  # the unpatched sequence's rows


def replaced_node_is_what_every_later_node_reads(rig):
    """Every position of l_out-L replaced by another prompt's: the logits are that prompt's,
    bit for bit (the layers after L read the written rows), at a middle layer, the last one,
    and the scaled embeddings; replacing with a sequence's own rows or adding zeros changes
    no bit."""
    m, _, _, a, b = rig
    last = f"l_out-{m.n_layer - 1}"
    nodes = ["inp_scaled", "l_out-5", last]
    (ga, _, la), (gb, _, lb) = _run(rig, [a], names=nodes), _run(rig, [b], names=nodes)
    every = np.arange(len(a))
    for node in nodes:
        _, err, lp = _run(rig, [a], {0: [(node, every, gb[0][node], "replace")]})
        assert err == {} and np.array_equal(lp, lb), node
        assert not np.array_equal(lp, la)
    _, err, lp = _run(rig, [a], {0: [("l_out-5", every, ga[0]["l_out-5"], "replace")]})
    assert err == {} and np.array_equal(lp, la)
    _, err, lp = _run(rig, [a], {0: [("l_out-5", every, np.zeros_like(ga[0]["l_out-5"]), "add")]})
    assert err == {} and np.array_equal(lp, la)
    # add: the captured node moves by exactly the added rows, at the patched positions only
    delta = np.zeros_like(ga[0]["l_out-5"])
    delta[2] = 3.0
    got, err, _ = _run(rig, [a], {0: [("l_out-5", every[2:3], delta[2:3], "add")]}, names=["l_out-5"])
    assert err == {}
    assert np.array_equal(got[0]["l_out-5"][2], ga[0]["l_out-5"][2] + 3.0)
    assert np.array_equal(got[0]["l_out-5"][:2], ga[0]["l_out-5"][:2])


def patch_stays_in_its_sequence(rig):
    """Two sequences in one batch, the second patched: the first's logits are those of the
    same batch without any patch."""
    _, _, _, a, b = rig
    _, _, plain = _run(rig, [a, b])
    _, err, lp = _run(rig, [a, b], {1: [("l_out-3", np.arange(len(b)), np.ones((len(b), 640), np.float32), "add")]})
    assert err == {}
    n = len(a)
    assert np.array_equal(lp[:n], plain[:n]) and not np.array_equal(lp[n:], plain[n:])


def rows_a_node_does_not_hold_fail_only_their_key(rig):
    """The last layer's l_out holds only rows with logits: a patch at a row without one
    fails its key, naming why, and another key's patch in the same decode is applied."""
    m, cap, ctx, a, b = rig
    last = f"l_out-{m.n_layer - 1}"
    ctx.seq_rm(-1, -1, -1)
    batch = core.Batch(m.nat, 64)
    batch.add(list(a), 0, 0)
    batch.add(list(b), 0, 1)
    n = len(a)
    cap.writer.arm({0: [P.Write(last, np.array([0]), np.zeros((1, 640), np.float32))],
                    1: [P.Write("l_out-2", np.array([n]), np.zeros((1, 640), np.float32))]},
                   [np.arange(batch.n)], batch.logits[:batch.n] != 0)
    assert ctx.decode(batch) == 0
    errors = cap.writer.settle()
    cap.writer.disarm()
    assert list(errors) == [0] and "holds only the rows with logits" in errors[0]
