"""clickpaca.base.fieldcheck: one library of field checks and one message style, used by the
protocol's request fields and the sampler steps' parameters alike."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from clickpaca.base import fieldcheck as fc
from clickpaca.base.fieldcheck import FieldError
from clickpaca.wire.protocol import ProtocolError, validate
from clickpaca.sampling import SamplerParamError, SamplerParams


def test_it_imports_nothing_from_clickpaca():
    tree = ast.parse(Path(fc.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("clickpaca"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("clickpaca") for a in node.names), ast.dump(node)


@pytest.mark.parametrize("check,value,message", [
    (fc.integer(0), "x", 'f: must be an integer, got "x"'),
    (fc.integer(0), 40.0, "f: must be an integer, got 40.0"),
    (fc.integer(0), True, "f: must be an integer, got true"),
    (fc.integer(0), np.bool_(True), "f: must be an integer, got a bool"),  # numpy's: no number either
    (fc.integer(0, 9), -1, "f: must be >= 0, got -1"),
    (fc.integer(0, 9), 10, "f: must be <= 9, got 10"),
    (fc.real(), None, "f: must be a number, got null"),
    (fc.real(), [1], "f: must be a number, got [1]"),
    (fc.real(), math.inf, "f: must be finite, got inf"),
    (fc.real(0.0), -1, "f: must be >= 0, got -1.0"),
    (fc.real(0.0, lo_open=True), 0, "f: must be > 0, got 0.0"),
    (fc.real(0.0, 1.0), 1.5, "f: must be in [0, 1], got 1.5"),
    (fc.boolean, 1, "f: must be true or false, got 1"),
    (fc.string(True), "", "f: must not be empty"),
    (fc.string(), {"a": 1}, 'f: must be a string, got {"a":1}'),
    (fc.one_of(("a", "b")), "c", 'f: must be one of a, b, got "c"'),
    (fc.string_list, ["a", 2], 'f: must be a list of strings, got ["a",2]'),
    (fc.choice_strings(2, 3), ["abcd"], "f: entries must be at most 3 characters, got 4"),
    (fc.choice_strings(2, 3), [""], 'f: entries must be non-empty strings, got ""'),
])
def test_one_message_style(check, value, message):
    with pytest.raises(FieldError) as e:
        check("f", value)
    assert str(e.value) == message and e.value.field == "f" and isinstance(e.value, ValueError)


def test_values_come_back_normalised():
    assert fc.integer(0)("f", np.int64(3)) == 3 and type(fc.integer(0)("f", np.int64(3))) is int
    assert fc.real()("f", 2) == 2.0 and type(fc.real()("f", 2)) is float
    with pytest.raises(FieldError, match="must be finite"):  # in-process only (JSON gives inf)
        fc.real()("f", 10**400)
    assert fc.optional(fc.integer(0))("f", None) is None
    assert fc.choice_strings(2, 3)("f", ["a"]) == ("a",)
    assert fc.show("x" * 100).endswith("...") and len(fc.show("x" * 100)) == 60


def test_sampler_and_protocol_fields_answer_alike():
    """The same mistake in a sampler field and in a protocol field reads the same."""
    def message(**fields):
        with pytest.raises(ProtocolError) as e:
            validate({"type": "infer", "seq_id": 0, "prompt": "x", **fields})
        return e.value.message

    assert message(topP="x") == 'topP: must be a number, got "x"'
    assert message(maxTokens="x") == 'maxTokens: must be an integer, got "x"'
    assert message(topK=[1]) == "topK: must be an integer, got [1]"
    assert message(reusePrefix=None) == "reusePrefix: must be true or false, got null"
    assert message(trace=1) == "trace: must be true or false, got 1"
    assert message(samplers=["top_k", "nope"]).startswith('samplers: unknown step "nope"; known: ')
    assert message(logit_bias=[["a", 1]]) == 'logit_bias: token id must be a non-negative integer of at most 12 digits, got "a"'
    with pytest.raises(SamplerParamError) as e:  # in process, the same class and text
        SamplerParams(top_p="x")
    assert str(e.value) == 'topP: must be a number, got "x"' and isinstance(e.value, FieldError)
