"""Pre-selection inside the decode: the few values per sampled row that a chain needs.

llama.cpp's backend sampling lets a sampler add ggml ops to the decode graph for its
sequence's output row; what they produce comes back instead of the whole row. Per decode
the engine orders the rows it wants pre-selected (a `RowOrder` per slot); the ops run once
over all of them as one [V, n] tensor, every other row passes through whole, and each
pre-selected row comes back packed in one float32 row, read as a `Preselected` for the
chain's fast path (sampling/fastpath.py). The modules, one job each:

- rows.py: the data: `RowOrder`, `Layout` (the packed row), `Preselected`, `BLOCK`;
- reuse.py: a set of orders' `Plan`, whether a built graph `fits` it, `roomy`;
- graph.py: the ggml ops (`build`) and their inputs (`fill`), `mask_table`;
- sampler.py: `Presampler`, the cffi callbacks llama.cpp calls and the reads after a decode;
- unpack.py: packed rows to `Preselected`;
- reference.py: the ops' numpy `reference`, which the tests hold the graph to;
- standalone.py: `preselect`, the ops run on ggml's CPU backend over given rows (no model).

The ops, the packing, graph reuse and the costs: docs/BENCHMARKS.md, "Pre-selection
inside the decode".
"""

from .graph import mask_table
from .reference import reference
from .reuse import K_ROOM, TOUCHED_ROOM, Plan, fits, plan_of, roomy
from .rows import BLOCK, DENSE_BLOCKS, Layout, Preselected, RowOrder
from .sampler import Presampler
from .unpack import unpack

__all__ = ["BLOCK", "DENSE_BLOCKS", "K_ROOM", "TOUCHED_ROOM", "Layout", "Plan", "Preselected", "Presampler",
           "RowOrder", "fits", "mask_table", "plan_of", "reference", "roomy", "unpack"]
