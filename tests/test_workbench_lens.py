"""wb.lens through a real server: the tidy table of a generation's logit lens and its
picture, drawn by the same call."""

from __future__ import annotations

import sys

import pytest

from clickpaca import Workbench
from clickpaca.wire.client import ServerError

from conftest import TEST_BUILD

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def wb():
    w = Workbench.spawn(nCtx=512, nSeqMax=2, build=TEST_BUILD, capture=True, python=sys.executable)
    yield w
    w.close()


def test_lens_table_and_picture(wb, tmp_path):
    png = tmp_path / "lens.png"
    t = wb.lens("The capital of France is", maxTokens=4, temperature=0, top=3, plot=str(png))
    n = len(t.pieces)
    assert n >= 1 and t.layers == list(range(18))
    assert len(t.records) == n * 18 * 3
    assert set(t.records[0]) == {"token", "generated", "layer", "rank", "token_id", "token_text", "logprob",
                                 "entropy"}
    grid = t.grid()
    # greedy: the last layer's top token at each step is the token generated there
    assert [c["token_text"] for c in grid[-1]] == t.pieces
    assert png.stat().st_size > 0 and t.figure is not None
    df = t.to_pandas()
    assert len(df) == len(t.records) and (df.groupby(["token", "layer"])["rank"].count() == 3).all()


def test_lens_error_raises(wb):
    with pytest.raises(ServerError, match="lens: layers: 40"):
        wb.lens("Hello", layers=[40], maxTokens=1, plot=False)
