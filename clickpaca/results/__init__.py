"""The local results store: every bench and ppl run recorded with its provenance and raw
samples, and compared with paired statistics.

One module per job:
  store       SQLite schema, forward migrations, runs opened incomplete and closed at the end
  provenance  code, build, model, machine and time of a run
  samples     the raw samples of a command's output (per-token series, per-round speeds)
  record      recording(command, args) around a command; attach() from report.emit
  paired      pure statistics: paired ΔPPL with a block bootstrap, ratio of medians, verdicts
  compare     which series pair, whether they may, and the comparison report
  report      what every measurement writes: its record here, a JSON file, PNG figures
  table       markdown tables
  stats       medians, ratios, spreads, alternation of compared runs, the progress line
  cli         `clickpaca results list|show|compare|export|plot`
"""

from .record import attach, recording
from .store import ResultsStoreError, Store, default_path

__all__ = ["attach", "recording", "ResultsStoreError", "Store", "default_path"]
