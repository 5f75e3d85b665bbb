"""User-defined steps (clickpaca.sampling.usersteps) through the real server: `serve --steps`,
their parameters checked like the built-in ones, a raising step ending only its own
sequence, and their time in `done`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clickpaca.sampling.usersteps import StepFailed, _guard, _snake, step_ms

from conftest import spawn_server

STEPS = Path(__file__).resolve().parent / "steps"
PROMPT = "The capital of France is"
PARIS = 9079  # " Paris"
CHAIN = ["logit_bias", "penalties", "top_k", "min_p", "top_p", "temperature"]


# ------------------------------------------------------------------ no model


def test_snake_case_fields():
    assert (_snake("wordBias"), _snake("boostToken"), _snake("x"), _snake("nProbs2")) == \
        ("word_bias", "boost_token", "x", "n_probs2")


class Ctx:
    def __init__(self):
        self.states = {}


def test_guard_times_and_names_failures():
    ctx = Ctx()
    ids, logits = np.arange(4, dtype=np.int32), np.zeros(4)
    ok = _guard("fine", lambda i, l, p, c: (i[:2], l[:2]))
    out_ids, out_logits = ok(ids, logits, None, ctx)
    assert out_ids.tolist() == [0, 1] and out_ids.dtype == np.int32
    assert ctx.states["__user_step_ns__"]["fine"] > 0
    assert step_ms(ctx.states)["fine"] > 0 and step_ms(ctx.states) is None  # taken out
    for fn, why in ((lambda i, l, p, c: 1 / 0, "ZeroDivisionError"),
                    (lambda i, l, p, c: i, "must return (ids, logits)"),
                    (lambda i, l, p, c: (i, l[:2]), "of one length"),
                    (lambda i, l, p, c: (i.astype(float), l), "not integers"),
                    (lambda i, l, p, c: (i + 1, l), "not among its candidates")):
        with pytest.raises(StepFailed, match=re.escape(why)) as e:
            _guard("bad", fn)(ids, logits, None, ctx)
        assert e.value.step == "bad" and str(e.value).startswith("step 'bad' failed: ")


def test_serve_refuses_a_file_without_steps_or_missing():
    for spec, why in ((STEPS / "no_steps.py", "registered no step"), (STEPS / "missing.py", "no such file"),
                      ("clickpaca.no_such_module", "ModuleNotFoundError")):
        p = subprocess.run([sys.executable, "-m", "clickpaca", "serve", "--steps", str(spec)],
                           input=b"", capture_output=True, timeout=60)
        assert p.returncode == 2 and why in p.stderr.decode(), p.stderr


# ------------------------------------------------------------------ the real server

@pytest.fixture(scope="module")
def srv():
    c = spawn_server("--steps", str(STEPS / "user_steps.py"), nSeqMax=4)
    yield c
    c.close()


@pytest.mark.model
def test_a_user_step_steers_and_reports_its_time(srv):
    srv.infer(0, PROMPT, maxTokens=3, temperature=0, samplers=["boost"] + CHAIN, boostToken=PARIS, boostBy=100)
    toks, done = srv.collect(0)
    assert done["type"] == "done", done
    assert [t["token"] for t in toks] == [PARIS] * 3
    assert set(done["steps_ms"]) == {"boost"} and done["steps_ms"]["boost"] > 0
    # the trace shows what it did: the boosted token is the only one ranked first after it
    srv.infer(0, PROMPT, maxTokens=1, temperature=0, samplers=["boost"] + CHAIN, boostToken=PARIS, boostBy=100,
              trace=True)
    (tok,), done = srv.collect(0)
    rows = {r["step"]: r for r in tok["trace"]["steps"]}
    assert rows["boost"]["rank"] == 0 and rows["boost"]["p"] > 0.99 and rows["model"]["rank"] > 0
    assert done["steps_ms"]["boost"] > 0
    # the step at its defaults is off: the default chain (which holds it) runs without it
    srv.infer(1, PROMPT, maxTokens=3, temperature=0)
    toks, done = srv.collect(1)
    assert done["type"] == "done" and "steps_ms" not in done and [t["token"] for t in toks] != [PARIS] * 3


@pytest.mark.model
def test_user_step_parameters_are_checked_like_built_in_ones(srv):
    for params, msg in (({"boostBy": "x"}, 'boostBy: must be a number, got "x"'),
                        ({"boostBy": 101}, "boostBy: must be in [0, 100], got 101.0"),
                        ({"boostToken": 1.5}, "boostToken: must be an integer, got 1.5")):
        srv.infer(2, PROMPT, maxTokens=1, **params)
        (ev,) = list(srv.stream(2))
        assert ev["type"] == "error" and ev["message"] == msg, ev
    srv.infer(2, PROMPT, maxTokens=1, samplers=["boost", "nosuch"])
    (ev,) = list(srv.stream(2))
    assert ev["type"] == "error" and 'unknown step "nosuch"' in ev["message"] and "boost" in ev["message"]


@pytest.mark.model
def test_a_raising_step_ends_only_its_sequence(srv):
    n_prompt = 6  # <bos> + 5 tokens of PROMPT
    srv.send_raw(b"".join(line + b"\n" for line in (
        b'{"type": "infer", "seq_id": 0, "prompt": "%s", "maxTokens": 12, "temperature": 0, '
        b'"samplers": ["boom", "temperature"], "boomAt": %d}' % (PROMPT.encode(), n_prompt + 2),
        b'{"type": "infer", "seq_id": 1, "prompt": "%s", "maxTokens": 12, "temperature": 0, '
        b'"samplers": ["outsider"], "outsiderOn": 1}' % PROMPT.encode(),
        b'{"type": "infer", "seq_id": 2, "prompt": "%s", "maxTokens": 12, "temperature": 0}' % PROMPT.encode())))
    toks0, end0 = srv.collect(0)
    toks1, end1 = srv.collect(1)
    toks2, end2 = srv.collect(2)
    assert end0["type"] == "error" and len(toks0) == 2
    assert end0["message"] == "step 'boom' failed: RuntimeError: the context reached 8 tokens"
    assert end1["type"] == "error" and toks1 == []
    assert end1["message"] == "step 'outsider' failed: returned token ids that were not among its candidates"
    assert end2["type"] == "done" and end2["tokens_predicted"] == 12  # the other sequence went on
    srv.infer(0, PROMPT, maxTokens=2, temperature=0)  # the slot and the server still work
    assert srv.collect(0)[1]["type"] == "done"


@pytest.mark.model
def test_workbench_with_a_user_step():
    from clickpaca import Workbench

    with Workbench.spawn(steps=[STEPS / "user_steps.py"], nCtx=2048, nSeqMax=2) as wb:
        gens = wb.generate([PROMPT, {"prompt": PROMPT, "boomAt": 7, "samplers": ["boom", "temperature"]}],
                           maxTokens=4, temperature=0, samplers=["boost"] + CHAIN, boostToken=PARIS, boostBy=100)
    assert gens[0].ok and gens[0].tokens == [PARIS] * 4 and gens[0].steps_ms["boost"] > 0
    assert gens[0].record()["step_ms:boost"] == gens[0].steps_ms["boost"]
    assert not gens[1].ok and gens[1].error.startswith("step 'boom' failed")


@pytest.mark.model
def test_jump_forward_is_refused_with_a_user_step_that_runs(srv):
    """jumpForward (engine/jump.py) is not offered to a chain where a user-defined step
    runs (what it does with a one-token set is unknown): an error names the field; with
    the step off (its defaults) it runs."""
    srv.grammar("yes-no", '%json_schema {"enum": ["yes", "no"]}')
    srv.infer(3, PROMPT, maxTokens=4, grammar_id="yes-no", jumpForward=True, samplers=["boost"] + CHAIN,
              boostToken=PARIS, boostBy=1)
    (ev,) = list(srv.stream(3))
    assert ev["type"] == "error" and ev["message"].startswith("jumpForward: not with user-defined steps (boost)"), ev
    srv.infer(3, PROMPT, maxTokens=4, grammar_id="yes-no", jumpForward=True, temperature=0)
    toks, done = srv.collect(3)
    assert done["type"] == "done" and done["forced_tokens"] == sum(1 for t in toks if t.get("forced")), done
