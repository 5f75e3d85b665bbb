"""engine/readout.py's pure parts: which positions of a feed a request captures, the
logits rows it asks for, and what its end event carries (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.activations import capture as C
from clickpaca.engine.plan import Feed, Want
from clickpaca.engine.readout import MAX_INLINE_BYTES, JobCapture
from clickpaca.engine.statedir import StateDir


def feed(pos, count, generating=False, ends=True, samples=False):
    return Feed(None, generating, pos, count, 0, pos, range(0), ends, samples)


def jc(tokens, needs_logits=False, **kw):
    return JobCapture(("l_out-3",), tokens, "float32", needs_logits, **kw)


def test_positions_per_captureTokens():
    prompt_chunk, prompt_end = feed(0, 5, ends=False), feed(5, 3, samples=True)
    gen = feed(8, 1, generating=True, samples=True)
    assert jc("all").positions(prompt_chunk) == [0, 1, 2, 3, 4]
    assert jc("all").positions(gen) == [8]
    assert jc("last").positions(prompt_chunk) == [] and jc("last").positions(prompt_end) == [7]
    assert jc("last").positions(gen) == []  # a generated token is not the prompt's
    # generated: the row each token is sampled from, the prompt's last for the first one
    assert jc("generated").positions(prompt_chunk) == [] and jc("generated").positions(prompt_end) == [7]
    assert jc("generated").positions(gen) == [8]
    assert jc("generated").positions(feed(5, 3, samples=False)) == []  # maxTokens 0: nothing sampled


def test_widen_asks_logits_rows_only_for_nodes_that_need_them():
    def want(**kw):
        base = dict(key=None, generating=False, n_past=2, n_tokens=9, out_from=8, out_to=8, samples_at_end=True)
        return Want(**{**base, **kw})

    w = jc("all").widen(want())
    assert (w.out_from, w.out_to) == (8, 8)  # a per-token node: rows without logits are there
    w = jc("all", needs_logits=True).widen(want())
    assert (w.out_from, w.out_to) == (2, 8)
    w = jc("last", needs_logits=True).widen(want(out_from=9, out_to=8))  # a prefill: no row of its own
    assert (w.out_from, w.out_to) == (8, 8)
    w = jc("all", needs_logits=True).widen(want(out_from=5, out_to=7))  # a score window's rows stay inside
    assert (w.out_from, w.out_to) == (2, 8)
    w = jc("generated", needs_logits=True).widen(want())
    assert (w.out_from, w.out_to) == (8, 8)


def test_event_field_inline_then_npy_when_large(tmp_path):
    states = StateDir(tmp_path)
    c = jc("all", states=states)
    c.pending = [0, 1]
    c.took({"l_out-3": np.arange(2 * 640, dtype=np.float32).reshape(2, 640)})
    ev = c.event_field(4)
    assert ev["tokens"] == "all" and ev["positions"] == [0, 1]
    assert np.array_equal(C.decode(ev["nodes"]["l_out-3"]), np.arange(1280, dtype=np.float32).reshape(2, 640))
    rows = MAX_INLINE_BYTES // (640 * 4) + 1
    c.pending = list(range(2, 2 + rows))
    c.took({"l_out-3": np.ones((rows, 640), np.float32)})
    ev = c.event_field(4)
    ref = ev["nodes"]["l_out-3"]
    assert ref["shape"] == [rows + 2, 640] and ref["dtype"] == "float32" and "data" not in ref
    assert ref["file"].startswith(str(tmp_path)) and ref["file"].endswith(".npy")
    assert np.load(ref["file"]).shape == (rows + 2, 640)
    assert ev["positions"] == list(range(rows + 2))


def test_npy_names_stay_inside_the_namespace(tmp_path):
    states = StateDir(tmp_path)
    ns = states.new_client_namespace(1)
    c = JobCapture(("Kcur-0 (view)",), "all", "float16", False, states=states, namespace=ns)
    c.pending = list(range(MAX_INLINE_BYTES // 2 + 1))
    c.took({"Kcur-0 (view)": np.zeros((len(c.pending), 1), np.float32)})
    ref = c.event_field(0)["nodes"]["Kcur-0 (view)"]
    assert ref["file"].startswith(str(tmp_path / ns) + "/") and " " not in ref["file"]
    assert np.load(ref["file"]).dtype == np.float16


@pytest.mark.parametrize("tokens", ["all", "last"])
def test_nothing_taken_is_an_empty_array(tokens):
    ev = jc(tokens).event_field(0)
    assert ev["positions"] == [] and C.decode(ev["nodes"]["l_out-3"]).size == 0
