"""A test hook: make one stage of one sequence's service in a tick fail, on purpose, and
the one way a batch-wide step finds whose part failed (`each`).

Every stage at which a tick serves one sequence (scheduler.py) is guarded so that a
failure there ends that sequence alone with an `error` naming the stage, and the others
in the tick go on. The steps that serve several sequences in one call (the grammar
masks, the capture's arm and take, the pre-selection's orders and reads, the sampling)
go through `each`: the call for all of them first, and when it raises, each sequence's
part alone, so that the failure is charged to the sequence whose part raised. Most of
those failures cannot be provoked by a request (they are bugs, or a disk that fails),
so the tests provoke them here:

    CLICKPACA_FAIL_AT="sampling:3,capture:5" clickpaca serve

makes the named stage raise `InjectedFault` whenever it serves seq_id 3 (and 5). An
entry is `stage:seq_id[:point][@n]`:

- `stage:seq_id` fails the stage as it starts serving that seq_id;
- `stage:seq_id:point` fails it at a named point inside it, after it has done part of
  its work (`POINTS`): `accept:3:sent` after the token event went out, `accept:3:consumed`
  after the grammar consumed the token (no event sent), `capture:3:opened` with the
  capture file created and half written;
- `@n` (n >= 1) fails only the n-th time the server reaches that stage (or point) for
  that seq_id (`capture:3:opened@2`: the second capture file of seq_id 3, the first one
  written whole; `read:3@2`: its second tick's read, a stage a tick reaches once for
  each sequence). Without it, every time.

Read once, at import; unset (the default), each check is one test of an empty set. The
stages, in tick order, are `STAGES`; `TICK_STAGES` are those that serve the whole batch
(a failure there is the tick's, not one sequence's).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable, Sequence

#: stage -> what it is, in the order a tick reaches them (the error names the stage)
STAGES = {
    "prepare": "the tick's preparation of the sequence (its overflow check and plan entry)",
    "arm": "arming the capture of its rows in the decode",
    "order": "its row's pre-selection order for the decode",
    "mask": "its grammar mask, filled while the decode runs",
    "take": "taking its captured rows after the decode",
    "readout": "its share of the decode's activation capture",
    "feed": "its share of the decode's logits (a score's NLL, an end, a row to sample)",
    "read": "reading its row's pre-selected values after the decode",
    "sampling": "drawing its token",
    "accept": "accepting the drawn token (history, grammar, text, stop strings)",
    "send": "sending one of its events",
    "capture": "writing its capture file",
    "end": "building the event that ends its request",
}

#: (stage, point) -> where inside the stage it fails: after part of its work is done
POINTS = {
    ("accept", "consumed"): "after the grammar consumed the token, before its token event",
    ("accept", "sent"): "after its token event was sent",
    ("capture", "opened"): "with the capture file created and half written",
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


def parse(spec: str) -> dict[tuple[str, int, str | None], int | None]:
    """"stage:seq_id[:point][@n],..." -> {(stage, seq_id, point): n or None (every time)};
    ValueError naming an unknown stage or point, or a bad count."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        entry, at, count = part.partition("@")
        stage, _, rest = entry.partition(":")
        sid, _, point = rest.partition(":")
        if stage not in STAGES and stage not in TICK_STAGES:
            raise ValueError(f"{ENV}: unknown stage {stage!r} (one of {', '.join([*STAGES, *TICK_STAGES])})")
        if point and (stage, point) not in POINTS:
            raise ValueError(f"{ENV}: unknown point {stage}:{point} (one of "
                             f"{', '.join(f'{s}:{p}' for s, p in POINTS)})")
        n = int(count) if at else None
        if n is not None and n < 1:
            raise ValueError(f"{ENV}: {part!r}: the count after @ must be at least 1")
        out[(stage, int(sid), point or None)] = n
    return out


_AT = parse(os.environ.get(ENV, ""))
_reached: dict[tuple[str, int, str | None], int] = {}  # times each entry of _AT was reached


def _reach(stage: str, seq_id: int | None, point: str | None = None) -> bool:
    """Count one reach of this stage (point) for this seq_id; whether CLICKPACA_FAIL_AT
    fails it now."""
    key = (stage, seq_id, point)
    if key not in _AT:
        return False
    n = _reached[key] = _reached.get(key, 0) + 1
    return _AT[key] in (None, n)


def _fault(stage: str, point: str | None = None) -> InjectedFault:
    where = STAGES.get(stage) or TICK_STAGES[stage]
    if point is not None:
        where = f"{where}, {POINTS[(stage, point)]}"
    return InjectedFault(stage, f"{stage}: injected failure ({ENV}), {where}")


def hit(stage: str, seq_id: int | None, point: str | None = None) -> None:
    """Raise InjectedFault when CLICKPACA_FAIL_AT names this stage (at this point) for
    this seq_id (and this is the n-th time, for an entry with @n)."""
    if _AT and _reach(stage, seq_id, point):
        raise _fault(stage, point)


def each(stage: str, items: Sequence[Any], alone: Callable[[Any], Any],
         whole: Callable[[list], Sequence[Any]] | None = None,
         seq_ids: Sequence[int | None] | None = None) -> list[Any]:
    """One result per item of a step that serves several sequences: `whole(items)` (one
    call for all, when given) and, when that raises, `alone(item)` for each item, so that
    a failure is charged to the item whose part raised: its exception stands in its
    place in the list. Without `whole`, each item alone from the start. `seq_ids` (by
    default each item's `seq_id`) are what the tests' hook reads (`hit`)."""
    items = list(items)
    due = [False] * len(items)
    if _AT:  # the tests' hook: one reach of each item
        ids = list(seq_ids) if seq_ids is not None else [getattr(it, "seq_id", None) for it in items]
        due = [_reach(stage, sid) for sid in ids]
    if whole is not None:
        try:
            if any(due):  # the tests' way to fail the call for all
                raise InjectedFault(stage, f"{stage}: injected failure ({ENV}) of the call for all")
            return list(whole(items))
        except Exception as e:  # noqa: BLE001 - find whose part it was, below
            if not isinstance(e, StageFailed):
                traceback.print_exc(file=sys.stderr)
    out: list[Any] = []
    for it, failing in zip(items, due):
        try:
            if failing:
                raise _fault(stage)
            out.append(alone(it))
        except Exception as e:  # noqa: BLE001 - this item's; the others go on
            out.append(e)
    return out
