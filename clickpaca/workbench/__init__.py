"""Experiments in a few lines over the server: `Workbench` (api.py) schedules requests
over the slots (schedule.py) and returns typed results (results.py); `sweep.py` runs
the same requests under several server configs and records them; `progress.py` is the
bar on stderr; `lens.py` is `wb.lens`'s table and picture of the logit lens; `overhead.py` measures the Workbench's own cost against the same requests
sent by hand through the Client; `demo.py` is `clickpaca demo`, the README's main job on
the default model (seven steered sequences in one batch, a held document forked into
questions, the cache types' bytes per token); `patching.py` is activation patching's numpy
side (`Workbench.activations`, `Workbench.patch`)."""

from .api import Document, Workbench
from .results import Generation, Results, Score
from .sweep import SweepResult

__all__ = ["Workbench", "Document", "Generation", "Score", "Results", "SweepResult"]
