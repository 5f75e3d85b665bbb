"""The change report (bindgen.report, .apidiff, .impact) on small manifests written here:
no build, no model."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from bindgen import apidiff, impact, report
from bindgen.usage import Usage, scan_source


def manifest(build: int, functions: dict[str, str], records=None, enums=None, deprecated=None,
             flavor: str = "mainline") -> dict:
    sigs = {k: re.sub(r"\b\w+\(", "_(", v, count=1) for k, v in functions.items()}
    return {"stamp": {"flavor": flavor, "commit": f"c{build}", "build_number": build},
            "functions": functions, "signatures": sigs, "records": records or {},
            "enums": enums or {}, "callbacks": {}, "constants": {}, "deprecated": deprecated or {}}


def usage_of(code: str) -> Usage:
    u = Usage()
    scan_source(code, "core.py", u)
    return u


CTX = "const struct llama_context *"
OLD = manifest(6170, {
    "llama_n_ctx": f"uint32_t llama_n_ctx({CTX})",
    "llama_free_model": "void llama_free_model(struct llama_model *)",
    "llama_kv_self_seq_rm": "bool llama_kv_self_seq_rm(struct llama_context *, int32_t, int32_t, int32_t)",
    "ggml_gone": "void ggml_gone(float *)",
}, records={"struct llama_context_params": {"size": 8, "fields": [
    {"name": "n_ctx", "type": "uint32_t", "offset": 0}, {"name": "flash_attn", "type": "_Bool", "offset": 4}]}},
    enums={"llama_ftype": {"LLAMA_FTYPE_ALL_F32": 0}}, flavor="compat")
NEW = manifest(11312, {
    "llama_n_ctx": f"uint32_t llama_n_ctx({CTX})",
    "llama_n_ctx_seq": f"uint32_t llama_n_ctx_seq({CTX})",
    "llama_free_model": "void llama_free_model(struct llama_model *)",
    "llama_model_free": "void llama_model_free(struct llama_model *)",
    "llama_memory_seq_rm": "bool llama_memory_seq_rm(llama_memory_t, int32_t, int32_t, int32_t)",
    "llama_context_default_params": "struct llama_context_params llama_context_default_params(void)",
    "ggml_new": "int ggml_new(void)",
}, records={"struct llama_context_params": {"size": 12, "fields": [
    {"name": "n_seq", "type": "uint32_t", "offset": 0}, {"name": "n_ctx", "type": "uint32_t", "offset": 4},
    {"name": "flash_attn_type", "type": "enum llama_flash_attn_type", "offset": 8}]}},
    enums={"llama_ftype": {"LLAMA_FTYPE_ALL_F32": 0, "LLAMA_FTYPE_MOSTLY_Q1_0": 40},
           "llama_flash_attn_type": {"LLAMA_FLASH_ATTN_TYPE_AUTO": -1}},
    deprecated={"llama_free_model": "use llama_model_free instead"})
CODE = '''
def f(lib, ctx, p):
    n = lib.llama_n_ctx_seq(ctx)
    lib.llama_model_free(m)
    lib.llama_memory_seq_rm(mem, 0, -1, -1)
    p = lib.llama_context_default_params()
    p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.n_ctx = 5
    s = lib.llama_n_ctx_seq(ctx) if hasattr(lib, "llama_n_ctx_seq") else lib.llama_n_ctx(ctx)
'''


def test_our_uses_lead_with_place_and_what_to_do():
    rep = report.build_report(OLD, NEW, usage_of(CODE))
    by_name = {o["name"]: o for o in rep["ours"]}
    seq = by_name["llama_n_ctx_seq"]
    assert seq["status"] == "absent in b6170" and seq["used_at"] == ["core.py:3", "core.py:9"]
    assert "fall back to llama_n_ctx (same signature)" in seq["action"]
    assert not seq["handled"]  # core.py:3 calls it without a hasattr() check
    assert "llama_free_model (deprecated for llama_model_free)" in by_name["llama_model_free"]["action"]
    assert "llama_kv_self_seq_rm (same parameters after the first)" in by_name["llama_memory_seq_rm"]["action"]
    assert by_name["llama_context_params.flash_attn_type"]["status"] == "absent in b6170 (it has flash_attn)"
    assert by_name["enum llama_flash_attn_type (LLAMA_FLASH_ATTN_TYPE_AUTO)"]["used_at"] == ["core.py:7"]
    assert "llama_context_params.n_ctx" not in by_name  # moved only: the bindings follow it
    text = report.render_text(rep)
    lines = text.splitlines()
    assert lines[0] == "Change report: b6170 (compat c6170) -> b11312 (mainline c11312)"
    assert lines[2].startswith("  ! ")  # what needs doing comes right after the summary
    assert text.index("llama_n_ctx_seq: absent in b6170 -> core.py:3,9") < text.index("llama API:")


def test_a_use_under_hasattr_is_handled():
    code = 's = lib.llama_n_ctx_seq(ctx) if hasattr(lib, "llama_n_ctx_seq") else lib.llama_n_ctx(ctx)\n'
    rep = report.build_report(OLD, NEW, usage_of(code))
    (entry,) = rep["ours"]
    assert entry["handled"] and entry["action"] == "handled at core.py:1 (under hasattr)"
    assert report.render_text(rep).splitlines()[2].startswith("  = llama_n_ctx_seq")


def test_direction_is_old_to_new_whichever_comes_first():
    a = report.build_report(OLD, NEW, Usage())
    b = report.build_report(NEW, OLD, Usage())
    assert a == b and a["from"]["build_number"] == 6170
    llama = a["api"]["llama"]["functions"]
    assert llama["added"] == ["llama_context_default_params", "llama_memory_seq_rm",
                              "llama_model_free", "llama_n_ctx_seq"]
    # a different first parameter and a different name: not taken for a rename
    assert llama["removed"] == ["llama_kv_self_seq_rm"] and llama["renamed"] == []


def test_a_renamed_function_is_paired():
    old = manifest(1, {"llama_apply_adapter_cvec": "int32_t llama_apply_adapter_cvec(struct c *x, float v)"})
    new = manifest(2, {"llama_set_adapter_cvec": "int32_t llama_set_adapter_cvec(struct c *x, float v)"})
    f = apidiff.compare_functions(old, new)
    assert f["renamed"] == [["llama_apply_adapter_cvec", "llama_set_adapter_cvec"]]
    assert f["added"] == f["removed"] == []


def test_internals_and_moves_are_one_line_each_unless_full():
    rep = report.build_report(OLD, NEW, Usage())
    short, full = report.render_text(rep), report.render_text(rep, full=True)
    assert "ggml/gguf internals: 1 added, 1 removed, 0 renamed, 0 changed, 0 fields moved" in short
    assert "ggml_new" not in short and "+ functions (1): ggml_new" in full
    assert "offset-only moves: 1 fields in 1 records (llama_context_params)" in short
    assert "n_ctx @0->4" in full and "n_ctx @0->4" not in short


def test_anonymous_types_are_named_by_where_they_sit():
    from bindgen.manifest import type_name
    assert type_name("struct $1", "struct ggml_opt_optimizer_params", "adamw") == \
        "struct (anonymous, in struct ggml_opt_optimizer_params.adamw)"
    assert type_name("union $12 *", "struct s", "u") == "union (anonymous, in struct s.u) *"
    assert type_name("int32_t", "struct s", "x") == "int32_t"


def test_same_abi_respellings_are_not_signature_changes():
    old = manifest(1, {"llama_split_path": "int llama_split_path(char *p, int n)",
                       "llama_chain_get": "struct s *llama_chain_get(const struct s *c, int32_t i)"})
    new = manifest(2, {"llama_split_path": "int32_t llama_split_path(char *p, int32_t n)",
                       "llama_chain_get": "struct s *llama_chain_get(struct s *c, int32_t i)"})
    f = apidiff.compare_functions(old, new)
    assert f["changed"] == [] and f["same_abi_spelling"] == ["llama_chain_get", "llama_split_path"]


def test_param_diff_names_what_changed():
    assert apidiff.param_diff("struct s *f(const struct v *vocab, int32_t n_ctx_train, float m)",
                             "struct s *f(const struct v *vocab, float m)") == "-n_ctx_train"
    assert apidiff.param_diff("int f(int a)", "int64_t f(int a, void (*cb)(int), int b)") == \
        "returns int64_t (was int), +void (*cb)(int) (void (*cb)(int)), +b (int)"


@given(st.lists(st.from_regex(r"llama_[a-z]{1,3}(_[a-z]{1,3}){0,3}", fullmatch=True), unique=True, max_size=30))
def test_grouping_names_loses_none(names):
    grouped = report.group_names(names)
    expanded = []
    for g in grouped:
        if "{" in g:
            head, inner = g[:-1].split("{")
            expanded += [head + x for x in inner.split(", ")]
        else:
            expanded.append(g)
    assert sorted(expanded) == sorted(names)


@given(st.lists(st.tuples(st.sampled_from(["core.py", "grammars.py", "sampling/x.py"]),
                          st.integers(1, 999)), min_size=1, max_size=12))
def test_places_text_keeps_every_place_up_to_the_limit(places):
    text = impact.places_text([f"{f}:{n}" for f, n in places], limit=100)
    for f, n in places:
        part = next(p for p in text.split(" ") if p.startswith(f + ":"))
        assert str(n) in part[len(f) + 1:].split(",")


def test_split_params_keeps_function_pointers_whole():
    assert apidiff.split_params("void f(int a, void (*cb)(int, float), char *s)") == \
        ["int a", "void (*cb)(int, float)", "char *s"]
    assert apidiff.split_params("int f(void)") == []


def test_a_name_of_a_checked_feature_is_handled_where_the_feature_is_absent():
    """clickpaca/llama/features.py: `ggml_backend_rpc_add_server` belongs to feature "rpc"; where
    our code checks that feature, its absence in b6170 is handled (rpcServers refused)."""
    new = manifest(11312, {"ggml_backend_rpc_add_server": "void *ggml_backend_rpc_add_server(const char *)"})
    old = manifest(6170, {}, flavor="compat")
    use = "reg = lib.ggml_backend_rpc_add_server(b'h:1')\n"
    unchecked = report.build_report(old, new, usage_of(use))
    (entry,) = unchecked["ours"]
    assert not entry["handled"]  # nothing in this code checks the feature
    checked = report.build_report(old, new, usage_of("features.require(nat, 'rpc')\n" + use))
    (entry,) = checked["ours"]
    assert entry["handled"] and entry["action"] == "features.py 'rpc': rpcServers refused on b6170"
    rows = {r["feature"]: r["status"] for r in checked["features"]["from"]}
    assert rows["rpc"] == "refused" and rows["vocab-api"] == "refused"  # this tiny manifest lacks it
    assert "rpc on b6170: rpcServers refused (lacks ggml_backend_rpc_init, " \
           "ggml_backend_rpc_add_server, ...)" in report.render_text(checked)
