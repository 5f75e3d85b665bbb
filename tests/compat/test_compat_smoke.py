"""`make test-compat`: an older llama.cpp through bindings generated with zero hand edits.

    COMPAT_BUILD=builds/compat-0.3.16 python -m pytest tests/compat -q

The build-dependent tests skip when COMPAT_BUILD is not set; a COMPAT_BUILD that is set
but missing is a failure. The smoke test itself runs in a child process
(`python -m bindgen.compat`): two builds' libggml share a soname, so one process must not
load both. The tests of `plan` need no build.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bindgen.smoke_model import knows_architecture
from bindgen.compat import IF_PRESENT, CompatError, adapted, params_of, plan, takes_vocab

from compat_common import MAINLINE, MAINLINE_MANIFEST, last_json, run


@pytest.mark.model
def test_bindings_generated_with_zero_hand_edits(generated):
    build, out = generated
    info = json.loads((build / "build-info.json").read_text())
    manifest = json.loads((build / "bindings" / "manifest.json").read_text())
    assert manifest["stamp"]["commit"] == info["commit"]
    # stamped with the vendored llama.cpp's own commit and upstream build number
    assert info["commit"] != "unknown" and not info["commit"].startswith("sdist-")
    assert info["build_number"] > 0, info.get("build_number_from")
    report = (build / "bindings" / "changes.txt").read_text()
    assert report.startswith("Change report:")
    assert report.strip() in out
    if MAINLINE_MANIFEST.exists():
        mainline = json.loads(MAINLINE_MANIFEST.read_text())
        # from the older version (this build) to the newer one (mainline)
        head = report.splitlines()[0]
        assert head.index(f"compat {info['commit']}") < head.index(f"mainline {mainline['stamp']['commit']}")
        assert head.startswith(f"Change report: b{info['build_number']} ")
    for name in ("llama_decode", "llama_tokenize", "llama_batch_init", "llama_get_logits_ith"):
        assert name in manifest["functions"]


@pytest.mark.model
def test_plan_uses_only_functions_of_both_versions(generated):
    """Every role runs a function both versions have, except a role one version does not
    need (model_vocab: before the vocabulary API, tokenizing takes the model) and renamed
    functions (each build its own name)."""
    build, _ = generated
    if not MAINLINE_MANIFEST.exists():
        pytest.skip("no mainline bindings to compare with")
    old = json.loads((build / "bindings" / "manifest.json").read_text())
    new = json.loads(MAINLINE_MANIFEST.read_text())
    use, back = plan(old, new), plan(new, old)
    renamed = adapted(use, new)
    for role, name in use.items():
        assert name in old["functions"], (role, name)
        if role in IF_PRESENT:
            continue
        assert role in back, role  # the other version fills the role too
        if role not in renamed:
            assert name in new["functions"] and back[role] == name, (role, name)
    assert set(use) - IF_PRESENT == set(back) - IF_PRESENT
    if "llama_model_get_vocab" not in old["functions"]:
        assert "model_vocab" not in use and not takes_vocab(old["functions"][use["tokenize"]])


@pytest.mark.model
def test_smoke_on_the_compat_build(generated):
    build, _ = generated
    proc = run("-m", "bindgen.compat", str(build), "--skip-generate")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    result = last_json(proc.stdout)
    sys.stderr.write(json.dumps(result) + "\n")
    assert result["ok"] and result["logits_finite"]
    # the default model where this version knows its architecture, else SmolLM2
    knows_gemma3 = knows_architecture(build / "lib" / "libllama.so", "gemma3")
    assert Path(result["model"]).name == ("gemma-3-270m-q4_k_m.gguf" if knows_gemma3
                                          else "SmolLM2-135M-Instruct.Q4_1.gguf"), result["model_why"]
    assert result["tokens"] and all(0 <= t < result["n_vocab"] for t in result["tokens"])
    assert 0 <= result["argmax"] < result["n_vocab"]


@pytest.mark.model
def test_same_smoke_on_mainline_tokenizes_alike(generated):
    """The same smoke code, restricted to the common API, on mainline: same tokens."""
    build, _ = generated
    if not MAINLINE_MANIFEST.exists():
        pytest.skip("no mainline bindings")
    old = run("-m", "bindgen.compat", str(build), "--skip-generate")
    assert old.returncode == 0, old.stderr[-3000:]
    a = last_json(old.stdout)
    new = run("-m", "bindgen.compat", str(MAINLINE), "--skip-generate", "--model", a["model"],
              "--common-with", str(build / "bindings" / "manifest.json"))
    assert new.returncode == 0, new.stderr[-3000:]
    b = last_json(new.stdout)
    assert a["tokens"] == b["tokens"]
    assert a["n_vocab"] == b["n_vocab"]
    assert set(a["functions"]) - {"model_vocab"} == set(b["functions"]) - {"model_vocab"}


# ---------------------------------------------------------------- plan (no build needed)


def _manifest(functions: dict[str, str]) -> dict:
    batch = {"size": 56, "fields": [{"name": n, "type": "?", "offset": 0} for n in
                                    ("n_tokens", "token", "embd", "pos", "n_seq_id", "seq_id", "logits")]}
    return {"functions": functions, "records": {"struct llama_batch": batch}, "callbacks": {}}


COMMON = {
    "llama_backend_init": "void llama_backend_init(void)",
    "llama_model_default_params": "struct llama_model_params llama_model_default_params(void)",
    "llama_context_default_params": "struct llama_context_params llama_context_default_params(void)",
    "llama_free": "void llama_free(struct llama_context *ctx)",
    "llama_batch_init": "struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max)",
    "llama_batch_free": "void llama_batch_free(struct llama_batch batch)",
    "llama_decode": "int32_t llama_decode(struct llama_context *ctx, struct llama_batch batch)",
    "llama_get_logits_ith": "float *llama_get_logits_ith(struct llama_context *ctx, int32_t i)",
}
OLD_API = dict(COMMON, **{
    "llama_load_model_from_file": "struct llama_model *llama_load_model_from_file(const char *path_model, struct llama_model_params params)",
    "llama_free_model": "void llama_free_model(struct llama_model *model)",
    "llama_new_context_with_model": "struct llama_context *llama_new_context_with_model(struct llama_model *model, struct llama_context_params params)",
    "llama_n_vocab": "int32_t llama_n_vocab(const struct llama_model *model)",
    "llama_tokenize": "int32_t llama_tokenize(const struct llama_model *model, const char *text, int32_t text_len, llama_token *tokens, int32_t n_tokens_max, _Bool add_special, _Bool parse_special)",
})
NEW_API = dict(COMMON, **{
    "llama_model_load_from_file": "struct llama_model *llama_model_load_from_file(const char *path_model, struct llama_model_params params)",
    "llama_load_model_from_file": OLD_API["llama_load_model_from_file"],
    "llama_model_free": "void llama_model_free(struct llama_model *model)",
    "llama_init_from_model": "struct llama_context *llama_init_from_model(struct llama_model *model, struct llama_context_params params)",
    "llama_model_get_vocab": "const struct llama_vocab *llama_model_get_vocab(const struct llama_model *model)",
    "llama_vocab_n_tokens": "int32_t llama_vocab_n_tokens(const struct llama_vocab *vocab)",
    "llama_tokenize": "int32_t llama_tokenize(const struct llama_vocab *vocab, const char *text, int32_t text_len, llama_token *tokens, int32_t n_tokens_max, _Bool add_special, _Bool parse_special)",
})


def test_plan_prefers_the_new_api_when_present():
    use = plan(_manifest(NEW_API))
    assert use["model_load"] == "llama_model_load_from_file"
    assert use["context_new"] == "llama_init_from_model"
    assert use["n_vocab"] == "llama_vocab_n_tokens"
    assert takes_vocab(NEW_API[use["tokenize"]])


def test_plan_adapts_to_the_old_api():
    use = plan(_manifest(OLD_API))
    assert use["model_load"] == "llama_load_model_from_file"
    assert use["model_free"] == "llama_free_model"
    assert use["context_new"] == "llama_new_context_with_model"
    assert use["n_vocab"] == "llama_n_vocab"
    assert "model_vocab" not in use
    assert not takes_vocab(OLD_API[use["tokenize"]])


def test_plan_restricted_to_both_versions_prefers_common_names_and_adapts_renames():
    new, old = _manifest(NEW_API), _manifest(OLD_API)
    use = plan(new, common_with=old)
    assert use["model_load"] == "llama_load_model_from_file"  # the name both versions have
    assert use["model_free"] == "llama_model_free"  # renamed: each side uses its own name
    assert use["model_vocab"] == "llama_model_get_vocab"  # needed: tokenize takes the vocab
    assert adapted(use, old) == {"model_free": "llama_model_free", "context_new": "llama_init_from_model",
                                 "n_vocab": "llama_vocab_n_tokens", "model_vocab": "llama_model_get_vocab"}
    back = plan(old, common_with=new)
    assert back["model_load"] == "llama_load_model_from_file" and "model_vocab" not in back
    assert set(back) == set(use) - {"model_vocab"}
    with pytest.raises(CompatError, match="context_new .*missing in the other build"):
        plan(new, common_with=_manifest(dict(COMMON, llama_free_model="", llama_n_vocab="",
                                             llama_load_model_from_file="", llama_tokenize="")))
    with pytest.raises(CompatError, match="decode .*missing in this build"):
        plan(_manifest({k: v for k, v in NEW_API.items() if k != "llama_decode"}))


def test_plan_refuses_a_batch_without_the_fields_it_fills():
    m = _manifest(NEW_API)
    m["records"]["struct llama_batch"]["fields"] = [{"name": "n_tokens", "type": "int32_t", "offset": 0}]
    with pytest.raises(CompatError, match="llama_batch lacks"):
        plan(m)


def test_params_of():
    assert params_of("void f(void)") == []
    assert params_of(NEW_API["llama_batch_init"]) == ["int32_t n_tokens", "int32_t embd", "int32_t n_seq_max"]
