"""Jump-forward (infer `jumpForward`, engine/jump.py) through the real server and the real
default model, in deterministic mode (and once in default mode, chunks cut by a small
batch): a grammar's forced tokens fed as one chunk of the
next decode, against the same request generated token by token (`jumpForward` off).

What is equal and what is not (docs/GRAMMARS.md, "Jump-forward"): in deterministic mode a
generated token is decoded beside the token before it (engine/plan.py), so every row of
a sequence takes the kernels of a prompt's rows, and a chunk's rows are those of token by
token's ticks, bit for bit: tokens, log-probabilities, the random stream, stops, for
greedy and sampled chains alike. In default mode a lone generated token takes another
attention kernel than a chunk's rows (docs/DETERMINISM.md), so the outputs agree up to a
near-tie only.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clickpaca.measure.schemas import load
from clickpaca.wire.client import ServerError
from conftest import spawn_server
from test_server_grammars import SCHEMAS, chat, schema_text
from test_server_schemas import REPEAT, TWO_KEYS
from test_server_state import N_TOP, first_difference, same_up_to_a_near_tie, where_they_part

pytestmark = pytest.mark.model

#: schemas of the test corpora: tests/test_server_grammars.py's, and two real ones enforced whole
CORPUS = [("check-jsonschema", "github-issue-config.json"), ("schemastore", ".clasp.json")]
MAX_TOKENS = 48
#: Gemma's end-of-generation tokens banned: a request without a grammar runs to maxTokens
EOG_BANS = [{"token": t, "bias": -1e9} for t in (1, 106, 212)]


@pytest.fixture(scope="module")
def det():
    c = spawn_server(deterministic=True, nSeqMax=4)
    for name, (schema, _) in SCHEMAS.items():
        c.grammar(f"s-{name}", schema_text(schema))
    for corpus, name in CORPUS:
        schema = next(s.schema for s in load(corpus) if s.name == name)
        assert c.grammar(f"c-{name}", schema_text(schema))["enforced"] is True
    yield c
    c.close()


def job(name: str) -> dict:
    """The infer of a schema: its grammar and a prompt asking for it."""
    if name in SCHEMAS:
        return dict(prompt=chat(SCHEMAS[name][1]), grammar_id=f"s-{name}")
    return dict(prompt=chat(f"Write a short {name} file as JSON."), grammar_id=f"c-{name}")


def run(c, sid: int = 0, **infer) -> tuple[list[dict], dict]:
    c.infer(sid, **infer)
    toks, final = c.collect(sid)
    assert final["type"] == "done", final
    return toks, final


def steps(toks: list[dict]) -> list:
    """[(token, logprob, top)] for the near-tie rule (tests/test_server_state.py)."""
    return [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def unmarked(toks: list[dict]) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "forced"} for t in toks]


def before_first_chunk(toks: list[dict]) -> int:
    """How many events of a jump-forward run come before its first forced token's row."""
    i = next((i for i, t in enumerate(toks) if t.get("forced")), len(toks))
    return i  # the first forced token's own row is the chunk's first


NAMES = list(SCHEMAS) + [n for _, n in CORPUS]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(NAMES), chain=st.sampled_from(["greedy", "penalties", "sampled"]),
       seed=st.integers(0, 2**31), n_probs=st.sampled_from([0, N_TOP]))
def test_jump_forward_is_token_by_token_bit_for_bit(det, name, chain, seed, n_probs):
    """The same request with jump-forward on and off, in deterministic mode: the same
    events bit for bit (tokens, pieces, log-probabilities and their alternatives), the
    forced ones marked and counted in `done`, the same end; with and without nProbs (a
    chunk then outputs every forced token's row, or its last only)."""
    params = {"greedy": dict(temperature=0), "penalties": dict(temperature=0, penaltyRepeat=1.3, minP=0.05),
              "sampled": dict(temperature=0.8, seed=seed, topK=40)}[chain]
    params["nProbs"] = n_probs
    off, f_off = run(det, **job(name), maxTokens=MAX_TOKENS, **params)
    on, f_on = run(det, **job(name), maxTokens=MAX_TOKENS, jumpForward=True, **params)
    assert not any("forced" in t for t in off) and "forced_tokens" not in f_off
    assert f_on["forced_tokens"] == sum(1 for t in on if t.get("forced"))
    assert unmarked(on) == off, (name, chain, first_difference(steps(off), steps(on)) if n_probs else None)
    for key in ("stop_reason", "tokens_predicted", "stop", "schemaValid"):
        assert f_on.get(key) == f_off.get(key), key
    for t in on:
        if t.get("forced") and n_probs:
            assert t["steered_logprob"] == 0.0 and len(t["steered_top"]) == 1


