"""Stateful and random sampler steps on the real server: DRY's history, mirostat's mu and
XTC's draws are per sequence and survive fork, save/load and concurrent decoding.

Deterministic mode (docs/DETERMINISM.md) makes a sequence's logits the same bit for bit
whatever shares its decode and whether its prompt was computed cold, held, forked or
reloaded, so every path must give exactly the cold run's tokens. DRY keeps no state of
its own: its history is the sequence's context, which held, forked and loaded states
carry. Mirostat's mu and XTC's stream live in the sequence's sampler for one infer
(mu starts at 2 tau, as llama.cpp's at init): two sequences never share them.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from clickpaca.wire.client import Client
from conftest import TEST_BUILD

pytestmark = pytest.mark.model

# Repetitive on purpose: greedy decoding continues the pattern unless DRY stops it.
DOC = ("Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, "
       "Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,")
N = 12
DRY = {"temperature": 0, "dryMultiplier": 1.5, "dryAllowedLength": 2, "topK": 0, "topP": 1.0}
MIRO = {"temperature": 1.0, "mirostat": 2, "mirostatTau": 3.0, "mirostatEta": 0.2, "topK": 0, "topP": 1.0,
        "seed": 11}
XTC = {"temperature": 1.0, "xtcProbability": 0.6, "xtcThreshold": 0.05, "seed": 5}


@pytest.fixture(scope="module")
def c():
    c = Client.spawn()
    c.init(nCtx=2048, nSeqMax=8, build=TEST_BUILD, deterministic=True, cacheTypeK="f16", cacheTypeV="f16",
           stateDir=tempfile.mkdtemp(prefix="clkp-state-"))
    yield c
    c.close()


def run(c: Client, seq_id: int, prompt: str, **params) -> list[int]:
    c.infer(seq_id, prompt, maxTokens=N, **params)
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return [t["token"] for t in toks]


def together(c: Client, reqs: dict[int, tuple[str, dict]]) -> dict[int, list[int]]:
    """Every infer in one write: they decode in the same ticks."""
    c.send_raw(b"".join(json.dumps({"type": "infer", "seq_id": s, "prompt": p, "maxTokens": N, **kw}).encode()
                        + b"\n" for s, (p, kw) in reqs.items()))
    out = {}
    for s in reqs:
        toks, done = c.collect(s)
        assert done["type"] == "done", done
        out[s] = [t["token"] for t in toks]
    return out


def held(c: Client, seq_id: int) -> None:
    assert c.request({"type": "prefill", "seq_id": seq_id, "prompt": DOC})["type"] == "prefilled"


def test_dry_sees_the_held_forked_and_loaded_history(c):
    cold = run(c, 0, DOC, reusePrefix=False, **DRY)
    plain = run(c, 0, DOC, reusePrefix=False, **{k: v for k, v in DRY.items() if not k.startswith("dry")})
    assert cold != plain, "DRY changed nothing on a repetitive prompt: the test would prove nothing"
    held(c, 1)
    assert c.request({"type": "fork", "seq_id": 1, "dst_seq_id": 2})["type"] == "forked"
    assert c.request({"type": "save", "seq_id": 1, "path": "dry-state"})["type"] == "saved"
    assert c.request({"type": "load", "seq_id": 3, "path": "dry-state"})["type"] == "loaded"
    got = together(c, {1: ("", DRY), 2: ("", DRY), 3: ("", DRY)})
    assert got == {1: cold, 2: cold, 3: cold}


def test_mirostat_mu_is_per_sequence_and_survives_fork_and_load(c):
    cold = run(c, 0, DOC, reusePrefix=False, **MIRO)
    without = run(c, 0, DOC, reusePrefix=False, **{k: v for k, v in MIRO.items() if k != "mirostat"})
    assert cold != without, "mirostat changed nothing: the test would prove nothing"
    held(c, 4)
    assert c.request({"type": "fork", "seq_id": 4, "dst_seq_id": 5})["type"] == "forked"
    assert c.request({"type": "save", "seq_id": 4, "path": "miro-state"})["type"] == "saved"
    assert c.request({"type": "load", "seq_id": 6, "path": "miro-state"})["type"] == "loaded"
    # the same seed in four sequences decoding together: a shared mu or stream would part them
    got = together(c, {4: ("", MIRO), 5: ("", MIRO), 6: ("", MIRO), 7: (DOC, {**MIRO, "reusePrefix": False})})
    assert got == {4: cold, 5: cold, 6: cold, 7: cold}


def test_xtc_draws_from_the_sequences_seeded_stream(c):
    a = together(c, {0: (DOC, {**XTC, "reusePrefix": False}), 1: (DOC, {**XTC, "reusePrefix": False}),
                     2: (DOC, {**XTC, "seed": 6, "reusePrefix": False})})
    assert a[0] == a[1]
    b = run(c, 0, DOC, reusePrefix=False, **XTC)
    assert b == a[0]
    assert a[2] != a[0] or run(c, 0, DOC, reusePrefix=False, **{**XTC, "seed": 7}) != a[0]


@pytest.mark.parametrize("last_n", [-1, 4])
def test_the_penalties_window_is_the_sequences_one_history(c, model, last_n):
    """The repetition penalties read the sequence's own token history (prompt included,
    as llama-server's slots accept the whole prompt before the first draw; each sampled
    token once). A presence penalty of 1000 under greedy decoding makes that visible:
    no token is drawn that is in its window, the last `last_n` tokens of the context.
    Held, forked, loaded and reused-prefix sequences carry the same history, so they
    draw the cold run's tokens bit for bit (deterministic mode)."""
    pen = {"temperature": 0, "penaltyPresent": 1000.0, "penaltyLastN": last_n}
    context = model.tokenize(DOC, add_special=True, parse_special=True).tolist()
    cold = run(c, 0, DOC, reusePrefix=False, **pen)
    assert cold != run(c, 0, DOC, reusePrefix=False, temperature=0), "the penalty changed nothing"
    for tok in cold:
        window = context if last_n < 0 else context[-last_n:]
        assert tok not in window, (tok, window)
        context.append(tok)
    held(c, 1)
    assert c.request({"type": "fork", "seq_id": 1, "dst_seq_id": 2})["type"] == "forked"
    assert c.request({"type": "save", "seq_id": 1, "path": f"pen-state{last_n}"})["type"] == "saved"
    assert c.request({"type": "load", "seq_id": 3, "path": f"pen-state{last_n}"})["type"] == "loaded"
    c.infer(4, DOC, maxTokens=N, **pen)  # reusePrefix: its prompt's cells from a held one
    toks, done = c.collect(4)
    assert done["tokens_reused"] > 0 and [t["token"] for t in toks] == cold, done
    got = together(c, {1: ("", pen), 2: ("", pen), 3: ("", pen)})
    assert got == {1: cold, 2: cold, 3: cold}
