"""DRY at any concurrency, through the real socket server: many distinct breaker sets in
flight beside a plain infer, counted in engine ticks.

Each request's breaker table is made by its client's reader thread when the request is
prepared (engine/prepare.py) and held by its sampler: the engine thread makes none,
whatever the number of distinct sets in flight (before, it kept 4 sets and remade one
for every token when 5 or more were in flight, 0.35-0.9 s each, on the engine thread).
The stats request counts the tables made by readers and by the engine thread
(`dryBreakerSets.builds`); `done.max_gap_ticks` says whether a request got a token every
tick it was live. That the prepared tables give llama.cpp's penalties is
tests/test_sampling_oracle.py (test_dry_with_long_breakers_through_the_prepared_table).
"""

from __future__ import annotations

import random

import pytest

from clickpaca.wire.client import Client
from test_hostile_clients import check_bounds, stats_of
from test_socket import start_server, stop_server

pytestmark = pytest.mark.model

N_SETS = 16


def test_sixteen_distinct_breaker_sets_beside_a_plain_infer(tmp_path):
    path = tmp_path / "s.sock"
    proc = start_server(path, nCtx=8192, nSeqMax=N_SETS + 2, nBatch=512)
    rng = random.Random(54)
    sets = [["".join(rng.choices("etaoinshr :", k=40)) for _ in range(64)] for _ in range(N_SETS)]
    clients: list[Client] = []
    try:
        plain = Client.connect(path)
        plain.infer(0, "Write a long story about a lighthouse keeper.", maxTokens=4000, temperature=0)
        stream = plain.stream(0)
        assert next(stream)["type"] == "token"  # it is live before the first DRY request arrives
        clients = [Client.connect(path) for _ in range(N_SETS)]
        for c, s in zip(clients, sets):
            c.infer(1, "one two three one two three one two three one", maxTokens=16, temperature=0,
                    dryMultiplier=0.8, dryAllowedLength=2, drySequenceBreakers=s)
        ends = [c.collect(1)[1] for c in clients]
        for done in ends:
            assert done["type"] == "done" and done["tokens_predicted"] == 16, done
            assert done["max_gap_ticks"] == 1, done  # a token every tick from its first
        plain.cancel(0)
        *_, neighbour = stream
        assert neighbour["type"] == "done" and neighbour["stop_reason"] == "cancelled", neighbour
        assert neighbour["max_gap_ticks"] == 1, neighbour  # it was live throughout, a token every tick

        st = stats_of(plain)
        check_bounds(st)
        tables = st["caches"]["dryBreakerSets"]
        assert tables["builds"] == {"reader": N_SETS, "engine": 0}, tables  # no tick waited for a table
        assert tables["waits"] == 0 and tables["kept"] <= 4, tables
    finally:
        for c in clients:
            c.close()
        stop_server(proc, path)
