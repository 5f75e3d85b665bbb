"""clickpaca.engine.jobs without a model: the infer job's token step (accept, UTF-8,
stops) and its one end decision, driven as the scheduler drives it (its `fed`, then the
scheduler's one batched draw, then its `sampled`), and a scheduler that reads nothing of
a job but the Job interface.

A stand-in model gives a six-token vocabulary (token 0 ends generation, 3 and 4 are the
two bytes of "é"); the sampler is the real one (greedy: the logits row's argmax).
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pytest

import clickpaca.engine.scheduler as scheduler_module
import clickpaca.engine.tick_sampling as tick_sampling_module
from clickpaca.engine.jobs import InferJob, Job, PrefillJob, ScoreJob, Tick
from clickpaca.engine.mask_ahead import MaskJob
from clickpaca.engine.plan import Feed
from clickpaca.engine.scheduler import Scheduler
from clickpaca.engine.sequences import Sequences, Session
from clickpaca.engine.text import StopMatcher
from clickpaca.sampling import SamplerParams, SequenceSampler

PIECES = {0: b"", 1: b"a", 2: b"b", 3: "é".encode()[:1], 4: "é".encode()[1:], 5: b"ST"}
V = len(PIECES)


class Model:
    def is_eog(self, token: int) -> bool:
        return token == 0

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return PIECES[token]


class Context:
    n_seq_max, n_threads = 2, 1
    presampler = None  # the host path (pre-selection: tests/test_server_preselect.py)

    def seq_rm(self, slot: int, p0: int, p1: int) -> None:
        pass

    def clear(self) -> None:
        pass


class Runtime:
    model, ctx = Model(), Context()


def start(max_tokens: int, stop: list[str] | None = None):
    """An infer job on a sequence whose prompt [1, 2] is about to be fed."""
    seqs, events = Sequences(Context()), []
    seq = seqs.new(Session(send=events.append), 0, "infer")
    seq.tokens = [1, 2]
    sampler = SequenceSampler(SamplerParams(temperature=0.0), V, history=seq.tokens)
    job = InferJob(n_prompt=2, sampler=sampler, stops=StopMatcher(stop), max_tokens=max_tokens)
    seqs.start(seq, job)
    return seqs, seq, job, events


def tick(seqs: Sequences, seq, token: int | None) -> None:
    """One tick for the sequence: feed what it has not fed (the prompt, or its last token),
    then, when it samples, draw `token` (the argmax of its row) as the scheduler does."""
    w = seq.job.want(seq)
    count = w.n_tokens - w.n_past
    f = Feed(seq, w.generating, w.n_past, count, 0, w.n_tokens - 1, range(0, 1), True, w.samples_at_end)
    seq.n_past += count
    logits = np.zeros((1, V), np.float32)
    if token is not None:
        logits[0, token] = 5.0
    t = Tick(Runtime(), seqs, logits, time.perf_counter())
    seq.job.fed(t, seq, f)
    assert [(s, r) for s, r, _ in t.draws] == ([(seq, 0)] if w.samples_at_end else [])
    if t.draws:
        Scheduler(Runtime(), seqs)._sample(t, MaskJob([], [], np.zeros((1, 1), np.uint32), None))


def run(max_tokens: int, tokens: list[int], stop: list[str] | None = None):
    seqs, seq, job, events = start(max_tokens, stop)
    for token in tokens:
        assert seq.job is job, events  # still running
        tick(seqs, seq, token)
    assert seq.job is None and not seqs.order, events  # over, and released
    return seq, [{k: v for k, v in ev.items() if not k.endswith(("_ms", "_tps"))} for ev in events]


def test_tokens_are_accepted_into_the_history_and_sent_as_whole_characters():
    seq, events = run(3, [1, 3, 4])
    assert seq.tokens == [1, 2, 1, 3, 4]
    assert [(ev["token"], ev["piece"]) for ev in events[:-1]] == [(1, "a"), (3, ""), (4, "é")]
    assert events[-1] == {"type": "done", "seq_id": 0, "tokens_prompt": 2, "tokens_reused": 0,
                          "tokens_predicted": 3, "stop_reason": "max_tokens"}


def test_a_character_left_unfinished_is_the_done_events_tail():
    _, events = run(2, [1, 3])
    assert events[-1]["stop_reason"] == "max_tokens"
    assert (events[-1]["tail"], events[-1]["tail_bytes"]) == ("\ufffd", [0xC3])


def test_an_end_of_generation_token_ends_it_unsent():
    seq, events = run(5, [1, 0])
    assert [ev["type"] for ev in events] == ["token", "done"]
    assert events[-1]["stop_reason"] == "eos" and events[-1]["tokens_predicted"] == 1
    assert seq.tokens == [1, 2, 1, 0]  # in the history all the same


def test_a_stop_string_across_tokens_ends_it_and_wins_over_max_tokens():
    _, events = run(2, [1, 5], stop=["aS"])
    assert [ev.get("piece") for ev in events[:-1]] == ["a", "ST"]
    assert (events[-1]["stop_reason"], events[-1]["stop"]) == ("stop", "aS")


def test_max_tokens_0_ends_when_the_prompt_is_in_without_a_draw():
    _, events = run(0, [None])
    assert events == [{"type": "done", "seq_id": 0, "tokens_prompt": 2, "tokens_reused": 0,
                       "tokens_predicted": 0, "stop_reason": "max_tokens"}]


@pytest.mark.parametrize("max_tokens,n_predicted,eog,stop,want", [
    (0, 0, False, None, "max_tokens"),
    (4, 1, True, None, "eos"),
    (4, 1, False, "x", "stop"),
    (4, 4, False, "x", "stop"),
    (4, 4, False, None, "max_tokens"),
    (4, 3, False, None, None),
])
def test_the_one_end_decision(max_tokens, n_predicted, eog, stop, want):
    assert InferJob(max_tokens=max_tokens, n_predicted=n_predicted)._over(eog, stop) == want


def test_jobs_that_do_not_sample_have_no_grammar_and_take_no_token():
    for job in (ScoreJob(), PrefillJob()):
        assert job.grammar() is None
        with pytest.raises(NotImplementedError, match="asked for a row it does not take"):
            job.sampled(None, None, 0, None, None)


def test_the_scheduler_reads_only_the_job_interface():
    """No job kind is named in the scheduler or in its tick sampler (tick_sampling.py:
    the one sampling call of a tick), and every attribute they read off a job
    (`….job.x`) is the base Job's."""
    src = "\n".join(Path(m.__file__).read_text() for m in (scheduler_module, tick_sampling_module))
    from_engine = set()
    for m in (scheduler_module, tick_sampling_module):
        t = ast.parse(Path(m.__file__).read_text())
        from_engine |= {(n.module, a.name) for n in ast.walk(t) if isinstance(n, ast.ImportFrom) and n.level == 1
                        for a in n.names}
    tree = ast.parse(src)
    assert ("jobs", "Tick") in from_engine
    assert not [m for m, name in from_engine if m == "jobs" and name != "Tick"]
    assert not [m for m, name in from_engine
                if m not in ("jobs", "mask_ahead", "plan", "runtime", "sequences", "tick_sampling")
                and (m, name) != (None, "faults")]  # the stage names and the tests' hook
    read = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "job"}
    assert {"want", "fed", "sampled", "grammar", "overflow", "read", "t_prompt"} <= read
    assert not [a for a in read if not hasattr(Job, a) and a not in Job.__dataclass_fields__]
    for kind in ("InferJob", "ScoreJob", "PrefillJob"):
        assert kind not in src
