"""clickpaca.engine.plan without a model: the tick's plan from descriptions of sequences.

The rules (generating sequences first, then prompt chunks, fewest tokens left first, up to nBatch;
waiting and deferred prompts left out) on hand-made cases, and the invariants the
scheduler relies on checked over generated ones: every planned token fits the batch,
the batch positions and logits rows are numbered once and in order, each entry's rows
are exactly its fed positions inside its output span, and a sequence samples iff its
entry says so, from the row of its last known token.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.engine.plan import LONE, PAIRS, PROMPT, Feed, Want, next_kind, plan_tick
from clickpaca.wire.scoring import chunk_rows


def gen(key, n_past):
    return Want(key, True, n_past, n_past + 1, n_past, n_past, True)


def chunk(key, n_past, forced, rows=False):
    """A generating sequence with `forced` grammar-forced tokens after its sampled one
    (engine/jump.py): rows for them too when it needs their log-probabilities."""
    n = n_past + 1 + forced
    return Want(key, True, n_past, n, n_past if rows else n - 1, n - 1, True)


def prompt(key, n_past, n_tokens, samples=True, waiting=False):
    """An infer (samples) or a prefill (no rows)."""
    out_from = n_tokens - 1 if samples else n_tokens
    return Want(key, False, n_past, n_tokens, out_from, n_tokens - 1, samples, waiting)


def score(key, n_past, n_tokens, first):
    return Want(key, False, n_past, n_tokens, first, n_tokens - 2, False)


def test_generating_sequences_go_first_then_prompts_fewest_tokens_left_first():
    plan = plan_tick([prompt("p", 0, 5), gen("g1", 7), prompt("q", 0, 3), gen("g2", 2)], 16)
    assert [f.key for f in plan] == ["g1", "g2", "q", "p"]
    assert [(f.pos, f.count, f.at) for f in plan] == [(7, 1, 0), (2, 1, 1), (0, 3, 2), (0, 5, 5)]
    assert [list(f.rows) for f in plan] == [[0], [1], [2], [3]]
    assert all(f.samples and f.ends for f in plan)


def test_a_forced_chunk_rides_its_sequences_decode_and_leaves_room_for_the_others():
    """The sampled token and the grammar's forced ones after it (engine/jump.py) are fed
    together; rows only where asked (the last, or every one with log-probabilities); cut
    so that each generating sequence after it still feeds its token."""
    a, b = plan_tick([chunk("j", 10, 4), gen("g", 3)], 16)
    assert (a.pos, a.count, list(a.rows), a.row_pos, a.samples) == (10, 5, [0], 14, True)
    assert (b.count, list(b.rows), b.samples) == (1, [1], True)
    a, = plan_tick([chunk("j", 10, 4, rows=True)], 16)
    assert (a.count, list(a.rows), a.row_pos, a.samples) == (5, [0, 1, 2, 3, 4], 10, True)
    a, b = plan_tick([chunk("j", 10, 9), gen("g", 3), prompt("p", 0, 5)], 4)  # the prompt waits
    assert (a.count, a.ends, a.samples, list(a.rows), b.count) == (3, False, False, [], 1)
    later, _ = plan_tick([chunk("j", 13, 6), gen("g", 4)], 4)  # the rest of the chunk next tick
    assert (later.pos, later.count, later.ends, later.samples) == (13, 3, False, False)


def test_a_long_prompt_is_split_and_only_its_last_chunk_samples():
    first = plan_tick([gen("g", 10), prompt("p", 0, 20)], 8)
    assert [(f.key, f.count, f.ends, f.samples, len(f.rows)) for f in first] == [
        ("g", 1, True, True, 1), ("p", 7, False, False, 0)]
    later = plan_tick([gen("g", 11), prompt("p", 14, 20)], 8)
    p = later[1]
    assert (p.pos, p.count, p.ends, p.samples, p.row_pos, list(p.rows)) == (14, 6, True, True, 19, [1])


def test_a_short_prompt_is_not_held_up_behind_a_long_one():
    """Regression (issue 19): a 1-token infer behind a 40,000-character score waited for
    the whole score; fewest-left-first gives it a place in the next tick."""
    plan = plan_tick([score("long", 0, 9000, 256), prompt("short", 0, 1)], 512)
    assert [(f.key, f.count) for f in plan] == [("short", 1), ("long", 511)]


def test_a_full_batch_leaves_the_longest_prompts_for_the_next_tick():
    plan = plan_tick([prompt("a", 0, 4), prompt("b", 0, 9), prompt("c", 0, 2)], 8)
    assert [(f.key, f.count) for f in plan] == [("c", 2), ("a", 4), ("b", 2)]
    same = plan_tick([prompt("x", 0, 3), prompt("y", 0, 3)], 8)  # ties keep arrival order
    assert [f.key for f in same] == ["x", "y"]


def test_waiting_and_deferred_prompts_are_left_out():
    wants = [gen("g", 3), prompt("w", 0, 4, waiting=True), prompt("p", 0, 4)]
    assert [f.key for f in plan_tick(wants, 8)] == ["g", "p"]
    assert [f.key for f in plan_tick(wants, 8, defer_prompts=True)] == ["g"]


def test_a_prefill_feeds_without_rows_and_never_samples():
    (f,) = plan_tick([prompt("p", 3, 9, samples=False)], 16)
    assert (f.pos, f.count, f.ends, f.samples, len(f.rows)) == (3, 6, True, False, 0)


def test_scoring_rows_cover_the_scored_positions_of_the_chunk():
    # a window of 10 tokens whose first 4 positions were scored by the previous window
    a, b = plan_tick([score("s", 0, 10, first=4), gen("g", 5)], 7)
    assert b.key == "s" and (b.pos, b.count, b.row_pos, list(b.rows), b.samples) == (0, 6, 4, [1, 2], False)
    (c,) = plan_tick([score("s", 6, 10, first=4)], 7)
    # positions 6..9 fed; rows for 6..8 (the last token predicts nothing)
    assert (c.row_pos, list(c.rows), c.ends, c.samples) == (6, [0, 1, 2], True, False)


def test_chunk_rows_clips_to_the_fed_positions():
    assert chunk_rows(0, 10, 4, 8) == (4, 5)
    assert chunk_rows(5, 2, 0, 3) == (5, 0)
    assert chunk_rows(0, 0, 0, 9) == (0, 0)


@st.composite
def tick_cases(draw):
    n_batch = draw(st.integers(1, 64))
    wants = []
    n_gen = draw(st.integers(0, n_batch))  # nBatch >= nSeqMax: every generating one fits
    for i in range(n_gen):
        forced = draw(st.sampled_from([0, 0, 0, 1, 5, 40]))
        wants.append(chunk(i, draw(st.integers(0, 1000)), forced, draw(st.booleans())))
    for i in range(n_gen, n_gen + draw(st.integers(0, 8))):
        n_tokens = draw(st.integers(1, 200))
        n_past = draw(st.integers(0, n_tokens - 1))
        kind = draw(st.sampled_from(["infer", "prefill", "score"]))
        waiting = draw(st.booleans())
        if kind == "score" and n_tokens >= 2:
            w = Want(i, False, n_past, n_tokens, draw(st.integers(0, n_tokens - 2)), n_tokens - 2,
                     False, waiting)
        else:
            w = prompt(i, n_past, n_tokens, samples=kind == "infer", waiting=waiting)
        wants.append(w)
    order = draw(st.permutations(wants))
    return list(order), n_batch, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(tick_cases())
def test_plan_invariants(case):
    wants, n_batch, defer = case
    plan = plan_tick(wants, n_batch, defer)
    by_key = {w.key: w for w in wants}
    # every planned token fits the batch; batch indices and rows are numbered once, in order
    assert sum(f.count for f in plan) <= n_batch
    at = row = 0
    for f in plan:
        assert f.at == at and f.rows.start == row
        at += f.count
        row += len(f.rows)
    # each sequence at most once; generating ones all there, and before any prompt
    keys = [f.key for f in plan]
    assert len(set(keys)) == len(keys)
    n_gen = sum(w.generating for w in wants)
    assert [f.key for f in plan[:n_gen]] == [w.key for w in wants if w.generating]
    assert not any(f.generating for f in plan[n_gen:])
    # prompts go fewest tokens left first (ties: arrival order); waiting ones (or all, when
    # deferred) are left out
    prompt_keys = sorted((w.key for w in wants if not w.generating),
                         key=lambda k: (by_key[k].n_tokens - by_key[k].n_past,
                                        [w.key for w in wants].index(k)))
    assert [f.key for f in plan[n_gen:]] == [k for k in prompt_keys if k in keys]
    for f in plan[n_gen:]:
        assert not defer and not by_key[f.key].waiting
    # a prompt is left out only when the batch is full, or it waits, or prompts are deferred
    for k in prompt_keys:
        if k not in keys:
            w = by_key[k]
            ahead = [f for f in plan if f.generating or prompt_keys.index(f.key) < prompt_keys.index(k)]
            assert defer or w.waiting or sum(f.count for f in ahead) == n_batch
    # a generating sequence feeds at least its sampled token (a forced chunk may be cut)
    assert all(f.count >= 1 for f in plan if f.generating)
    for f in plan:
        w = by_key[f.key]
        assert f.pos == w.n_past and 0 <= f.count <= w.n_tokens - w.n_past
        assert f.ends == (f.pos + f.count == w.n_tokens)
        # its rows are exactly the fed positions inside its output span
        fed = range(f.pos, f.pos + f.count)
        with_rows = [p for p in fed if w.out_from <= p <= w.out_to]
        assert len(f.rows) == len(with_rows)
        if with_rows:
            assert f.row_pos == with_rows[0]
        # it samples iff its entry says so: from the row of its last known token
        assert f.samples == (w.samples_at_end and f.ends and w.n_tokens - 1 in with_rows)
        if f.samples:
            assert isinstance(f, Feed) and f.row_pos + len(f.rows) - 1 == w.n_tokens - 1


# ------------------------------------------------------------------ deterministic mode's prompt tick


def test_a_deterministic_prompt_tick_feeds_one_prompt_and_no_generated_token():
    plan = plan_tick([gen("g", 7), prompt("p", 0, 5), prompt("q", 0, 3)], 16, one_prompt=True)
    assert [(f.key, f.pos, f.count, f.at, list(f.rows), f.samples) for f in plan] == [
        ("q", 0, 3, 0, [0], True)]
    assert plan_tick([gen("g", 7), prompt("w", 0, 4, waiting=True)], 16, one_prompt=True) == []


def test_a_deterministic_prompt_tick_never_leaves_a_lone_token():
    (f,) = plan_tick([prompt("p", 0, 9)], 8, one_prompt=True)
    assert (f.count, f.ends) == (7, False)  # 8 would leave 1: 7 leaves 2
    (f,) = plan_tick([prompt("p", 7, 9)], 8, one_prompt=True)
    assert (f.count, f.ends, f.samples) == (2, True, True)


@settings(max_examples=300, deadline=None)
@given(tick_cases(), st.integers(3, 80))
def test_deterministic_prompt_ticks_feed_prompts_in_chunks_of_two_or_more(case, n_ubatch):
    """Fed to the end tick after tick, every prompt goes in chunks that never leave a single
    token (one token only when it had one token left to start with), nor does llama.cpp's
    cut of a chunk into micro-batches of n_ubatch rows; nBatch and nUbatch >= 3."""
    wants, n_batch, _ = case
    n_batch = max(3, n_batch)
    n_ubatch = min(n_ubatch, n_batch)
    for w in wants:
        if w.generating or w.waiting:
            continue
        cur, chunks = w, []
        while cur.n_past < cur.n_tokens:
            (f,) = plan_tick([cur], n_batch, one_prompt=True, n_ubatch=n_ubatch)
            assert f.key == w.key and f.pos == cur.n_past and 1 <= f.count <= n_batch
            chunks.append(f.count)
            cur = Want(w.key, False, cur.n_past + f.count, w.n_tokens, w.out_from, w.out_to,
                       w.samples_at_end)
        assert sum(chunks) == w.n_tokens - w.n_past
        assert all(c >= 2 and c % n_ubatch != 1 for c in chunks) or chunks == [1]


# ------------------------------------------------------------------ deterministic mode's pairs


def pair(key, n_past, last_tick=-1):
    """A generating sequence in deterministic mode: its new token (at n_past) with the one
    before it fed again (InferJob.want), last fed at `last_tick`."""
    return Want(key, True, n_past - 1, n_past + 1, n_past, n_past, True, refed=1, last_tick=last_tick)


def ticks_of_pairs(keys, n_ticks, n_batch, pair_rows):
    """The keys each of `n_ticks` pair ticks feeds, each want's last_tick set as the
    scheduler's jobs set it (the tick of its last token)."""
    last = {k: -1 for k in keys}
    seen = []
    for t in range(n_ticks):
        plan = plan_tick([pair(k, 5, last[k]) for k in keys], n_batch, pair_rows=pair_rows)
        assert all(f.count == 2 and f.refed == 1 for f in plan)
        for f in plan:
            last[f.key] = t
        seen.append([f.key for f in plan])
    return seen


