"""`clickpaca serve` on an older build: it works, or it refuses by naming what is missing.

    COMPAT_BUILD=builds/compat-0.3.16 python -m pytest tests/compat -q   (make test-compat)

The change report predicts which: what clickpaca's code uses that this version lacks and no
hasattr() fallback covers (bindgen.report.ours against the mainline manifest). With nothing
such, init, infer and score must work; otherwise init must fail with a message that names
one of those llama.cpp functions or fields, never an AttributeError or a crash in C.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from bindgen.report import ours
from bindgen.smoke_model import model_for
from bindgen.usage import scan
from clickpaca.client import Client, ServerError
from compat_common import MAINLINE_MANIFEST

pytestmark = pytest.mark.model


def blocking(build) -> list[dict]:
    """What our code uses that this build lacks with no fallback (from the change report)."""
    mine = json.loads((build / "bindings" / "manifest.json").read_text())
    main = json.loads(MAINLINE_MANIFEST.read_text())
    found, _ = ours(mine, main, scan())
    return [o for o in found if not o["handled"]]


@pytest.fixture(scope="module")
def served(generated):
    """A server process on the compat build: (client, ready event or the init error)."""
    from clickpaca.models import resolve_model

    build, _ = generated
    model, _why = model_for(build, resolve_model())
    c = Client.spawn(python=sys.executable, env={"CLICKPACA_BUILDS": str(build.parent),
                                                 "OMP_WAIT_POLICY": "passive"})
    try:
        ready = c.init(build=build.name, modelPath=str(model), nCtx=1024, nSeqMax=4, nBatch=256,
                       nThreads=2)
    except ServerError as e:
        ready = e
    yield build, c, ready
    c.close()


def test_serve_works_or_refuses_by_name(served):
    build, c, ready = served
    block = blocking(build)
    if not block:
        assert isinstance(ready, dict) and ready["type"] == "ready", ready
        assert ready["build"] == build.name
        info = json.loads((build / "build-info.json").read_text())
        assert ready["buildNumber"] == info["build_number"] and ready["buildCommit"] == info["commit"]
        assert ready["kvBytes"] > 0 and ready["nCtxPerSeq"] == ready["nCtx"]  # unified cache
        return
    assert isinstance(ready, ServerError), f"init succeeded although {block[0]['name']} is missing"
    message = str(ready)
    assert "AttributeError" not in message and "Traceback" not in message, message
    named = set(re.findall(r"\b(?:llama|ggml)_\w+", message))
    lacking = {o["name"].split(".")[-1].split(" ")[0] for o in block}
    assert named & lacking, (message, sorted(lacking))
    assert c.proc.poll() is None  # refused, still running: no crash in C


def test_infer_and_score_where_init_works(served):
    build, c, ready = served
    if not isinstance(ready, dict):
        assert blocking(build), ready  # refused only where the report says it must
        with pytest.raises(ServerError, match="before init"):
            c.score(0, "The capital of France is Paris.")
        return
    c.infer(0, "The capital of France is", maxTokens=8, temperature=0)
    c.infer(1, "Once upon a time", maxTokens=8, temperature=0.8, seed=3)
    for seq in (0, 1):
        events, final = c.collect(seq)
        assert final["type"] == "done", final
        assert 1 <= len([e for e in events if e.get("type") == "token"]) <= 8
    scored = c.score(2, "The capital of France is Paris. " * 20, window=128, perToken=True)
    assert scored["type"] == "scored" and scored["tokens"] > 0
    assert math.isfinite(scored["ppl"]) and scored["ppl"] > 1.0
    assert len(scored["token_nll"]) == scored["tokens"]
