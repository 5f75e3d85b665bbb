"""clickpaca.measure.steering: the word-list score and the summary (pure functions;
the experiment itself runs through the server: docs/ACTIVATIONS.md)."""

from __future__ import annotations

import pytest

from clickpaca.measure import steering as ex


def test_score_counts_positive_minus_negative_words_per_hundred():
    assert ex.score("It was a great day, I loved it") == pytest.approx(100 * 2 / 8)
    assert ex.score("What an awful, boring mess. Great.") == pytest.approx(100 * (1 - 3) / 6)
    assert ex.score("The table has four legs") == 0.0
    assert ex.score("") == 0.0 and ex.score("123 !!") == 0.0
    assert not ex.POSITIVE & ex.NEGATIVE


def test_summary_keeps_the_unsteered_apart():
    rows = [{"strength": s, "unsteered": u, "score": v}
            for s, u, v in [(-4.0, False, -2.0), (-4.0, False, -4.0), (4.0, False, 6.0), (0.0, True, 1.0),
                            (0.0, True, -1.0)]]
    s = ex.summary(rows)
    assert s["steered"] == {-4.0: {"mean": -3.0, "min": -4.0, "max": -2.0, "n": 2},
                            4.0: {"mean": 6.0, "min": 6.0, "max": 6.0, "n": 1}}
    assert s["unsteered"] == {"mean": 0.0, "std": 1.0, "min": -1.0, "max": 1.0, "n": 2}
