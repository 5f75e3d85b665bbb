"""engine/jump.py: the forced run a grammar leaves after a sampled token (the real
grammar engine on the default model's vocabulary), and its pure helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clickpaca.engine import jump
from clickpaca.grammar.grammars import GrammarEngine
from clickpaca.sampling import SamplerParams


@pytest.fixture(scope="module")
def engine(model):
    eng = GrammarEngine.start(model)
    eng.wait()
    return eng


def matcher_at(engine, model, schema: dict, text: str):
    """A matcher of the schema that has consumed `text` (tokenized as the model would)."""
    m = engine.compile("%json_schema " + json.dumps(schema)).new_matcher()
    if text:
        assert m.consume_many(model.tokenize(text, add_special=False, parse_special=False).tolist()), m.error()
    return m


def test_only_token():
    row = np.zeros(8, np.int32)
    assert jump.only_token(row) is None
    row[2] = np.int32(1 << 5)
    assert jump.only_token(row) == 2 * 32 + 5
    row[2] = np.int32(-2**31)  # bit 31 of a word (int32 layout)
    assert jump.only_token(row) == 2 * 32 + 31
    row[2] |= np.int32(1)
    assert jump.only_token(row) is None
    row[2], row[3] = np.int32(1), np.int32(1)
    assert jump.only_token(row) is None


def test_needs_rows():
    assert not jump.needs_rows(SamplerParams())
    assert jump.needs_rows(SamplerParams(n_probs=3))
    assert jump.needs_rows(SamplerParams(mirostat=2))  # mirostat learns every drawn token


def test_forced_run_is_what_each_mask_allows(engine, model):
    """Every token of the run is the one token its mask allowed before it was consumed,
    and the matcher stands after the run."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    m = matcher_at(engine, model, schema, '{"')
    ref = m.fork()
    run = jump.forced_run(m, SamplerParams(), 50, model.is_eog, keep_masks=True)
    assert run, "the key name and its colon are forced"
    for x in run:
        mask = ref.mask()
        assert jump.only_token(mask) == x.token
        assert np.array_equal(mask, x.mask)
        assert ref.consume(x.token)
        assert x.stopped == ref.is_stopped()
    assert m.n_consumed == ref.n_consumed
    assert model.detokenize([x.token for x in run]).startswith("name")
    assert not m.forced_tokens() or jump.only_token(m.mask()) is None or len(run) == 50


def test_forced_run_respects_the_limit_bans_and_masks(engine, model):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    full = jump.forced_run(matcher_at(engine, model, schema, ""), SamplerParams(), 50, model.is_eog, False)
    assert len(full) >= 2 and all(x.mask is None for x in full)
    assert [x.token for x in jump.forced_run(matcher_at(engine, model, schema, ""), SamplerParams(), 1,
                                             model.is_eog, False)] == [full[0].token]
    banned = SamplerParams(logit_bias=((full[1].token, -1e9),))
    assert [x.token for x in jump.forced_run(matcher_at(engine, model, schema, ""), banned, 50,
                                             model.is_eog, False)] == [full[0].token]


def test_a_forced_key_already_present_ends_the_run(engine, model):
    """The repeated-key ban (grammar/json_keys.py) is in the mask the run checks: where the
    grammar forces a key the object holds, the run stops before it (token by token the
    ban leaves nothing there: stop_reason repeated_key). The key's text up to the quote
    that would close it may still be forced."""
    schema = {"type": "object", "patternProperties": {"^aa$": {"type": "integer", "minimum": 0, "maximum": 9}},
              "additionalProperties": False}
    m = matcher_at(engine, model, schema, '{"aa": 1, "')
    assert m.keys is not None
    assert m.forced_tokens(), "the grammar forces the only key again"
    run = jump.forced_run(m, SamplerParams(), 50, model.is_eog, False)
    assert '"' not in model.detokenize([x.token for x in run])  # the key is never closed
    assert not m.mask().any()  # where it stops, token by token nothing is left (repeated_key)
