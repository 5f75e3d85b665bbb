"""The tick's plan, decided once: what each sequence feeds and whether it samples.

A pure function over descriptions of the active sequences (no model, no batch), so the
rules are testable on their own (tests/test_engine_plan.py). The scheduler fills the
batch from the plan, and after the decode reads everything it needs from the same
entries: how far each sequence advanced, which logits rows are whose, who samples.

The rules: each generating sequence's tokens first (one, or its sampled token and the
grammar's forced ones after it, engine/jump.py, cut so that one token is left for each
generating sequence after it: nBatch >= nSeqMax, so they always fit), then prompt (and scoring) chunks of the other sequences, fewest tokens left
first (ties: arrival order), as many tokens as the batch still holds; a long prompt is
split across ticks. Arrival order let one long prompt or score take the whole batch tick
after tick while a one-token request behind it waited for all of it (114.6 s behind a
40,000-character score); fewest-left-first lets short prompts through within a tick and
gives the long one the rest of the batch. A sequence waiting for KV room, or every prompt when the
scheduler defers them, is left out.

Deterministic mode (`pair_rows`): a generated token of a request with a grammar
(engine/jump.py `pairs`) is decoded beside the token before it, fed again into the same
cell (its Want starts there, `refed`; the scheduler removes that cell before it fills the
batch), so that no sequence is ever its stream's only row in a decode: a lone row takes
other kernels than two or more (docs/DETERMINISM.md), and with pairs a generated token's
bits are those of the same text fed as a prompt, forced chunk or not (docs/GRAMMARS.md,
"Jump-forward"). llama.cpp cuts a micro-batch of several streams into equal columns, so
a tick pairs at most n_ubatch // 2 sequences; the others wait, the least recently fed
going first (`Want.last_tick`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..wire.scoring import chunk_rows


@dataclass(slots=True)
class Want:
    """What one active sequence asks of a tick."""

    key: Any  # the sequence (the planner only hands it back)
    generating: bool  # one sampled token to feed; else a prompt or scoring chunk
    n_past: int  # tokens in its KV cells: the position of the first token it feeds
    n_tokens: int  # tokens known (fed or not): it feeds positions n_past .. n_tokens - 1
    out_from: int  # positions out_from .. out_to get a logits row when fed
    out_to: int
    samples_at_end: bool  # it samples from the row of its last known token
    waiting: bool = False  # waits for KV room (a decode found none)
    refed: int = 0  # its first `refed` tokens (from n_past) are in the KV cells already: fed again
    last_tick: int = -1  # the tick of its last token (pairs that wait: the least recent go first)


@dataclass(slots=True)
class Feed:
    """One sequence's share of a tick's batch."""

    key: Any
    generating: bool
    pos: int  # position of the first token fed (the sequence's n_past)
    count: int  # tokens fed: positions pos .. pos + count - 1
    at: int  # index of its first token in the batch
    row_pos: int  # position of the token behind its first logits row
    rows: range  # its logits rows in the tick's output, in position order
    ends: bool  # after this decode, every known token is in the KV cells
    samples: bool  # it samples from its last row after the decode
    refed: int = 0  # its first `refed` tokens are in the KV cells already: fed again (Want.refed)


#: deterministic mode's kinds of tick (`next_kind`): one prompt chunk, generated tokens
#: each its sequence's only row, generated tokens each beside the one before it
PROMPT, LONE, PAIRS = "prompt", "lone", "pairs"
_KINDS = (PROMPT, LONE, PAIRS)


def kind_of(w: Want) -> str | None:
    """The kind of tick that feeds this want in deterministic mode (None: it waits)."""
    if w.generating:
        return PAIRS if w.refed else LONE
    return PROMPT if not w.waiting and w.n_tokens > w.n_past else None


def next_kind(wants: Sequence[Want], last: str | None) -> str | None:
    """Deterministic mode's next kind of tick: it never mixes prompt chunks, lone
    generated tokens and pairs in one decode, since llama.cpp cuts a batch of several
    streams into micro-batches of equal columns, which would leave a prompt's or a
    pair's token alone in one; with several kinds waiting they take turns."""
    present = {kind_of(w) for w in wants}
    start = _KINDS.index(last) + 1 if last in _KINDS else 0
    return next((k for i in range(len(_KINDS)) if (k := _KINDS[(start + i) % len(_KINDS)]) in present), None)