@pytest.mark.parametrize("name", ["person", "anyof_refs"])
def test_forced_tokens_take_their_draws_of_the_random_stream(det, name):
    """At temperature 0.8, a run whose sampler runs on every forced row (nProbs: each
    such sample draws its own uniform) and one where each forced token only takes its
    draw give the same tokens, seed after seed: the free tokens after a run draw the
    numbers token by token would give them."""
    for seed in (1, 2, 3):
        a, _ = run(det, **job(name), maxTokens=MAX_TOKENS, temperature=0.8, seed=seed, jumpForward=True, nProbs=2)
        b, fb = run(det, **job(name), maxTokens=MAX_TOKENS, temperature=0.8, seed=seed, jumpForward=True)
        assert [t["token"] for t in a] == [t["token"] for t in b], seed
        assert [bool(t.get("forced")) for t in a] == [bool(t.get("forced")) for t in b]
        assert fb["forced_tokens"] > 0


def test_forced_log_probabilities_are_the_chunk_rows(det):
    """A forced token's log-probability comes from its own row of the chunk: the row of
    the same text fed as a prompt, and token by token's, bit for bit."""
    on, _ = run(det, **job("person"), maxTokens=4, temperature=0, nProbs=3, jumpForward=True)
    off, _ = run(det, **job("person"), maxTokens=4, temperature=0, nProbs=3)
    i = next(i for i, t in enumerate(on) if t.get("forced"))
    text = "".join(t["piece"] for t in on[:i])
    fed, _ = run(det, prompt=job("person")["prompt"] + text, maxTokens=1, temperature=0, nProbs=N_TOP * 4)
    assert on[i]["token"] in {x["token"] for x in fed[0]["top"]}
    ref = next(x["logprob"] for x in fed[0]["top"] if x["token"] == on[i]["token"])
    assert on[i]["logprob"] == ref
    assert on[i]["token"] == off[i]["token"] and on[i]["logprob"] == off[i]["logprob"]


def test_a_generated_token_is_its_text_fed_as_a_prompt(det):
    """A grammar request's tokens are decoded beside the token before them (engine/plan.py),
    so each sampled token's row is the row of its text fed as a prompt: the same raw
    log-probability of the token and the same alternatives, bit for bit."""
    toks, _ = run(det, **job("nested"), maxTokens=MAX_TOKENS, temperature=0, nProbs=N_TOP)
    n_prompt = _n_prompt(det)
    for i in (3, 9, 20):
        text = "".join(t["piece"] for t in toks[:i])
        fed, final = run(det, 1, prompt=job("nested")["prompt"] + text, maxTokens=1, temperature=0, nProbs=64)
        assert final["tokens_prompt"] + final["tokens_reused"] == n_prompt + i, "the text re-tokenizes as generated"
        assert fed[0]["top"][:N_TOP] == toks[i]["top"], i
        assert {x["token"]: x["logprob"] for x in fed[0]["top"]}[toks[i]["token"]] == toks[i]["logprob"], i


def _n_prompt(c) -> int:
    """The tokens of the "nested" job's prompt."""
    _, final = run(c, 1, prompt=job("nested")["prompt"], maxTokens=0)
    return final["tokens_prompt"] + final["tokens_reused"]


def test_more_sequences_than_a_micro_batch_pairs():
    """nUbatch 6 pairs three sequences a tick (llama.cpp cuts a micro-batch of several
    streams into equal columns), so eight grammar requests take turns, and each prompt's
    chunks are cut so that no micro-batch holds a lone row: every output is the one of
    the same request alone on a server with the default nUbatch, bit for bit."""
    names = ["person", "nested", "order", "anyof_refs", "optional", "numbers", "phone", "enum"]
    outs = {}
    for ub in (6, None):
        c = spawn_server(deterministic=True, nSeqMax=8, **({"nUbatch": ub} if ub else {}))
        try:
            for name in names:
                c.grammar(f"s-{name}", schema_text(SCHEMAS[name][0]))
            if ub:
                for sid, name in enumerate(names):
                    c.infer(sid, **job(name), maxTokens=24, temperature=0.8, seed=sid, nProbs=2)
                outs[ub] = {name: c.collect(sid)[0] for sid, name in enumerate(names)}
            else:
                outs[ub] = {name: run(c, sid, **job(name), maxTokens=24, temperature=0.8, seed=sid, nProbs=2)[0]
                            for sid, name in enumerate(names)}
        finally:
            c.close()
    assert outs[6] == outs[None]


