"""A test hook: make one stage of one sequence's service in a tick fail, on purpose.

Every stage at which a tick serves one sequence (scheduler.py) is guarded so that a
failure there ends that sequence alone with an `error` naming the stage, and the others
in the tick go on. Most of those failures cannot be provoked by a request (they are
bugs, or a disk that fails), so the tests provoke them here:

    CLICKPACA_FAIL_AT="sampling:3,capture:5" clickpaca serve

makes the named stage raise `InjectedFault` whenever it serves seq_id 3 (and 5). Read
once, at import; unset (the default), each check is one test of an empty set. The
stages, in tick order, are `STAGES`; `TICK_STAGES` are those that serve the whole batch
(a failure there is the tick's, not one sequence's).
"""

from __future__ import annotations

import os

#: stage -> what it is, in the order a tick reaches them (the error names the stage)
STAGES = {
    "prepare": "the tick's preparation of the sequence (its overflow check and plan entry)",
    "mask": "its grammar mask, filled while the decode runs",
    "readout": "its share of the decode's activation capture",
    "feed": "its share of the decode's logits (a score's NLL, an end, a row to sample)",
    "sampling": "drawing its token",
    "accept": "accepting the drawn token (history, grammar, text, stop strings)",
    "send": "sending one of its events",
    "capture": "writing its capture file",
    "end": "building the event that ends its request",
}

#: what serves the whole batch: a failure here fails the tick, and the server ends every
#: request in it with an error (stage name -> what it is)
TICK_STAGES = {"decode": "the tick's decode of the batch (named by any sequence in it)"}

ENV = "CLICKPACA_FAIL_AT"


class StageFailed(RuntimeError):
    """A stage of one sequence's service failed for a reason its message names."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class InjectedFault(StageFailed):
    """The failure CLICKPACA_FAIL_AT asked for."""


def describe(stage: str, e: BaseException) -> str:
    """The `error` message of a sequence ended by a failure at `stage`: it names the stage."""
    if isinstance(e, StageFailed):
        return str(e)
    return f"internal error at stage {stage} ({STAGES[stage]}): {type(e).__name__}: {e}"


def parse(spec: str) -> frozenset[tuple[str, int]]:
    """"stage:seq_id,..." -> {(stage, seq_id)}; ValueError naming an unknown stage."""
    out = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, _, sid = part.partition(":")
        if stage not in STAGES and stage not in TICK_STAGES:
            raise ValueError(f"{ENV}: unknown stage {stage!r} (one of {', '.join([*STAGES, *TICK_STAGES])})")
        out.add((stage, int(sid)))
    return frozenset(out)


_AT = parse(os.environ.get(ENV, ""))


def hit(stage: str, seq_id: int | None) -> None:
    """Raise InjectedFault when CLICKPACA_FAIL_AT names this stage for this seq_id."""
    if _AT and (stage, seq_id) in _AT:
        raise InjectedFault(stage, f"{stage}: injected failure ({ENV}), {STAGES.get(stage) or TICK_STAGES[stage]}")
