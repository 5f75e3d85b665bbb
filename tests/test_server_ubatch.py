"""init's nUbatch: a tick larger than one graph pass is computed in several (llama.cpp's
micro-batches), and every sequence still gets its own rows.

Real server, real model. Eight sequences generate together with nUbatch 3, so each tick
of eight rows takes three passes; each sequence's greedy tokens must be those it gets
generating alone on the same server (one row, one pass per tick), up to a near-tie (the
batch shape changes the kernels' rounding). A row handed to the wrong sequence would
part from its solo run at once and not at a near-tie.
"""

from __future__ import annotations

from conftest import NEAR_TIE, spawn_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "The three primary colours are", "Water boils at", "My favourite recipe for soup",
           "In 1969, the first", "A haiku about the sea:"]
N_GEN, N_TOP = 16, 5


def greedy(c, seq_id: int, prompt: str) -> None:
    c.infer(seq_id, prompt, maxTokens=N_GEN, temperature=0, nProbs=N_TOP, reusePrefix=False)


def run(c, seq_id: int) -> list:
    toks, done = c.collect(seq_id)
    assert done["type"] == "done", done
    return [(t["token"], [(x["token"], x["logprob"]) for x in t["top"]]) for t in toks]


def same_up_to_a_near_tie(solo: list, together: list) -> bool:
    step = next((i for i, (a, b) in enumerate(zip(solo, together)) if a[0] != b[0]), None)
    if step is None:
        return len(solo) == len(together)
    top, chosen = dict(solo[step][1]), together[step][0]
    return chosen in top and top[solo[step][0]] - top[chosen] < NEAR_TIE


def test_a_tick_in_several_passes_gives_each_sequence_its_rows():
    c = spawn_server(nSeqMax=8, nBatch=8, nUbatch=3, nCtx=2048)
    try:
        assert c.ready["nUbatch"] == 3 and c.ready["nBatch"] == 8
        solo = []
        for i, p in enumerate(PROMPTS):
            greedy(c, i, p)
            solo.append(run(c, i))
        for i, p in enumerate(PROMPTS):
            greedy(c, i, p)
        together = [run(c, i) for i in range(len(PROMPTS))]
        for i, (a, b) in enumerate(zip(solo, together)):
            assert same_up_to_a_near_tie(a, b), (PROMPTS[i], a, b)
        # parting is rare: most sequences give the very tokens of their solo run
        assert sum([t for t, _ in a] == [t for t, _ in b] for a, b in zip(solo, together)) >= len(PROMPTS) // 2
    finally:
        c.close()
