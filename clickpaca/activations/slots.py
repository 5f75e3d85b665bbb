"""The bookkeeping of a context's K steering slots: which registered vector each slot
holds, and which running requests use it.

A `vector` request registers a direction set under (owner, id) and takes a free slot;
with every slot taken the registration is refused (SlotsFull: the policy, stated in
docs/ACTIVATIONS.md: an error, never a wait or an eviction, so a running request's
vector is never replaced under it). A request that steers takes a use of each slot it
names (`acquire`) for its whole life. `free` forgets the id at once (no new request can
name it) but a slot still used keeps its directions until its last user ends
(`release`), then it is cleared and free: a request is steered by what it named from
its first token to its last. Pure: steering.py does the native side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


class SlotsFull(ValueError):
    """Every slot holds a vector (registered, or freed but still in use)."""


@dataclass
class SlotBook:
    k: int
    by_key: dict = field(default_factory=dict)  # (owner, id) -> slot
    key_of: list = field(default_factory=list)  # slot -> (owner, id), or None once freed / empty
    users: list = field(default_factory=list)  # slot -> running requests using it
    serial: list = field(default_factory=list)  # slot -> the registration it holds (0: none)
    next_serial: int = 1

    def __post_init__(self) -> None:
        self.key_of = [None] * self.k
        self.users = [0] * self.k
        self.serial = [0] * self.k

    def _empty(self, slot: int) -> bool:
        return self.serial[slot] == 0

    def register(self, owner: Hashable, vid: str) -> int:
        """A free slot for (owner, vid); KeyError if registered; SlotsFull if none is free."""
        key = (owner, vid)
        if key in self.by_key:
            raise KeyError(vid)
        slot = next((s for s in range(self.k) if self._empty(s)), None)
        if slot is None:
            busy = sum(1 for s in range(self.k) if self.key_of[s] is None)
            raise SlotsFull(f"all {self.k} vector slots are taken ({busy} by freed vectors still in use "
                            "by running requests); free one (init vectorSlots sets how many)")
        self.by_key[key] = slot
        self.key_of[slot] = key
        self.serial[slot] = self.next_serial
        self.next_serial += 1
        return slot

    def slot(self, owner: Hashable, vid: str) -> int | None:
        return self.by_key.get((owner, vid))

    def free(self, owner: Hashable, vid: str) -> int | None:
        """Forget (owner, vid); the slot to clear now (None: unknown id, or still in use:
        cleared by the last `release`)."""
        slot = self.by_key.pop((owner, vid), None)
        if slot is None:
            return None
        self.key_of[slot] = None
        if self.users[slot] == 0:
            self.serial[slot] = 0
            return slot
        return None

    def close(self, owner: Hashable) -> list[int]:
        """Every vector of `owner` freed (its connection ended); the slots to clear now."""
        cleared = [self.free(o, v) for (o, v) in [k for k in self.by_key if k[0] == owner]]
        return [s for s in cleared if s is not None]

    def acquire(self, slots: list[int]) -> list[int]:
        """A request starts using `slots`; returns the registrations it holds (for checks)."""
        for s in slots:
            assert not self._empty(s), s
            self.users[s] += 1
        return [self.serial[s] for s in slots]

    def release(self, slots: list[int]) -> list[int]:
        """A request using `slots` ended; the freed slots now unused, to clear."""
        out = []
        for s in slots:
            self.users[s] -= 1
            assert self.users[s] >= 0, s
            if self.users[s] == 0 and self.key_of[s] is None and not self._empty(s):
                self.serial[s] = 0
                out.append(s)
        return out
