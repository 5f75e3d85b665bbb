"""activations/slots.py: the slot books, by a hypothesis state machine over register /
free / close / request start / request end. The property: every running request's
slots hold, from its start to its end, exactly the registrations it named (no request
is ever steered by a vector it did not name), and a slot is free only when no
registration and no request holds it."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from clickpaca.activations.slots import SlotBook, SlotsFull

OWNERS = ["a", "b"]
IDS = ["v0", "v1", "v2", "v3"]


class Books(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.k = 3
        self.book = SlotBook(self.k)
        self.registered: dict = {}  # (owner, id) -> serial it got
        self.running: list = []  # (slots, serials) of each running request
        self.cleared: list = []  # slots the book said to clear

    @rule(owner=st.sampled_from(OWNERS), vid=st.sampled_from(IDS))
    def register(self, owner, vid):
        full = all(self.book.serial[s] for s in range(self.k))
        try:
            slot = self.book.register(owner, vid)
        except KeyError:
            assert (owner, vid) in self.registered
            return
        except SlotsFull:
            assert full  # refused only when every slot holds something
            return
        assert (owner, vid) not in self.registered and not full
        assert self.book.users[slot] == 0
        self.registered[(owner, vid)] = self.book.serial[slot]

    @rule(owner=st.sampled_from(OWNERS), vid=st.sampled_from(IDS))
    def free(self, owner, vid):
        slot = self.book.slot(owner, vid)
        cleared = self.book.free(owner, vid)
        self.registered.pop((owner, vid), None)
        assert self.book.slot(owner, vid) is None
        if cleared is not None:
            assert cleared == slot and self.book.users[slot] == 0

    @rule(owner=st.sampled_from(OWNERS))
    def close(self, owner):
        self.book.close(owner)
        for key in [k for k in self.registered if k[0] == owner]:
            del self.registered[key]

    @rule(owner=st.sampled_from(OWNERS), names=st.lists(st.sampled_from(IDS), min_size=1, max_size=3))
    def start(self, owner, names):
        slots = [self.book.slot(owner, v) for v in names]
        if any(s is None for s in slots):
            return  # the engine refuses a request naming an unknown vector
        slots = sorted(set(slots))
        named = sorted(self.registered[(owner, v)] for v in set(names))
        assert sorted(self.book.acquire(slots)) == named
        self.running.append((slots, [self.book.serial[s] for s in slots]))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def end(self, i):
        slots, _ = self.running.pop(i % len(self.running))
        for s in self.book.release(slots):
            assert self.book.users[s] == 0 and self.book.key_of[s] is None

    @invariant()
    def requests_keep_what_they_named(self):
        for slots, serials in self.running:
            assert [self.book.serial[s] for s in slots] == serials

    @invariant()
    def free_slots_hold_nothing(self):
        for s in range(self.k):
            if self.book.serial[s] == 0:
                assert self.book.users[s] == 0 and self.book.key_of[s] is None
        for key, slot in self.book.by_key.items():
            assert self.book.key_of[slot] == key and self.registered[key] == self.book.serial[slot]


TestBooks = Books.TestCase
TestBooks.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_full_is_an_error_and_a_freed_slot_in_use_stays_taken():
    book = SlotBook(2)
    a, b = book.register("o", "a"), book.register("o", "b")
    with pytest.raises(SlotsFull, match="all 2 vector slots are taken"):
        book.register("o", "c")
    book.acquire([a])
    assert book.free("o", "a") is None  # in use: not cleared
    with pytest.raises(SlotsFull, match="1 by freed vectors still in use"):
        book.register("o", "c")
    assert book.release([a]) == [a]
    assert book.register("o", "c") == a and b == 1
