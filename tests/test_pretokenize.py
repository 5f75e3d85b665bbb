"""clickpaca.wire.pretokenize against llama_tokenize itself, on the real default model's vocabulary.

Texts mix the special tokens of Gemma 3 (control tokens, all starting with `<`, and the
user-defined whitespace runs and tags), near misses of them, lone `<`, whitespace and
multi-byte characters; every combination of add_special and parse_special must give the
same ids as llama.cpp. A fixed seed and a "fresh" one: a second fixed seed (conftest.fresh_seed),
so every run repeats; under CLICKPACA_EXPLORE a new random one, printed. The shapes that
were slow in llama.cpp (issue 30) are compared at sizes llama.cpp still handles quickly.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from clickpaca.llama import core
from clickpaca.wire import pretokenize
from clickpaca.llama.models import resolve_model
from clickpaca.llama.native import load
from conftest import TEST_BUILD, fresh_seed

pytestmark = pytest.mark.model

SEED = int(os.environ.get("CLICKPACA_PRETOKENIZE_SEED", "30"))
FRESH_SEED = fresh_seed(SEED)  # fixed; random (printed) under CLICKPACA_EXPLORE
PARTS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused12>",
         "<unused6241>", "<start_of_image>", "<end_of_image>", "[multimodal]", "<table>", "</table>", "<",
         ">", "<<", "<start_of", "start_of_turn>", "\n", "\n\n", "\n\n\n", "\t", "\t\t", " ", "  ", "     ",
         "hello", "Hello world", "é", "😀", "漢字", "x"]


@pytest.fixture(scope="module")
def model():
    m = core.Model(resolve_model(None), nat=load(TEST_BUILD))
    yield m
    m.close()


@pytest.fixture(scope="module")
def vocab(model):
    return pretokenize.Vocab(model)


def same(model, vocab, text: str) -> None:
    for add in (True, False):
        for special in (True, False):
            want = model.tokenize(text, add_special=add, parse_special=special)
            got = vocab.tokenize(text, add, special)
            assert got.dtype == np.int32 and np.array_equal(got, want), (text[:200], add, special)


@pytest.mark.parametrize("seed", [SEED, FRESH_SEED], ids=["fixed", "fresh"])
def test_random_mixtures_tokenize_as_llama_cpp_does(model, vocab, seed):
    print(f"pretokenize seed {seed} (rerun: CLICKPACA_PRETOKENIZE_SEED={seed})")
    r = random.Random(seed)
    for _ in range(600):
        same(model, vocab, "".join(r.choice(PARTS) for _ in range(r.randint(0, 40))))


@pytest.mark.parametrize("text", [
    "", "<" * 3000, "<" * 2999 + "<start_of_turn>", "\n" * 1000, "\n" * 31 + "\n" * 5, " " * 100 + "\t" * 70,
    "a\n" * 2000, "<start_of_turn>user\n<end_of_turn>\n" * 200, "<unused" * 300, "<bos>" * 50 + "hi",
], ids=["empty", "3000 <", "run then token", "1000 newlines", "36 newlines", "spaces and tabs",
        "2000 short lines", "200 empty turns", "300 near misses", "50 bos"])
def test_the_slow_shapes_tokenize_as_llama_cpp_does(model, vocab, text):
    same(model, vocab, text)


def test_the_special_tokens_alone_can_refuse_a_text_early(vocab):
    with pytest.raises(pretokenize.TooMany) as e:
        vocab.tokenize("a\n" * 5000, True, True, at_most=4096)
    assert e.value.n == 5001  # 5,000 newline tokens and BOS
    assert len(vocab.tokenize("a\n" * 100, True, True, at_most=4096)) == 201
