"""The feature table (clickpaca/llama/features.py): on manifests, and on the real mainline build.

What an older build refuses is checked on real older builds by tests/compat (make
test-compat) and from the pinned headers by tests/test_header_versions.py; here: the
check itself, on small manifests, and that mainline has every feature.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clickpaca.llama import features


def manifest(drop: set[str] = frozenset()) -> dict:
    """A manifest with every name the table needs, less `drop`."""
    names = {n for f in features.FEATURES for n in (*f.needs, *f.fallback)} - set(drop)
    records: dict[str, dict] = {}
    m = {"functions": {}, "constants": {}, "enums": {"e": {}}, "callbacks": {}, "records": records}
    for n in names:
        rec, dot, field = n.partition(".")
        if dot:
            records.setdefault(f"struct {rec}", {"fields": []})["fields"].append({"name": field})
        elif n.startswith("struct "):
            records.setdefault(n, {"fields": []})
        elif n.endswith("_t"):
            m["callbacks"][n] = "void (*)(void)"
        elif n.startswith("RPC_"):
            m["constants"][n] = 1
        elif n.isupper():
            m["enums"]["e"][n] = 0
        else:
            m["functions"][n] = f"void {n}(void)"
    return m


def test_every_feature_works_where_every_name_is_there():
    rows = features.table(features.for_manifest(manifest()))
    assert [r["status"] for r in rows] == ["works"] * len(features.FEATURES)
    assert all(not r["missing"] for r in rows)


def test_a_missing_function_refuses_only_its_option():
    have = features.for_manifest(manifest({"ggml_backend_rpc_add_server"}))
    rows = {r["feature"]: r for r in features.table(have)}
    assert rows["rpc"]["status"] == "refused" and rows["rpc"]["missing"] == ["ggml_backend_rpc_add_server"]
    assert rows["rpc"]["refused"] == "rpcServers"
    assert all(r["status"] == "works" for name, r in rows.items() if name != "rpc")
    req = SimpleNamespace(rpcServers=("127.0.0.1:9",), outputLocal=False, deterministic=False,
                          kvUnified=True, swaFull=True, preselect=False, kvCenter=None)
    e = features.first_refusal(have, req, "old")
    assert e.field == "rpcServers" and str(e).startswith("rpcServers: build 'old' lacks ggml_backend_rpc_add_server")
    assert features.first_refusal(have, SimpleNamespace(**{**vars(req), "rpcServers": None}), "old") is None


def test_fields_enum_values_and_callbacks_are_names_too():
    have = features.for_manifest(manifest({"llama_model_params.use_extra_bufts", "LLAMA_FLASH_ATTN_TYPE_AUTO",
                                           "ggml_abort_callback_t"}))
    rows = {r["feature"]: r for r in features.table(have)}
    assert rows["repack-off"]["missing"] == ["llama_model_params.use_extra_bufts"]
    assert rows["flash-attn-auto"]["status"] == "fallback" and "flash_attn" in rows["flash-attn-auto"]["instead"]
    assert rows["rpc"]["missing"] == ["ggml_abort_callback_t"]
    assert have("llama_model_params.devices") and not have("llama_model_params.nothing")


def test_init_itself_is_refused_first_naming_the_build_field():
    have = features.for_manifest(manifest({"llama_get_memory", "ggml_backend_rpc_add_server"}))
    req = SimpleNamespace(rpcServers=("127.0.0.1:9",), outputLocal=False, deterministic=False,
                          kvUnified=True, swaFull=True, preselect=False, kvCenter=None)
    e = features.first_refusal(have, req, "old")
    assert e.field == "build" and "llama_get_memory" in str(e) and "so init is refused" in str(e)


@pytest.mark.parametrize("feature,ask", [
    ("output-local", {"outputLocal": True}), ("repack-off", {"deterministic": True}),
    ("kv-streams", {"kvUnified": False}), ("swa-small", {"swaFull": False}),
    ("backend-sampling", {"preselect": True}), ("kv-center", {"kvCenter": "/x/center.npz"})])
def test_each_option_asks_for_its_feature_only_when_set(feature, ask):
    f = features.BY_NAME[feature]
    have = features.for_manifest(manifest(set(f.needs)))
    base = dict(rpcServers=None, outputLocal=False, deterministic=False, kvUnified=True, swaFull=True,
                preselect=False, kvCenter=None)
    assert features.first_refusal(have, SimpleNamespace(**base), "old") is None
    e = features.first_refusal(have, SimpleNamespace(**{**base, **ask}), "old")
    assert e is not None and e.field == f.field and f.needs[0] in str(e)


def test_a_name_belongs_to_one_feature():
    seen: dict[str, str] = {}
    for f in features.FEATURES:
        for n in f.needs:
            assert n not in seen, (n, seen.get(n), f.name)
            seen[n] = f.name
        assert not set(f.fallback) & set(f.needs)
        assert f.refuses == bool(f.refused) and (f.refuses or f.without)


def test_a_request_field_feature_refuses_its_field_never_init():
    """cvec-seq refuses an infer field, naming the build that has it; init is not refused."""
    f = features.BY_NAME["cvec-seq"]
    have = features.for_manifest(manifest(set(f.needs)))
    req = SimpleNamespace(rpcServers=None, outputLocal=False, deterministic=False, kvUnified=True, swaFull=True,
                          preselect=False, kvCenter=None)
    assert features.first_refusal(have, req, "mainline") is None
    e = features.refusal(f, features.lacking(f, have), "mainline")
    assert e.field == "controlVectorStrength"
    assert str(e) == ("controlVectorStrength: build 'mainline' lacks llama_set_adapter_cvec_seq, "
                      "llama_clear_adapter_cvec_seq (a control vector's strength per sequence in one batch), "
                      "so a per-request controlVectorStrength is refused there; "
                      "build 'activations' has it (make activations)")


@pytest.mark.model
def test_mainline_has_every_feature():
    """On the real mainline bindings (fields through cffi, functions through native.Lib):
    every feature but those of a patched flavor (Feature.build), which it lacks."""
    from clickpaca.llama.native import load
    nat = load("mainline")
    for f in features.FEATURES:
        assert features.lacking(f, features.for_native(nat)) == ([] if f.build is None else list(f.needs)), f.name
    have = features.for_native(nat)
    assert not have("llama_context_params.flash_attn")  # b11312 has flash_attn_type only
    assert not have("llama_kv_self_seq_rm") and not have("struct llama_no_such_record")
    every_option = dict(rpcServers=("127.0.0.1:9",), outputLocal=True, deterministic=True,
                        kvUnified=False, swaFull=False, preselect=True, kvCenter=None)
    assert features.first_refusal(have, SimpleNamespace(**every_option), "mainline") is None
    e = features.first_refusal(have, SimpleNamespace(**{**every_option, "kvCenter": "c.npz"}), "mainline")
    assert str(e).startswith("kvCenter: build 'mainline' lacks llama_set_kv_center") and "make kvcenter" in str(e)


@pytest.mark.parametrize("line,feature", [
    ({}, None), ({"rpcServers": ["127.0.0.1:9"]}, "rpc"), ({"outputLocal": True}, "output-local"),
    ({"deterministic": True}, "repack-off"), ({"kvUnified": False}, "kv-streams"),
    ({"swaFull": False}, "swa-small")])
def test_real_init_requests_ask_for_what_their_options_need(line, feature):
    """`asked` reads the fields of the InitRequest the protocol edge makes."""
    from clickpaca.wire.protocol import validate
    req = validate({"type": "init", **line})
    asked = {f.name for f in features.FEATURES if f.refuses and f.asked is not None and f.asked(req)}
    # deterministic mode sets kvUnified false at the edge, so it needs kv streams too
    assert asked == ({feature} if feature else set()) | ({"kv-streams"} if feature == "repack-off" else set())
