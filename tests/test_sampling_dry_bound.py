"""Issue 43: DRY's breaker table is bounded in cost and equal to llama.cpp's definition.

llama.cpp (get_overlapping_token_sequences) looks at every token's text: a token whose
text holds the breaker is a breaker alone; a token whose text ends with a proper prefix
of it is followed by the tokens of the rest (at most 20). `reference` is that
definition, token by token; `dry.breakers` must give the same table through its index
(one scan for the tokens holding it, binary searches for the prefixes), tokenizing at
most once per prefix, and the table is kept for a bounded number of breaker sets.
tests/test_sampling_oracle.py compares the penalties with llama.cpp's own sampler.
"""

from __future__ import annotations

import random

import pytest

from clickpaca.sampling import dry
from clickpaca.sampling.vocab import Vocab

pytestmark = pytest.mark.model


class CountingVocab(Vocab):
    """The real vocabulary, counting its tokenize calls."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.tokenized = 0

    def tokenize(self, data: bytes) -> list[int]:
        self.tokenized += 1
        return super().tokenize(data)


@pytest.fixture(scope="module")
def vocab(model):
    return CountingVocab(model)


def reference(vocab: Vocab, strings) -> dict[int, set]:
    out: dict[int, set] = {}
    for s in dict.fromkeys(strings):
        b = s.encode()
        for tok, word in enumerate(vocab.pieces()):
            if b in word:
                out.setdefault(tok, set()).add(())
                continue
            for k in range(min(len(b) - 1, len(word)), 0, -1):
                if word.endswith(b[:k]):
                    out.setdefault(tok, set()).add(tuple(vocab.tokenize(b[k:])[:dry.MAX_TAIL]))
    return out


random.seed(43)
SETS = [("\n", ":", '"', "*"), ("###", "ab", "\n"), ("a\x00b", "\x00"), ("é😀x", "ing "),
        ("<start_of_turn>", " the"), tuple("".join(random.choices("etaoin sh", k=random.randint(1, 40)))
                                           for _ in range(3))]


@pytest.mark.parametrize("strings", SETS, ids=[repr(s)[:30] for s in SETS])
def test_the_table_is_llamacpp_s_definition(vocab, strings):
    got = dry.breakers(vocab, strings)
    assert {t: set(v) for t, v in got.items()} == reference(vocab, strings)


def test_the_issue_line_tokenizes_at_most_once_per_prefix(vocab):
    """64 breakers of 40 characters (the protocol's caps, llama.cpp's length cap): at
    most 39 tokenizations each, whatever they match; repeated breakers count once."""
    hostile = tuple("".join(random.choices("etaoinshr ", k=40)) for _ in range(64))
    before = vocab.tokenized
    dry.breakers(vocab, hostile)
    assert vocab.tokenized - before <= 64 * 39
    before = vocab.tokenized
    dry.breakers(vocab, ("y" * 40,) * 64)
    assert vocab.tokenized - before <= 39


def test_only_the_recent_breaker_sets_are_kept(vocab):
    sets = [(f"brk{i}",) for i in range(dry.MAX_BREAKER_SETS + 3)]
    tables = [dry.breakers(vocab, s) for s in sets]
    kept = vocab.memo("dry-breaker-sets", dry._Recent)
    assert len(kept._sets) == dry.MAX_BREAKER_SETS
    held = dry.held(vocab, 200)
    assert held["entries"] == dry.MAX_BREAKER_SETS and 0 < held["bytes"] <= held["maxBytes"]
    assert dry.breakers(vocab, sets[-1]) is tables[-1]  # the recent ones are not made again
    assert sets[0] not in kept._sets
