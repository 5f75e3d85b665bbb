"""Which backend a build computes on, and the defaults that depend on it: one row each.

Why a table: a default that "picks per backend" must say, for every backend, what it
picks and on what evidence. `init` without `preselect` takes the row of the build's
backend; a row that was never measured keeps the host path (the path every test covers)
and says "not measured" until `make gpu-check` measures both paths on that backend.
"""

from __future__ import annotations

from dataclasses import dataclass

#: CMakePresets.json's presets by the backend they compile (build-info.json records the preset).
PRESET_BACKEND = {"linux-cpu": "cpu", "linux-cuda": "cuda", "linux-rocm": "rocm", "macos-metal": "metal"}


@dataclass(frozen=True)
class PreselectDefault:
    """`init` `preselect` when the request leaves it out: on, and what decided it."""

    backend: str
    on: bool
    evidence: str


#: One row per backend. CPU: measured, the host path is the faster for every chain
#: (docs/BENCHMARKS.md, "Pre-selection", the whole server). The GPU rows: not measured;
#: `make gpu-check` compares both paths at 8 and 64 sequences and its summary says which row to write.
PRESELECT_DEFAULTS = {
    "cpu": PreselectDefault("cpu", False, "measured: the host path is faster for every chain "
                                          "(docs/BENCHMARKS.md, Pre-selection)"),
    "cuda": PreselectDefault("cuda", False, "not measured: the host path until make gpu-check "
                                            "measures both paths on a GPU (docs/GPU.md)"),
    "rocm": PreselectDefault("rocm", False, "not measured"),
    "metal": PreselectDefault("metal", False, "not measured"),
}


def backend(info: dict) -> str:
    """The backend a build computes on, from its build-info.json ("cpu" when it names no
    preset; an unknown preset is its own backend, with no measured row)."""
    if info.get("cuda"):
        return "cuda"
    preset = info.get("preset") or "linux-cpu"
    return PRESET_BACKEND.get(preset, preset)


def preselect_default(info: dict) -> PreselectDefault:
    """The row of the build's backend (an unknown backend: the host path, not measured)."""
    name = backend(info)
    return PRESELECT_DEFAULTS.get(name, PreselectDefault(name, False, "not measured"))
