"""mask_ahead: masks filled on the worker thread equal masks filled in place."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca.grammar.grammars import GrammarEngine, allowed_ids, fill_masks
from clickpaca.engine.mask_ahead import MaskAhead

GRAMMARS = [
    '%json_schema {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
    '%llguidance {}\nstart: line+\nline: WORD (" " WORD)* ".\\n"\nWORD: /[A-Za-z]+/\n',
    'root ::= ("yes" | "no") "\\n"',
]


@pytest.fixture(scope="module")
def engine(model):
    eng = GrammarEngine.start(model)
    assert eng.wait(120)
    return eng


@pytest.mark.parametrize("enabled", [True, False])
def test_masks_ahead_equal_masks_in_place(engine, enabled):
    matchers = [engine.compile(g).new_matcher() for g in GRAMMARS for _ in range(3)]
    rng = np.random.default_rng(0)
    for m in matchers[1::3]:  # move some matchers off their start state
        row = engine.allocate_bitmask(1)
        fill_masks([m], row)
        ids = allowed_ids(row[0])
        assert m.consume(int(rng.choice(ids[ids < 200_000])))
    ahead = MaskAhead(engine.allocate_bitmask(len(matchers)), enabled=enabled)
    try:
        keys = [f"seq{i}" for i in range(len(matchers))]
        job = ahead.start(list(zip(keys, matchers)))
        job.wait()
        want = engine.allocate_bitmask(len(matchers))
        fill_masks(matchers, want)
        for i, k in enumerate(keys):
            assert np.array_equal(job.row(k), want[i]), k
        assert job.row("not planned") is None
    finally:
        ahead.close()


def test_an_empty_job_waits_for_nothing(engine):
    ahead = MaskAhead(engine.allocate_bitmask(1))
    try:
        job = ahead.start([])
        job.wait()
        assert job.row(0) is None
    finally:
        ahead.close()
