"""The socket soak (clickpaca/measure/soak.py) in a short form: 16 clients mixing every
request kind for about a minute, some hanging up mid-request, on the real server and
model. `make soak` runs it for 10 minutes (docs/PROTOCOL.md, "Soak", has its figures)."""

from __future__ import annotations

import os

import pytest

from clickpaca.measure import soak
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

SECONDS = float(os.environ.get("CLICKPACA_SOAK_SECONDS", "60"))


@pytest.mark.model
@pytest.mark.slow
def test_a_short_soak_through_the_socket():
    rep = soak.run(soak.Config(seconds=SECONDS, build=TEST_BUILD, cache_type_k=TEST_CACHE_K,
                               cache_type_v=TEST_CACHE_V))
    print(soak.summary(rep))
    assert rep.ok, rep.problems
    kinds = {k.split(" ")[0] for k in rep.requests}
    assert kinds >= {"infer", "dry", "grammar", "score", "prefill", "fork", "save", "load", "capture",
                     "cancel"}, rep.requests  # every kind was exercised and answered
    assert rep.hang_ups > 0 and rep.dry["builds"]["reader"] > 0, (rep.hang_ups, rep.dry)


def test_the_judge_names_each_breach():
    """Each check reports its own breach (the figures of a run that broke every one)."""
    cfg = soak.Config(seconds=10, rss_bound_mib=8, rss_transient_mib=16, gap_ticks=1)
    rep = soak.Report(config={}, rss_level_mib=9.5, rss_growth_mib=24.5, max_gap_ticks=3, files_outside=["/x/core"],
                      temp_files=["/s/.clickpaca-tmp-1-ab"], dry={"builds": {"reader": 1, "engine": 2}},
                      requests={"infer": 1})
    soak.judge(cfg, rep)
    assert [p.split(" ")[0] for p in rep.problems] == ["VmRSS's", "VmRSS", "an", "files", "half-written", "the"], rep.problems