def plan_tick(wants: Sequence[Want], n_batch: int, defer_prompts: bool = False,
              one_prompt: bool = False, pair_rows: int = 0, n_ubatch: int | None = None,
              only: str | None = None) -> list[Feed]:
    """The tick's feeds, in batch order: generating sequences, then prompt chunks.

    `one_prompt` is deterministic mode's prompt tick (docs/DETERMINISM.md): no generating
    sequence, one prompt chunk, and never a chunk of one token where the prompt has more
    (llama.cpp's attention takes another kernel path for a sequence's lone token, so a
    prompt token must always be decoded with at least one other of its sequence; a
    generated token always with the one before it: `pair_rows`, the most sequences a
    tick may pair, the least recently fed first when there are more; `n_ubatch`,
    the rows of llama.cpp's micro-batch, so that its cut of a chunk leaves no lone row
    either; `only`, LONE or PAIRS: deterministic mode's tick of one kind, `next_kind`)."""
    if one_prompt:
        return _one_prompt(wants, n_batch, n_ubatch)
    if only is not None:
        wants = [w for w in wants if kind_of(w) == only]
    plan: list[Feed] = []
    used = row = 0

    def add(w: Want, count: int) -> None:
        nonlocal used, row
        row_pos, n_rows = chunk_rows(w.n_past, count, w.out_from, w.out_to)
        ends = w.n_past + count == w.n_tokens
        plan.append(Feed(w.key, w.generating, w.n_past, count, used, row_pos,
                         range(row, row + n_rows), ends,
                         samples=ends and w.samples_at_end and n_rows > 0, refed=w.refed))
        used += count
        row += n_rows

    gens = [w for w in wants if w.generating]
    pairs, later = _pairs(gens, n_batch, pair_rows)
    gens = [w for w in gens if id(w) not in later]
    for i, w in enumerate(gens):  # a forced chunk (jump.py) leaves one token for each after it
        if id(w) in pairs:
            add(w, w.n_tokens - w.n_past)
        else:
            add(w, max(1, min(w.n_tokens - w.n_past, n_batch - used - (len(gens) - i - 1))))
    prompts = sorted((w for w in wants if not w.generating), key=lambda w: w.n_tokens - w.n_past)
    for w in prompts:
        if used == n_batch or defer_prompts or w.waiting:
            continue
        add(w, min(n_batch - used, w.n_tokens - w.n_past))
    return plan


def _pairs(gens: list[Want], n_batch: int, pair_rows: int) -> tuple[set[int], set[int]]:
    """The ids of the pairing wants this tick feeds, and of those that wait for a later
    tick: at most `pair_rows` pairs (none when it is 0: no pairing), and no more than the
    batch holds beside the other generating sequences' tokens; the least recently fed
    first (ties: batch order), so none waits while another is fed twice. The feeds keep
    batch order."""
    able = [w for w in gens if kind_of(w) == PAIRS] if pair_rows > 0 else []
    if not able:
        return set(), set()
    room = min(pair_rows, len(able), (n_batch - (len(gens) - len(able))) // 2)
    ids = [id(w) for w in sorted(able, key=lambda w: w.last_tick)]
    return set(ids[:room]), set(ids[room:])


def _one_prompt(wants: Sequence[Want], n_batch: int, n_ubatch: int | None = None) -> list[Feed]:
    """The chunk of the prompt with the fewest tokens left (ties: arrival order): as many
    tokens as the batch holds, but never leaving exactly one for a later chunk, nor for
    the last micro-batch llama.cpp cuts it into (every n_ubatch rows)."""
    prompts = [w for w in wants if not w.generating and not w.waiting and w.n_tokens > w.n_past]
    if not prompts:
        return []
    w = min(prompts, key=lambda w: w.n_tokens - w.n_past)
    left = w.n_tokens - w.n_past
    count = min(n_batch, left)
    u = n_ubatch or n_batch
    while count > 2 and (left - count == 1 or (u > 1 and count % u == 1)):
        count -= 1  # n_batch >= 3 in deterministic mode: count stays >= 2
    row_pos, n_rows = chunk_rows(w.n_past, count, w.out_from, w.out_to)
    ends = count == left
    return [Feed(w.key, False, w.n_past, count, 0, row_pos, range(0, n_rows), ends,
                 samples=ends and w.samples_at_end and n_rows > 0)]