def test_pairs_over_the_micro_batch_take_turns_beside_other_kinds():
    """nUbatch 4 pairs two sequences a tick; four grammar requests beside one without a
    grammar: the least recently fed pairs go first, so no grammar request waits more than
    a round of two pair ticks, and with prompt, lone and pair ticks taking turns a pair
    tick comes at least every third tick: at most 6 ticks between two of its tokens
    (before pairs went least recently fed first, one waited 23)."""
    c = spawn_server(deterministic=True, nSeqMax=5, nUbatch=4)
    try:
        names = ["person", "nested", "order", "anyof_refs"]
        for name in names:
            c.grammar(f"s-{name}", schema_text(SCHEMAS[name][0]))
        c.infer(4, prompt=chat("Name three rivers."), maxTokens=40, temperature=0, logit_bias=EOG_BANS)
        for sid, name in enumerate(names):
            c.infer(sid, **job(name), maxTokens=12, temperature=0)
        gaps = {name: c.collect(sid)[1].get("max_gap_ticks", 1) for sid, name in enumerate(names)}
        c.collect(4)
    finally:
        c.close()
    assert max(gaps.values()) <= 6, gaps


def test_a_run_beside_other_sequences_is_the_same_bits(det):
    """Deterministic mode's promise holds for forced chunks and pairs: the same events
    alone and while three other sequences generate, two with a grammar (pairs, chunks)
    and one without (lone tokens, in ticks of their own: plan.next_kind), whose events
    are its own alone's too."""
    args = dict(**job("nested"), maxTokens=MAX_TOKENS, temperature=0.8, seed=5, nProbs=2, jumpForward=True)
    plain = dict(prompt=chat("Name three rivers."), maxTokens=MAX_TOKENS, temperature=0.8, seed=3, nProbs=2)
    alone, _ = run(det, **args)
    plain_alone, _ = run(det, 3, **plain)
    for sid, name in ((1, "person"), (2, "order")):
        det.infer(sid, **job(name), maxTokens=MAX_TOKENS, temperature=0.8, seed=sid, jumpForward=sid != 2)
    det.infer(3, **plain)
    beside, _ = run(det, 0, **args)
    for sid in (1, 2):
        det.collect(sid)
    assert beside == alone
    assert det.collect(3)[0] == plain_alone


def test_max_tokens_cuts_a_forced_run(det):
    """maxTokens counts forced tokens: a budget that ends inside a forced run ends the
    request there (stop_reason max_tokens), with the tokens token by token would give."""
    off, _ = run(det, **job("anyof_refs"), maxTokens=MAX_TOKENS, temperature=0)
    on, _ = run(det, **job("anyof_refs"), maxTokens=MAX_TOKENS, temperature=0, jumpForward=True)
    k = before_first_chunk(on)
    assert on[k].get("forced") and on[k + 1].get("forced"), "a run of two forced tokens or more"
    cut, final = run(det, **job("anyof_refs"), maxTokens=k + 1, temperature=0, jumpForward=True)
    assert final["stop_reason"] == "max_tokens" and final["tokens_predicted"] == k + 1
    assert [t["token"] for t in cut] == [t["token"] for t in off[:k + 1]]
    assert final["forced_tokens"] == 1


def test_a_stop_string_inside_forced_text_ends_there(det):
    """A stop string completed by a forced token ends the request at that token, as
    token by token (the required key `age` is forced after the name's value)."""
    outs = []
    for jf in (False, True):
        toks, final = run(det, **job("person"), maxTokens=MAX_TOKENS, temperature=0, jumpForward=jf, stop=['"age'])
        assert final["stop_reason"] == "stop" and final["stop"] == '"age', final
        outs.append(toks)
    off, on = outs
    assert [t["token"] for t in on] == [t["token"] for t in off]
    assert on[-1].get("forced") and on[-2].get("forced")  # ` "` and `age`: both forced