def test_a_generated_token_is_fed_beside_the_one_before_it():
    """Both tokens in one entry, the first fed again into its cell (`refed`: the scheduler
    removes the cell first); one row, the new token's, which samples."""
    (f,) = plan_tick([pair("g", 9)], 16, pair_rows=8)
    assert (f.pos, f.count, f.refed, list(f.rows), f.row_pos, f.ends, f.samples) == (8, 2, 1, [0], 9, True, True)


def test_a_tick_pairs_no_more_than_half_a_micro_batch_the_least_recently_fed_first():
    """llama.cpp cuts a micro-batch of several streams into equal columns: at most
    n_ubatch // 2 pairs, or some token would be its stream's only row. The others wait,
    the least recently fed going first (ties: batch order), and each tick's feeds keep
    batch order."""
    seen = ticks_of_pairs("abcde", 5, 64, 2)
    assert seen == [["a", "b"], ["c", "d"], ["a", "e"], ["b", "c"], ["a", "d"]]
    assert [f.key for f in plan_tick([pair(k, 5) for k in "abcde"], 5, pair_rows=8)] == ["a", "b"]  # 2 fit


@settings(max_examples=200, deadline=None)
@given(n_gen=st.integers(1, 40), n_batch=st.integers(3, 128), pair_rows=st.integers(1, 64))
def test_pairs_fit_and_none_waits_longer_than_a_round(n_gen, n_batch, pair_rows):
    """Every entry a whole pair, within the batch and the micro-batch's pairs; as many
    pairs as both allow; tick after tick, every sequence is fed within its first round
    of ceil(n / pairs a tick) ticks and then at least once a round."""
    n_batch = max(n_batch, n_gen)  # nBatch >= nSeqMax
    plan = plan_tick([pair(i, 3 + i) for i in range(n_gen)], n_batch, pair_rows=pair_rows)
    room = min(n_gen, pair_rows, n_batch // 2)
    assert len(plan) == room and sum(f.count for f in plan) <= n_batch
    assert all((f.pos, f.count, f.refed) == (f.key + 2, 2, 1) for f in plan)
    round_ = -(-n_gen // room)
    seen = ticks_of_pairs(list(range(n_gen)), 3 * round_, n_batch, pair_rows)
    for k in range(n_gen):
        fed_at = [-1] + [t for t, keys in enumerate(seen) if k in keys]
        assert max(b - a for a, b in zip(fed_at, fed_at[1:] + [3 * round_])) <= round_, (k, fed_at)


def test_deterministic_kinds_of_tick_never_mix_and_take_turns():
    """A prompt chunk, lone generated tokens and pairs never share a decode (llama.cpp's
    equal columns would leave a prompt's or a pair's token alone in a micro-batch);
    with several kinds waiting they take turns, none skipped."""
    p, g, q = prompt("p", 0, 5), gen("g", 7), pair("q", 9)
    wants = [p, g, q, prompt("w", 0, 4, waiting=True)]
    kinds, last = [], None
    for _ in range(6):
        last = next_kind(wants, last)
        kinds.append(last)
    assert kinds == [PROMPT, LONE, PAIRS] * 2
    assert next_kind([g, q], PAIRS) == LONE and next_kind([q], PAIRS) == PAIRS
    assert next_kind([prompt("w", 0, 4, waiting=True)], None) is None
    assert [f.key for f in plan_tick(wants, 16, defer_prompts=True, only=LONE, pair_rows=8)] == ["g"]
    (f,) = plan_tick(wants, 16, defer_prompts=True, only=PAIRS, pair_rows=8)
    assert (f.key, f.count, f.refed) == ("q", 2, 1)
