"""engine/faults.py without a model: the CLICKPACA_FAIL_AT syntax, when `hit` fires, and
`each`, the one way a batch-wide step charges a failure to the item whose part raised.
Through the real server: tests/test_tick_failures.py."""

from __future__ import annotations

import pytest

from clickpaca.engine import faults


def test_parse_entries_points_and_counts():
    got = faults.parse(" sampling:3, accept:4:sent ,capture:5:opened@2,decode:1@1,")
    assert got == {("sampling", 3, None): None, ("accept", 4, "sent"): None,
                   ("capture", 5, "opened"): 2, ("decode", 1, None): 1}
    assert faults.parse("") == {}


@pytest.mark.parametrize("spec, says", [
    ("nope:1", "unknown stage 'nope'"),
    ("accept:1:nowhere", "unknown point accept:nowhere"),
    ("capture:1:sent", "unknown point capture:sent"),
    ("accept:1:sent@0", "at least 1"),
])
def test_parse_names_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match=says) as e:
        faults.parse(spec)
    assert faults.ENV in str(e.value)


@pytest.fixture
def fail_at(monkeypatch):
    """Set the hook's entries as the server reads them at import (CLICKPACA_FAIL_AT)."""
    def set_(spec: str) -> None:
        monkeypatch.setattr(faults, "_AT", faults.parse(spec))
        monkeypatch.setattr(faults, "_reached", {})
    return set_


def test_hit_fires_for_its_stage_seq_and_point_only(fail_at):
    fail_at("sampling:3,accept:4:sent")
    faults.hit("sampling", 2)
    faults.hit("accept", 4)  # the stage's entry: not its point
    faults.hit("accept", 4, "consumed")
    with pytest.raises(faults.InjectedFault, match=r"^sampling: injected failure") as e:
        faults.hit("sampling", 3)
    assert e.value.stage == "sampling"
    with pytest.raises(faults.InjectedFault, match="after its token event was sent"):
        faults.hit("accept", 4, "sent")
    with pytest.raises(faults.InjectedFault):  # without @n: every time
        faults.hit("accept", 4, "sent")


def test_a_count_fires_the_nth_time_only(fail_at):
    fail_at("capture:5:opened@2")
    faults.hit("capture", 5, "opened")
    with pytest.raises(faults.InjectedFault):
        faults.hit("capture", 5, "opened")
    faults.hit("capture", 5, "opened")


class Key:
    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id


def test_each_takes_the_whole_call_when_it_succeeds():
    calls = []
    keys = [Key(1), Key(2)]
    got = faults.each("order", keys, lambda k: calls.append(k) or k.seq_id, lambda ks: [k.seq_id * 10 for k in ks])
    assert got == [10, 20] and calls == []


def test_each_charges_a_failure_to_the_item_whose_part_raised():
    keys = [Key(1), Key(2), Key(3)]

    def alone(k):
        if k.seq_id == 2:
            raise KeyError("two")
        return k.seq_id

    def whole(ks):
        return [alone(k) for k in ks]

    for got in (faults.each("read", keys, alone, whole), faults.each("read", keys, alone)):
        assert got[0] == 1 and got[2] == 3
        assert isinstance(got[1], KeyError)


def test_each_injected_fault_fails_the_whole_call_and_then_that_item(fail_at):
    fail_at("take:2")
    wholes = []
    got = faults.each("take", [Key(1), Key(2)], lambda k: k.seq_id, lambda ks: wholes.append(ks) or [0, 0])
    assert wholes == []  # the call for all failed before it ran
    assert got[0] == 1 and isinstance(got[1], faults.InjectedFault) and got[1].stage == "take"


def test_each_counts_one_reach_per_item_and_call(fail_at):
    """`@n` on a batch-wide stage: each call reaches each item once, whichever path
    serves it; the n-th call charges that item alone."""
    fail_at("arm:2@2")
    wholes = []
    whole = lambda ks: wholes.append(len(ks)) or [0] * len(ks)  # noqa: E731
    assert faults.each("arm", [Key(1), Key(2)], lambda k: k.seq_id, whole) == [0, 0]
    got = faults.each("arm", [Key(1), Key(2)], lambda k: k.seq_id, whole)
    assert got[0] == 1 and isinstance(got[1], faults.InjectedFault)
    assert faults.each("arm", [Key(2)], lambda k: k.seq_id, whole) == [0]
    assert wholes == [2, 1]


def test_describe_names_the_stage():
    assert faults.describe("read", faults.StageFailed("read", "read: x")) == "read: x"
    msg = faults.describe("take", ValueError("bad"))
    assert msg.startswith("internal error at stage take (taking its captured rows") and "ValueError: bad" in msg
