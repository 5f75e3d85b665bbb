"""clickpaca.engine.sequences without a model: slots, the active order, every ending.

A stand-in context records the KV operations. Every ending frees the slot and the
sequence's cells at once and says so exactly once (`done`, `error`, or nothing); when
the last slot comes back the cache is cleared, so new requests start at the first cells.
"""

from __future__ import annotations

import pytest

from clickpaca.engine.jobs import InferJob, PrefillJob, ScoreJob
from clickpaca.engine.sequences import Sequences, Session
from clickpaca.wire.protocol import ProtocolError


class FakeContext:
    def __init__(self, n_seq_max: int) -> None:
        self.n_seq_max = n_seq_max
        self.calls: list[tuple] = []

    def seq_rm(self, slot: int, p0: int, p1: int) -> None:
        self.calls.append(("seq_rm", slot, p0, p1))

    def clear(self) -> None:
        self.calls.append(("clear",))


def setup(n: int = 3):
    ctx = FakeContext(n)
    events: list[dict] = []
    return ctx, Sequences(ctx), Session(send=events.append), events


def test_ids_outside_nseqmax_are_refused_naming_the_field():
    _, seqs, _, _ = setup(4)
    seqs.check_id(0, "infer")
    seqs.check_id(3, "infer")
    for bad in (-1, 4):
        with pytest.raises(ProtocolError) as ei:
            seqs.check_id(bad, "fork", "dst_seq_id")
        assert ei.value.message == f"dst_seq_id: must be in 0..3 (nSeqMax), got {bad}"
        assert ei.value.request == "fork"


def test_slots_run_out_then_come_back():
    ctx, seqs, session, events = setup(2)
    a, b = seqs.new(session, 7, "infer"), seqs.new(session, 9, "score")
    assert {a.slot, b.slot} == {0, 1} and session.seqs == {7: a, 9: b}
    with pytest.raises(ProtocolError, match="^seq_id: no free sequence slot"):
        seqs.new(session, 8, "infer")
    seqs.release(a)
    assert session.seqs == {9: b} and ctx.calls == [("seq_rm", a.slot, -1, -1)]
    assert seqs.new(session, 8, "infer").slot == a.slot
    assert events == []


def test_the_last_slot_back_clears_the_cache_and_waiting_prompts_retry():
    ctx, seqs, session, _ = setup(2)
    a, b = seqs.new(session, 0, "infer"), seqs.new(session, 1, "infer")
    seqs.start(a, InferJob()), seqs.start(b, InferJob())
    b.kv_wait = True
    seqs.release(a)
    assert seqs.order == [b] and not b.kv_wait and ("clear",) not in ctx.calls
    seqs.release(b)
    assert seqs.order == [] and ctx.calls[-1] == ("clear",)


def test_each_ending_says_so_once():
    _, seqs, session, events = setup(3)
    a, b, c = (seqs.new(session, i, kind) for i, kind in enumerate(("infer", "score", "prefill")))
    for seq, job in ((a, InferJob()), (b, ScoreJob()), (c, PrefillJob())):
        seqs.start(seq, job)
    seqs.finish(a, "stop", stop="\n")
    assert events[-1]["type"] == "done" and events[-1]["stop_reason"] == "stop" and events[-1]["stop"] == "\n"
    assert events[-1]["tokens_predicted"] == 0 and "request" not in events[-1]
    seqs.fail(b, "decode failed")
    assert events[-1] == {"type": "error", "seq_id": 1, "message": "decode failed", "request": "score"}
    seqs.finish(c, "cancelled")
    assert events[-1] == {"type": "done", "seq_id": 2, "stop_reason": "cancelled", "request": "prefill"}
    assert len(events) == 3 and seqs.order == [] and session.seqs == {}


def test_finish_all_and_close_session():
    _, seqs, session, events = setup(3)
    other = Session(send=lambda ev: None, name="other")
    a, b = seqs.new(session, 0, "infer"), seqs.new(session, 1, "infer")
    held = seqs.new(session, 2, "prefill")  # no job: held
    assert held.held
    seqs.start(a, InferJob()), seqs.start(b, InferJob())
    seqs.finish_all("shutdown")
    assert [(e["seq_id"], e["stop_reason"]) for e in events] == [(0, "shutdown"), (1, "shutdown")]
    assert session.seqs == {2: held}  # held state is not running: it stays
    mine, theirs = seqs.new(session, 0, "infer"), seqs.new(other, 0, "infer")
    seqs.start(mine, InferJob()), seqs.start(theirs, InferJob())
    seqs.close_session(session)  # the client went away: nobody to tell
    assert len(events) == 2 and session.seqs == {} and seqs.order == [theirs]
    assert len(seqs.free_slots) == 2


def test_a_failed_request_gives_back_the_slots_it_took():
    """Engine._apply clears `taken` before a request and gives it back when the request
    fails: a slot it took is freed; one another ending already freed is left alone."""
    ctx, seqs, session, events = setup(3)
    kept = seqs.new(session, 0, "prefill")  # an earlier request's
    seqs.taken = []
    a, b = seqs.new(session, 1, "prefill"), seqs.new(session, 2, "infer")
    assert seqs.taken == [a, b]
    seqs.release(b)  # already ended (say, a failed decode)
    seqs.give_back()
    assert session.seqs == {0: kept} and sorted(seqs.free_slots) == sorted({a.slot, b.slot})
    assert ctx.calls.count(("seq_rm", b.slot, -1, -1)) == 1 and seqs.taken == [] and events == []


def test_a_client_holds_at_most_its_share():
    _, seqs, session, _ = setup(4)
    session.max_seqs = 2
    other = Session(send=lambda ev: None, name="other", max_seqs=2)
    seqs.new(session, 0, "infer"), seqs.new(session, 1, "prefill")
    with pytest.raises(ProtocolError) as ei:
        seqs.new(session, 2, "infer")
    assert ei.value.message == ("seq_id: this client holds 2 sequences, its share "
                                "(--max-seqs-per-client 2)") and ei.value.seq_id == 2
    assert len(seqs.free_slots) == 2  # nothing taken by the refusal
    seqs.new(other, 0, "infer")  # the others' share is theirs


def test_one_place_for_active_a_job_in_the_order():
    """A sequence is active exactly while it has a job, and then it is in the order."""
    _, seqs, session, events = setup(2)
    a = seqs.new(session, 0, "prefill")
    assert a.held and a.job is None and seqs.order == []
    seqs.start(a, PrefillJob(n_prompt=3))
    assert not a.held and seqs.order == [a]
    seqs.hold(a)  # a prefill's end
    assert a.held and seqs.order == [] and session.seqs == {0: a}
    seqs.start(a, InferJob())
    seqs.fail(a, "boom")
    assert a.job is None and seqs.order == [] and events[-1]["request"] == "infer"
