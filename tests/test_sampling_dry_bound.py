"""Issue 43: DRY's breaker table is bounded in cost and equal to llama.cpp's definition.

llama.cpp (get_overlapping_token_sequences) looks at every token's text: a token whose
text holds the breaker is a breaker alone; a token whose text ends with a proper prefix
of it is followed by the tokens of the rest (at most 20). `reference` is that
definition, token by token; `dry.breakers` must give the same table through its index
(one scan for the tokens holding it, binary searches for the prefixes), tokenizing at
most once per prefix; a set's table is shared by the requests that hold it, and the
tables alive together are bounded (dry.Tables).
tests/test_sampling_oracle.py compares the penalties with llama.cpp's own sampler.
"""

from __future__ import annotations

import random
import threading

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
    got = dry.make_table(vocab, strings)
    assert {t: set(v) for t, v in got.mapping().items()} == reference(vocab, strings)
    assert got.nbytes <= dry.table_max_bytes(vocab, dry.index_of(vocab))


def test_the_issue_line_tokenizes_at_most_once_per_prefix(vocab):
    """64 breakers of 40 characters (the protocol's caps, llama.cpp's length cap): at
    most 39 tokenizations each, whatever they match; repeated breakers count once."""
    hostile = tuple("".join(random.choices("etaoinshr ", k=40)) for _ in range(64))
    before = vocab.tokenized
    table = dry.make_table(vocab, hostile)
    assert vocab.tokenized - before <= 64 * 39
    assert 0 < table.nbytes <= dry.table_max_bytes(vocab, dry.index_of(vocab))
    before = vocab.tokenized
    dry.make_table(vocab, ("y" * 40,) * 64)
    assert vocab.tokenized - before <= 39


def test_a_set_s_table_is_shared_while_held_and_the_recent_ones_are_kept(vocab):
    """Requests with the same set share one table; a table lives while a request holds
    it; after that only the MAX_BREAKER_SETS most recent sets stay."""
    store = dry.Tables()
    sets = [(f"brk{i}",) for i in range(dry.MAX_BREAKER_SETS + 3)]
    held = [store.get(vocab, s, "reader") for s in sets]  # every one held by a "request"
    assert store.get(vocab, sets[0], "reader") is held[0]  # shared, not made again
    assert store.held()[0] == len(sets) and store.builds == {"reader": len(sets), "engine": 0}
    assert store.bytes == sum(t.nbytes for t in held)
    del held
    n, b, kept = store.held()
    assert n == kept == dry.MAX_BREAKER_SETS and b == store.bytes > 0
    assert store.get(vocab, sets[-1], "engine") is not None and store.builds["engine"] == 0  # kept: not made


def test_the_tables_alive_are_bounded_and_a_reader_waits_for_room(vocab, monkeypatch):
    """Past MAX_TABLE_BYTES a reader waits until a request ends (its table freed); the
    engine thread never waits (it is the one that ends requests) and is counted."""
    store = dry.Tables()
    first = store.get(vocab, ("alpha",), "reader")
    monkeypatch.setattr(dry, "MAX_TABLE_BYTES", first.nbytes + 1)
    monkeypatch.setattr(dry, "MAX_BREAKER_SETS", 0)  # nothing kept beyond the requests
    got = []
    t = threading.Thread(target=lambda: got.append(store.get(vocab, ("beta",), "reader")))
    t.start()
    t.join(1.5)
    assert t.is_alive() and not got, "the reader went past the bound"
    engine = store.get(vocab, ("gamma",), "engine")  # does not wait
    assert store.builds["engine"] == 1
    del engine, first  # the requests end
    t.join(30)
    assert got and store.waits == 1 and store.bytes == got[0].nbytes
