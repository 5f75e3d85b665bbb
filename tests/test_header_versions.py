"""Four llama.cpp versions and our patch sets, verified from their headers alone.

For each pinned llama-cpp-python sdist (0.3.2 = b4094, Nov 2024; 0.3.9 = b5308; 0.3.16 =
b6170; 0.3.36 = b11312, the current pin) and for the patched flavors' header edits
(turboquant, activations): parse the headers, generate the cffi declarations and manifest,
and prove every record's layout against the C compiler. No llama.cpp build is needed; the sdists come from the registry
through pip into the build cache (about 240 MB the first time, then cached).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bindgen import feature_table, report, versions
from bindgen.usage import scan
from clickpaca.llama import features

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

EXPECTED = {  # version -> (commit, build number) of the vendored llama.cpp
    "0.3.2": ("74d73dc85", 4094), "0.3.9": ("8733e0cf6", 5308),
    "0.3.16": ("4227c9be4", 6170), "0.3.36": ("0c1e57098", 11312), "turboquant": ("0c1e57098", 11312),
    "activations": ("0c1e57098", 11312), "kvcenter": ("0c1e57098", 11312),
}


@pytest.fixture(scope="module")
def manifests():
    return {v: versions.manifest_of(v) for v in [*versions.VERSIONS, *versions.PATCHED]}


@pytest.mark.parametrize("version", [*versions.VERSIONS, *versions.PATCHED])
def test_headers_parse_generate_and_prove(manifests, version):
    m, n_fields = manifests[version]
    assert (m["stamp"]["commit"], m["stamp"]["build_number"]) == EXPECTED[version]
    assert n_fields > 150 and len(m["records"]) >= 29 and len(m["functions"]) > 600
    for name in ("llama_decode", "llama_tokenize", "llama_batch_init", "llama_get_logits_ith"):
        assert name in m["functions"], name
    assert "struct llama_batch" in m["records"] or "llama_batch" in m["records"]


def test_what_each_version_has(manifests):
    fns = {v: set(m["functions"]) for v, (m, _) in manifests.items()}
    assert "llama_model_get_vocab" not in fns["0.3.2"] and "llama_model_get_vocab" in fns["0.3.9"]
    assert "llama_get_memory" not in fns["0.3.9"] and "llama_get_memory" in fns["0.3.16"]
    assert "llama_n_ctx_seq" not in fns["0.3.16"] and "llama_n_ctx_seq" in fns["0.3.36"]
    tq = manifests["turboquant"][0]["enums"]["ggml_type"]
    assert {"GGML_TYPE_TURBO2", "GGML_TYPE_TURBO3", "GGML_TYPE_TURBO4"} <= set(tq)
    assert "GGML_TYPE_TURBO3" not in manifests["0.3.36"][0]["enums"]["ggml_type"]


def test_upgrade_report_fits_one_screen_and_leads_with_our_code(manifests):
    rep = report.build_report(manifests["0.3.16"][0], manifests["0.3.36"][0])
    text = report.render_text(rep)
    lines = text.splitlines()
    # 62 lines: 50 until clickpaca's RPC code (rpc/devices.py) added its two entries
    # (b6170 lacks ggml_backend_rpc_add_server and the device argument of ggml_backend_rpc_init),
    # and the feature table's block (four lines for its three features that differ, #31);
    # 67 since the control vector's rename (llama_apply_adapter_cvec -> llama_set_adapter_cvec,
    # features.py 'cvec', #28): three entries of our code and its feature table line;
    # 76 since pre-selection (#39, features.py 'backend-sampling'): its 13 names, absent in
    # b6170, in one grouped entry (entries of one status and action share a line since) and
    # its feature table lines; 73 since the entries of one action share a line, each name with
    # its own status when theirs differ (the enum values read at run time, #39's llama_set_sampler)
    assert len(lines) <= 78 and max(map(len, lines)) <= 100, (len(lines), max(map(len, lines)))
    assert lines[0].startswith("Change report: b6170 (compat 4227c9be4, sdist 0.3.16) -> b11312")
    places = scan().symbols["llama_n_ctx_seq"]
    ours = next(o for o in rep["ours"] if o["name"] == "llama_n_ctx_seq")
    assert ours["status"] == "absent in b6170" and ours["used_at"] == places
    assert text.index("llama_n_ctx_seq: absent in b6170") < text.index("llama API:")
    assert "ggml/gguf internals:" in lines[-1]


def test_report_from_0_3_9_names_every_missing_function_we_call(manifests):
    rep = report.build_report(manifests["0.3.9"][0], manifests["0.3.36"][0])
    used = scan().symbols
    missing = {n for n in used if n.startswith("llama_") and n not in manifests["0.3.9"][0]["functions"]
               and n in manifests["0.3.36"][0]["functions"]}
    reported = {o["name"] for o in rep["ours"] if o["kind"] == "function"}
    assert missing and missing <= reported
    rm = next(o for o in rep["ours"] if o["name"] == "llama_memory_seq_rm")
    # handled (init refused there, features.py), and the fallback one could add instead kept
    assert rm["handled"] and rm["action"] == "features.py 'memory-api': init refused on b5308"
    assert "llama_kv_self_seq_rm" in rm["proposal"]


@pytest.mark.parametrize("version", [*versions.VERSIONS[:-1], *versions.PATCHED])
def test_everything_our_code_uses_that_differs_is_handled(manifests, version):
    """The rule of docs/UPGRADING.md on every pinned version: what our code uses that the
    version lacks or changed has a fallback or a row in the feature table (which refuses
    the option that needs it, by name). An unhandled entry here is a call that would fail
    on that version with an AttributeError or worse."""
    rep = report.build_report(manifests[version][0], manifests["0.3.36"][0])
    assert [o["name"] for o in rep["ours"] if not o["handled"]] == []


def test_every_name_in_the_feature_table_exists_somewhere(manifests):
    """A misspelt name would make its feature look absent everywhere (mainline included;
    a patched flavor's feature on that flavor's headers)."""
    for f in features.FEATURES:
        assert features.lacking(f, features.for_manifest(manifests[f.build or "0.3.36"][0])) == [], f.name
        for n in f.fallback:
            assert any(features.for_manifest(m)(n) for m, _ in manifests.values()), n


def test_feature_table_of_the_pinned_versions(manifests):
    """What each version serves, from its headers; docs/UPGRADING.md shows the same table."""
    status = {v: {r["feature"]: r["status"] for r in feature_table.rows(manifests[v][0])}
              for v in versions.VERSIONS}
    patched = {f.name for f in features.FEATURES if f.build}  # cvec-seq: the activations flavor's
    assert status["0.3.36"] == {f.name: "works" if not f.build else "refused" if f.refuses else "fallback"
                                 for f in features.FEATURES}
    assert {f for f, s in status["0.3.16"].items() if s != "works"} == {"rpc", "flash-attn-auto", "n-ctx-seq",
                                                                       "cvec", "backend-sampling", "logit-lens",
                                                                       *patched}
    assert status["0.3.16"]["rpc"] == "refused"
    assert status["0.3.16"]["logit-lens"] == "refused"  # its bindings do not hold ggml's gguf API
    assert status["0.3.9"]["memory-api"] == "refused" and status["0.3.9"]["vocab-api"] == "works"
    assert status["0.3.2"]["vocab-api"] == "refused"
    table = feature_table.markdown({v: manifests[v][0] for v in versions.VERSIONS})
    assert table in (ROOT / "docs" / "UPGRADING.md").read_text(), \
        "docs/UPGRADING.md: paste `python -m bindgen.versions --features` again"
