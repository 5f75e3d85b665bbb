"""`clickpaca demo` (the README's first command after set-up), run for real: every part
completes, and what each row shows is what its steering guarantees."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from clickpaca.workbench.demo import PERSON, QUESTIONS, STEERED


@pytest.fixture(scope="module")
def demo_output() -> str:
    proc = subprocess.run([sys.executable, "-m", "clickpaca", "demo"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" not in proc.stdout, proc.stdout
    return proc.stdout


def row_text(out: str, sid: int) -> str:
    """The generated text of steered row sid (the line after its header)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"[{sid}] "))
    return eval(lines[at + 1].strip())  # noqa: S307 - the demo prints repr() of a str


@pytest.mark.model
def test_every_steered_row_obeys_its_steering(demo_output):
    for sid in STEERED:
        assert f"[{sid}] {STEERED[sid][0]}" in demo_output
    assert row_text(demo_output, 1) in ("yes.", "no.")
    schema = json.loads(PERSON.removeprefix("%json_schema "))
    jsonschema.validate(json.loads(row_text(demo_output, 2)), schema)
    assert not row_text(demo_output, 3).lstrip().startswith("Paris")
    assert row_text(demo_output, 5).endswith("six")


@pytest.mark.model
def test_alternatives_row_lists_five_tokens_by_falling_probability(demo_output):
    probs = [float(p) for p in re.findall(r"logprob +(-?\d+\.\d+)", demo_output)]
    assert len(probs) == STEERED[6][2]["nProbs"]
    assert probs == sorted(probs, reverse=True) and all(p <= 0 for p in probs)


@pytest.mark.model
def test_forked_document_answers_every_question(demo_output):
    assert re.search(r"cold \(document \+ question from scratch\): +\d+ ms", demo_output)
    assert re.search(r"forked \(3 questions in one batch\): +\d+, \d+, \d+ ms", demo_output)
    for sid in QUESTIONS:
        assert re.search(rf"\[{sid}\] .* -> '.+'", demo_output), sid


@pytest.mark.model
def test_kv_bytes_per_token_follow_the_block_formats(demo_output):
    """q8_0 stores 32 values in 34 bytes, q4_0 in 18, f16 in 64: ratios 0.53 and 0.28."""
    ratios = dict(re.findall(r"(f16|q8_0|q4_0) +[\d.]+ KiB per token +\((\d\.\d\d)x f16\)", demo_output))
    assert ratios == {"f16": "1.00", "q8_0": f"{34 / 64:.2f}", "q4_0": f"{18 / 64:.2f}"}
