"""clickpaca/llama/backends.py: one pre-selection row per backend, the host path wherever
it was not measured; a server without `preselect` in init takes its build's row and says so."""

from __future__ import annotations

from clickpaca.llama import backends


def test_every_backend_has_one_row_and_unmeasured_rows_keep_the_host_path():
    assert set(backends.PRESELECT_DEFAULTS) == set(backends.PRESET_BACKEND.values())
    for name, row in backends.PRESELECT_DEFAULTS.items():
        assert row.backend == name
        if row.evidence.startswith("not measured"):
            assert row.on is False, row
        else:
            assert row.evidence.startswith("measured"), row
    assert backends.PRESELECT_DEFAULTS["cuda"].evidence.startswith("not measured")
    assert backends.PRESELECT_DEFAULTS["cpu"].evidence.startswith("measured") and not backends.PRESELECT_DEFAULTS["cpu"].on


def test_a_build_is_mapped_to_its_backend_by_its_record():
    assert backends.backend({"preset": "linux-cpu"}) == "cpu" and backends.backend({}) == "cpu"
    assert backends.backend({"preset": "linux-cuda"}) == "cuda"
    assert backends.backend({"preset": "linux-x", "cuda": {"arch": "90"}}) == "cuda"
    assert backends.preselect_default({"preset": "linux-cuda"}) is backends.PRESELECT_DEFAULTS["cuda"]
    assert backends.preselect_default({"preset": "other"}).evidence == "not measured"


def test_init_without_preselect_takes_the_cpu_row_and_says_so(server):
    ready = server.ready
    assert ready["preselect"] is False
    assert ready["preselectFrom"] == "default: " + backends.PRESELECT_DEFAULTS["cpu"].evidence
