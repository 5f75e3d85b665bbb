"""clickpaca.wire.chat and `messages` in infer/prefill: validation (pure), formatting through
llama.cpp's own templates (real library), and the server end to end (real process, real
models: the default Gemma 3 base model with `chatTemplate`, and SmolLM2-135M-Instruct
with the template in its own GGUF metadata)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clickpaca.wire import chat
from clickpaca.wire.client import Client, ServerError
from conftest import spawn_server

GEMMA_BY_HAND = ("<start_of_turn>user\nYou are terse.\n\nName a colour.<end_of_turn>\n"
                 "<start_of_turn>model\n")
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


# ------------------------------------------------------------------ validation (pure)


@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(chat.ROLES),
                                       "content": st.text().filter(lambda s: "\x00" not in s)}),
                min_size=1, max_size=6))
def test_valid_messages_pass_unchanged(msgs):
    out = chat.check_messages("messages", msgs)
    assert [(m.role, m.content) for m in out] == [(m["role"], m["content"]) for m in msgs]


@pytest.mark.parametrize("value,field,reason", [
    ("hello", "messages", "must be a list"),
    ([], "messages", "must not be empty"),
    (["hi"], "messages[0]", "must be an object"),
    ([{"role": "user"}], "messages[0].content", "missing"),
    ([{"content": "x"}], "messages[0].role", "missing"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "messages[1].role",
     "unknown role 'bot'"),
    ([{"role": "user", "content": 3}], "messages[0].content", "not a string"),
    ([{"role": "user", "content": "a\x00b"}], "messages[0].content", "NUL"),
    ([{"role": "user", "content": "a", "name": "x"}], "messages[0].name", "unknown field"),
])
def test_invalid_messages_name_the_field_and_reason(value, field, reason):
    with pytest.raises(ValueError) as e:
        chat.check_messages("messages", value)
    assert str(e.value).startswith(field + ":") and reason in str(e.value), str(e.value)


# ------------------------------------------------------------------ formatting (library)


@pytest.mark.model
def test_builtin_gemma_template_matches_the_hand_written_turns(model):
    msgs = chat.check_messages("messages", MESSAGES)
    assert chat.format_messages(model, "gemma", msgs, True) == GEMMA_BY_HAND
    without = chat.format_messages(model, "gemma", msgs, False)
    assert without == GEMMA_BY_HAND.removesuffix("<start_of_turn>model\n")
    assert list(model.tokenize(GEMMA_BY_HAND)) == list(
        model.tokenize(chat.format_messages(model, "gemma", msgs, True)))


@pytest.mark.model
def test_base_model_without_template_is_refused_with_the_reason(model):
    assert chat.model_template(model) is None
    with pytest.raises(chat.ChatError, match=r"^messages: the model has no chat template"):
        chat.format_messages(model, None, chat.check_messages("messages", MESSAGES), True)


@pytest.mark.model
def test_unknown_template_name_is_refused_listing_the_builtins(model):
    names = chat.builtin_templates(model.nat)
    assert {"gemma", "chatml", "llama3"} <= set(names)
    with pytest.raises(chat.ChatError, match=r"^chatTemplate: llama.cpp does not know") as e:
        chat.format_messages(model, "no-such-template", chat.check_messages("messages", MESSAGES), True)
    assert "gemma" in str(e.value)


# ------------------------------------------------------------------ the server


def run(c: Client, seq_id: int, **fields) -> tuple[list[int], dict]:
    c.send({"type": "infer", "seq_id": seq_id, "maxTokens": 8, "temperature": 0, **fields})
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return [t["token"] for t in toks], done


@pytest.fixture(scope="module")
def gemma():
    c = spawn_server(nSeqMax=4)
    yield c
    c.close()


@pytest.mark.model
def test_messages_with_gemma_template_equal_the_hand_written_prompt(gemma):
    """Same prompt tokens, and (each run alone on an idle server: the same computation)
    the same greedy tokens."""
    by_hand, done_a = run(gemma, 0, prompt=GEMMA_BY_HAND)
    by_chat, done_b = run(gemma, 0, messages=MESSAGES, chatTemplate="gemma")
    assert done_a["tokens_prompt"] == done_b["tokens_prompt"]
    assert by_hand == by_chat


@pytest.mark.model
@pytest.mark.parametrize("fields,field,reason", [
    ({"messages": MESSAGES}, "messages", "no chat template"),
    ({"messages": MESSAGES, "prompt": "x", "chatTemplate": "gemma"}, "messages", "either prompt or messages"),
    ({"messages": [{"role": "narrator", "content": "x"}], "chatTemplate": "gemma"},
     "messages[0].role", "unknown role"),
    ({"messages": MESSAGES, "chatTemplate": "nonsense"}, "chatTemplate", "does not know"),
    ({"prompt": "x", "chatTemplate": "gemma"}, "chatTemplate", "only applies with messages"),
])
def test_bad_chat_requests_get_an_error_and_the_server_keeps_serving(gemma, fields, field, reason):
    gemma.send({"type": "infer", "seq_id": 1, "maxTokens": 4, **fields})
    ev = list(gemma.stream(1))[-1]
    assert ev["type"] == "error" and ev["request"] == "infer", ev
    assert ev["message"].startswith(field + ":") and reason in ev["message"], ev
    toks, done = run(gemma, 1, prompt="The sky is")  # the slot was not taken
    assert toks and done["stop_reason"] == "max_tokens"


@pytest.mark.model
def test_prefill_messages_then_continue_with_more_messages(gemma):
    """A held conversation continues with more turns: the same prompt tokens as the whole
    conversation written by hand, and greedy tokens equal up to a near-tie (held and cold
    runs differ in batch shape)."""
    from test_server_state import greedy, same_up_to_a_near_tie, where_they_part

    first = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": "Hello Ada."}]
    second = [{"role": "user", "content": "What is my name?"}]
    whole = ("<start_of_turn>user\nMy name is Ada.<end_of_turn>\n<start_of_turn>model\n"
             "Hello Ada.<end_of_turn>\n<start_of_turn>user\nWhat is my name?<end_of_turn>\n"
             "<start_of_turn>model\n")
    held = gemma.request({"type": "prefill", "seq_id": 2, "messages": first,
                          "chatTemplate": "gemma", "addGenerationPrompt": False})
    assert held["type"] == "prefilled"
    gemma.send({"type": "infer", "seq_id": 2, "messages": second, "chatTemplate": "gemma",
                "maxTokens": 8, "temperature": 0, "nProbs": 5})
    toks, cont_done = gemma.collect(2)
    continued = [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top"]])
                 for t in toks]
    cold, cold_done = greedy(gemma, 3, whole, n=8)
    assert held["tokens"] + cont_done["tokens_prompt"] == cold_done["tokens_prompt"] + 1  # + re-fed last
    assert same_up_to_a_near_tie(cold, continued), where_they_part(cold, continued)


@pytest.mark.model
def test_a_models_own_template_from_its_gguf_metadata():
    """SmolLM2-135M-Instruct carries a ChatML template: no chatTemplate needed, and the
    prompt equals the ChatML turns written by hand."""
    from clickpaca.llama.models import smollm2_path

    path = smollm2_path()
    c = spawn_server(modelPath=str(path), nSeqMax=2, nCtx=2048)
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        by_chat, done_a = run(c, 0, messages=msgs)
        by_hand, done_b = run(c, 0, prompt="<|im_start|>user\nWhat is the capital of France?"
                                           "<|im_end|>\n<|im_start|>assistant\n")
        assert done_a["tokens_prompt"] == done_b["tokens_prompt"]
        assert by_chat == by_hand
    finally:
        c.close()
