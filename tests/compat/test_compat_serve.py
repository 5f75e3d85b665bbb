"""`clickpaca serve` on an older build: it works, or it refuses by naming what is missing.

    COMPAT_BUILD=builds/compat-0.3.16 python -m pytest tests/compat -q   (make test-compat)

What to expect comes from the build's manifest, never from a list kept here: the feature
table (clickpaca/llama/features.py) says which features it lacks, and the change report
(bindgen.report.ours against the mainline manifest) what our code uses that this version
lacks with nothing handling it. Where the build lacks a feature init needs, or the report
has an unhandled entry, init must be refused with a message naming one of those llama.cpp
names; otherwise init, infer and score must work, and every option whose feature the
build lacks must be refused with an error naming the option and what is missing. Never an
AttributeError, an internal error or a crash in C.
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
from clickpaca.llama import features
from clickpaca.wire.client import Client, ServerError
from compat_common import MAINLINE_MANIFEST

pytestmark = pytest.mark.model

# An init option that asks for each refusable feature (features.FEATURES, field != "build").
# A new row in the table needs its line here: test_every_optional_feature_has_a_request.
ASKS = {
    "rpc": {"rpcServers": ["127.0.0.1:9"]},  # refused before any connection is tried
    "output-local": {"outputLocal": True},
    "repack-off": {"deterministic": True},
    "kv-streams": {"kvUnified": False},
    "swa-small": {"swaFull": False},
    "backend-sampling": {"preselect": True},
    "kv-center": {"kvCenter": "/nonexistent/center.npz"},  # refused before the file is read
}
INIT = dict(nCtx=1024, nSeqMax=4, nBatch=256, nThreads=2)


def manifest(build) -> dict:
    return json.loads((build / "bindings" / "manifest.json").read_text())


def blocking(build) -> list[dict]:
    """What our code uses that this build lacks with nothing handling it (the report)."""
    main = json.loads(MAINLINE_MANIFEST.read_text())
    found, _ = ours(manifest(build), main, scan())
    return [o for o in found if not o["handled"]]


def lacking(build, init_itself: bool) -> dict[str, list[str]]:
    """feature -> the names this build lacks, for the features init itself needs
    (`init_itself`) or for the optional ones that refuse an init option (those refused in
    another request, cvec-seq's infer strength and steer-slots' vector / steer, are tested on
    mainline in tests/test_activations_server.py and tests/test_activations_steering.py;
    `patch`, refused without eval-callback-live, in tests/test_engine_patches.py)."""
    have = features.for_manifest(manifest(build))
    return {f.name: features.lacking(f, have) for f in features.FEATURES
            if f.refuses and f.request == "init" and (f.field == "build") == init_itself
            and features.lacking(f, have)}


def must_refuse_init(build) -> set[str]:
    """The llama.cpp names an init refusal may name on this build (empty: init must work)."""
    names = {n for ns in lacking(build, True).values() for n in ns}
    block = blocking(build)
    if block and not names:
        names = {o["name"].removeprefix("enum ").split(" (")[0] for o in block}
    return names


def spawn(build) -> Client:
    return Client.spawn(python=sys.executable, env={"CLICKPACA_BUILDS": str(build.parent),
                                                    "OMP_WAIT_POLICY": "passive"})


def assert_named_refusal(error, names: set[str], field: str | None = None) -> None:
    assert isinstance(error, ServerError), f"init succeeded although the build lacks {sorted(names)}"
    message = str(error)
    for bad in ("AttributeError", "Traceback", "internal error"):
        assert bad not in message, message
    assert any(re.search(rf"\b{re.escape(n)}\b", message) for n in names), (message, sorted(names))
    if field is not None:
        assert message.startswith(f"{field}: "), message


@pytest.fixture(scope="module")
def model_path(generated):
    from clickpaca.llama.models import resolve_model
    build, _ = generated
    return model_for(build, resolve_model())[0]


@pytest.fixture(scope="module")
def served(generated, model_path):
    """A server process on the compat build: (client, ready event or the init error)."""
    build, _ = generated
    c = spawn(build)
    try:
        ready = c.init(build=build.name, modelPath=str(model_path), **INIT)
    except ServerError as e:
        ready = e
    yield build, c, ready
    c.close()


def test_serve_works_or_refuses_by_name(served):
    build, c, ready = served
    names = must_refuse_init(build)
    if not names:
        assert isinstance(ready, dict) and ready["type"] == "ready", ready
        assert ready["build"] == build.name
        info = json.loads((build / "build-info.json").read_text())
        assert ready["buildNumber"] == info["build_number"] and ready["buildCommit"] == info["commit"]
        assert ready["kvBytes"] > 0 and ready["nCtxPerSeq"] == ready["nCtx"]  # unified cache
        return
    assert_named_refusal(ready, names, field="build")
    assert c.proc.poll() is None  # refused, still running: no crash in C


def test_every_optional_feature_has_a_request():
    assert set(ASKS) == {f.name for f in features.FEATURES
                         if f.refuses and f.request == "init" and f.field != "build"}


def test_options_the_build_lacks_are_refused_by_name(generated, model_path):
    """Each option whose feature this build lacks, on a server of its own: refused naming
    the option and the missing function or field (where init itself is refused: naming
    what init needs), and the server keeps running."""
    build, _ = generated
    lacks = lacking(build, False)
    if not lacks:
        pytest.skip(f"{build.name} lacks no optional feature")
    init_names = must_refuse_init(build)
    for feature, missing in sorted(lacks.items()):
        c = spawn(build)
        try:
            try:
                got = c.init(build=build.name, modelPath=str(model_path), **{**INIT, **ASKS[feature]})
            except ServerError as e:
                got = e
            if init_names:
                assert_named_refusal(got, init_names, field="build")
            else:
                assert_named_refusal(got, set(missing), field=features.BY_NAME[feature].field)
            assert c.proc.poll() is None
            sys.stderr.write(f"{feature}: {got}\n")
        finally:
            c.close()


def test_infer_and_score_where_init_works(served):
    build, c, ready = served
    if not isinstance(ready, dict):
        assert must_refuse_init(build), ready  # refused only where the manifest says it must
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


def test_lens_is_refused_by_name_where_it_cannot_run(served):
    """`lens` is refused per request, never at init (features.py 'logit-lens', field lens,
    so ASKS has no line for it): where the build's bindings lack ggml's gguf API, naming
    what they lack; elsewhere this server (no init capture, no live callback on an
    upstream build) refuses it naming lens and what to send."""
    build, c, ready = served
    if not isinstance(ready, dict):
        pytest.skip(f"{build.name} cannot serve (test_serve_works_or_refuses_by_name)")
    c.infer(3, "The capital of France is", maxTokens=1, lens={"top": 1})
    ev = c.collect(3)[1]
    assert ev["type"] == "error" and ev["message"].startswith("lens: "), ev
    missing = features.lacking("logit-lens", features.for_manifest(manifest(build)))
    if missing:
        assert any(re.search(rf"\b{re.escape(n)}\b", ev["message"]) for n in missing), ev
    else:
        assert "capture: true" in ev["message"], ev
    assert c.proc.poll() is None
