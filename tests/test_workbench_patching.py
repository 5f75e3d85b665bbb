"""clickpaca.workbench.patching and Workbench.activations / .patch: numpy rows to the
protocol's patch entries, and a patch through a real server on the activations build."""

from __future__ import annotations

import numpy as np
import pytest

from clickpaca import Workbench
from clickpaca.activations.capture import decode
from conftest import TEST_CACHE_K, TEST_CACHE_V
from clickpaca.workbench import patching


def test_an_array_source_goes_inline_as_float32_and_lists_are_per_item():
    rows = np.arange(6, dtype=np.float64).reshape(2, 3)
    e = patching.wire_entry({"node": "l_out-1", "positions": [0, 1], "source": rows, "mode": "add"})
    assert e["mode"] == "add" and e["source"]["dtype"] == "float32" and e["source"]["shape"] == [2, 3]
    assert np.array_equal(decode(e["source"]), rows.astype(np.float32))
    one = patching.wire_entry({"node": "l_out-1", "positions": [4], "source": np.ones(3)})
    assert one["source"]["shape"] == [1, 3]  # one row for one position
    assert patching.wire_entry({"node": "x", "positions": [0], "source": "f.npy"})["source"] == "f.npy"
    same = patching.per_item([{"node": "x", "positions": [0], "source": "f.npy"}], 3)
    assert len(same) == 3 and same[0] == same[2]
    own = patching.per_item([[{"node": "x", "positions": [0], "source": "a.npy"}], []], 2)
    assert own[1] == [] and own[0][0]["source"] == "a.npy"
    with pytest.raises(ValueError, match="2 patch lists for 3 items"):
        patching.per_item([[], []], 3)


@pytest.mark.model
@pytest.mark.activations
def test_patch_in_a_few_lines_gives_the_other_prompts_tokens():
    """Every position of l_out-8 from another prompt of as many tokens: the greedy tokens
    are that prompt's own (deterministic mode), and an unpatched item beside it is unchanged."""
    a, b = "The Eiffel Tower is located in the city of", "The Colosseum is located in the city of"
    with Workbench.spawn(build="activations", deterministic=True, nCtx=1024, nSeqMax=4,
                         cacheTypeK=TEST_CACHE_K, cacheTypeV=TEST_CACHE_V) as wb:
        rows = wb.activations(b, ["l_out-8"])["l_out-8"]
        assert rows.shape == (len(rows), 640)
        plain = wb.generate([a, b], maxTokens=3, temperature=0)
        got = wb.patch([a, a], [[{"node": "l_out-8", "positions": list(range(len(rows))), "source": rows}], []],
                       maxTokens=3, temperature=0)
    assert got[0].error is None and got[0].tokens[:1] == plain[1].tokens[:1]
    assert got[1].tokens == plain[0].tokens