def test_repeated_key_ends_as_token_by_token(det):
    """The repeated-key ban (grammar/json_keys.py) with jump-forward: a forced token that
    would close a key the object holds is never fed; the request ends as token by token
    (the same output, stop_reason and count of narrowed masks, the output valid)."""
    det.grammar("two-keys", schema_text(TWO_KEYS))
    outs = []
    for jf in (False, True):
        toks, final = run(det, prompt=REPEAT, grammar_id="two-keys", maxTokens=40, temperature=0, jumpForward=jf)
        outs.append(("".join(t["piece"] for t in toks), final["stop_reason"], final.get("repeatKeyBans")))
    assert outs[0] == outs[1]
    text, reason, _ = outs[1]
    if reason == "grammar":
        jsonschema.validate(json.loads(text), TWO_KEYS)


ONE_KEY = {"type": "object", "patternProperties": {"^aa$": {"type": "integer", "minimum": 0, "maximum": 9}},
           "additionalProperties": False}


def test_a_forced_key_the_object_holds_ends_with_repeated_key(det):
    """Where the grammar forces the only key again (`, "` then `aa` then the closing
    quote), the forced run stops before the token that would close it, and the request
    ends with repeated_key at the same token as token by token, with the same events."""
    det.grammar("one-key", schema_text(ONE_KEY))
    prompt = chat('Copy exactly: {"aa": 1, "aa": 2, "aa": 3}')
    off, f_off = run(det, prompt=prompt, grammar_id="one-key", maxTokens=40, temperature=0, nProbs=2)
    on, f_on = run(det, prompt=prompt, grammar_id="one-key", maxTokens=40, temperature=0, nProbs=2, jumpForward=True)
    assert f_off["stop_reason"] == f_on["stop_reason"] == "repeated_key", (f_off, f_on)
    assert [t["token"] for t in on] == [t["token"] for t in off]
    assert f_on["repeatKeyBans"] == f_off["repeatKeyBans"]
    assert f_on["forced_tokens"] > 0


def test_the_switch(det):
    """jumpForward is a boolean (an error names it otherwise); off, no event is marked;
    without a grammar there is nothing to force (and no `forced_tokens` in `done`)."""
    det.send({"type": "infer", "seq_id": 0, "prompt": "x", "jumpForward": "yes"})
    with pytest.raises(ServerError, match="jumpForward: must be true or false"):
        det.wait(0)
    det.send({"type": "infer", "seq_id": 0, "prompt": "x", "grammar_id": "s-person", "jumpForward": True,
              "capture": ["result_norm"]})
    with pytest.raises(ServerError, match="jumpForward: not with capture"):
        det.wait(0)
    toks, final = run(det, prompt=chat("Say hi."), maxTokens=5, temperature=0, jumpForward=True)
    assert not any("forced" in t for t in toks) and "forced_tokens" not in final


def test_default_mode_chunks_cut_by_a_small_batch():
    """Default mode, nBatch 6 for 4 sequences: the forced chunks are cut to the room a
    tick leaves (the rest goes in the next) and share decodes with the others' tokens;
    each output is its token-by-token run's up to a near-tie, with and without nProbs."""
    c = spawn_server(nSeqMax=4, nBatch=6)
    try:
        names = ["anyof_refs", "nested", "order", "person"]
        for name in names:
            c.grammar(f"s-{name}", schema_text(SCHEMAS[name][0]))
        for n_probs in (N_TOP, 0):
            ref = {}
            for name in names:
                ref[name], _ = run(c, **job(name), maxTokens=MAX_TOKENS, temperature=0, nProbs=N_TOP)
            for sid, name in enumerate(names):
                c.infer(sid, **job(name), maxTokens=MAX_TOKENS, temperature=0, nProbs=n_probs, jumpForward=True)
            for sid, name in enumerate(names):
                toks, final = c.collect(sid)
                assert final["type"] == "done" and final["forced_tokens"] > 0, final
                got = [(t["token"], None, []) for t in toks]  # the rule reads the reference's top only
                assert same_up_to_a_near_tie(steps(ref[name]), got), (name, where_they_part(steps(ref[name]), got))
    finally:
        c.close()
