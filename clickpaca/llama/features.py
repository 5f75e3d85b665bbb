"""What each optional llama.cpp function or field buys, and what is refused without it.

One table, FEATURES: a feature -> the functions, constants, callback types and record
fields (`llama_model_params.use_extra_bufts`) it needs -> what is refused without them (a
request field, or `init` itself) or what happens instead. Everything in clickpaca that
depends on a name some supported llama.cpp version lacks asks this table (`available`,
`check_init`), never `hasattr` on its own, so that

* `init` on an older build serves, refusing only the options that need what it lacks,
  with an error naming the option and the missing function or field;
* the upgrade report (bindgen/report.py) prints the same table per version, from the
  manifests alone (`table`), and counts a use of a name in a row as handled.

A new dependency on a llama.cpp function or field gets a row here and a compat test in
the same change (docs/UPGRADING.md, "The rule").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: answers "does this build have NAME" for a function, constant, enum value, callback
#: type or "record.field" (`for_native`, `for_manifest`)
Have = Callable[[str], bool]


@dataclass(frozen=True)
class Feature:
    name: str
    what: str  # one line: what it gives
    needs: tuple[str, ...]  # every name it needs
    field: str | None = None  # the init field refused without it ("build": init itself)
    asked: Callable[[Any], bool] | None = None  # does an InitRequest ask for it (None: always)
    refused: str = ""  # what is refused without it, for the error and the table
    without: str = ""  # no refusal: what happens instead where it is absent
    fallback: tuple[str, ...] = ()  # names used only where it is absent
    request: str = "init"  # the request whose `field` is refused (init: check_init refuses it)
    build: str | None = None  # the patched flavor that has it (native/build.py), None: upstream has it

    @property
    def refuses(self) -> bool:
        return self.field is not None


MEMORY_API = ("llama_get_memory", "llama_memory_seq_rm", "llama_memory_seq_cp",
              "llama_memory_seq_keep", "llama_memory_seq_pos_max", "llama_memory_seq_pos_min",
              "llama_memory_clear")

FEATURES: tuple[Feature, ...] = (
    # -- needed to serve at all: init is refused without them
    Feature("vocab-api", "the model / context / vocabulary API clickpaca is written against",
            ("llama_model_load_from_file", "llama_init_from_model", "llama_model_get_vocab",
             "llama_vocab_n_tokens", "llama_vocab_bos", "llama_vocab_eos", "llama_vocab_get_add_bos",
             "llama_vocab_is_eog", "llama_vocab_get_attr", "llama_model_n_ctx_train",
             "llama_model_n_layer", "llama_model_n_embd", "llama_model_chat_template",
             "llama_chat_builtin_templates", "llama_tokenize", "llama_token_to_piece",
             "llama_detokenize", "llama_chat_apply_template",
             "llama_vocab_get_text"),  # pretokenize.py: the special tokens' text
            field="build", refused="init"),
    Feature("memory-api", "per-sequence memory (remove, copy, keep cells) and the sliding window size",
            (*MEMORY_API, "llama_model_n_swa"),
            field="build", refused="init"),
    # -- optional: only the option that needs it is refused
    Feature("rpc", "RPC workers holding part of the model",
            ("ggml_backend_rpc_init", "ggml_backend_rpc_add_server", "RPC_PROTO_MAJOR_VERSION",
             "RPC_PROTO_MINOR_VERSION", "RPC_PROTO_PATCH_VERSION", "ggml_backend_reg_dev_get",
             "ggml_backend_reg_dev_count", "ggml_backend_free", "llama_model_params.devices",
             "ggml_set_abort_callback", "ggml_abort_callback_t"),
            field="rpcServers", asked=lambda r: bool(r.rpcServers), refused="rpcServers"),
    Feature("output-local", "the output layer's weights kept in local memory",
            ("llama_model_params.tensor_buft_overrides", "struct llama_model_tensor_buft_override",
             "ggml_backend_cpu_buffer_type"),
            field="outputLocal", asked=lambda r: bool(r.outputLocal), refused="outputLocal true"),
    Feature("repack-off", "weights kept in their file layout (deterministic mode needs it)",
            ("llama_model_params.use_extra_bufts",),
            field="deterministic", asked=lambda r: bool(r.deterministic), refused="deterministic true",
            without="otherwise: llama.cpp's own choice (repacked where it can)"),
    Feature("kv-streams", "one KV stream per sequence (kvUnified false)",
            ("llama_context_params.kv_unified",),
            field="kvUnified", asked=lambda r: not r.kvUnified, refused="kvUnified false",
            without="otherwise: one cache for all sequences, as kvUnified true asks"),
    Feature("backend-sampling", "sampled rows pre-selected inside the decode (llama/presample/)",
            ("llama_context_params.samplers", "llama_context_params.n_samplers",
             "llama_context_params.n_outputs_max_per_seq", "llama_sampler_init",
             "llama_sampler_i.backend_init", "llama_sampler_i.backend_apply",
             "llama_sampler_i.backend_set_input", "llama_sampler_i.backend_reset",
             "llama_get_sampled_logits_ith", "llama_get_sampled_logits_count_ith",
             "llama_get_sampled_probs_ith", "llama_get_sampled_probs_count_ith", "ggml_cumsum",
             "llama_set_sampler"),
            field="preselect", asked=lambda r: bool(r.preselect), refused="preselect true"),
    Feature("swa-small", "a sliding-window cache sized to the window (swaFull false)",
            ("llama_context_params.swa_full",),
            field="swaFull", asked=lambda r: not r.swaFull, refused="swaFull false",
            without="otherwise: full-size caches, as swaFull true asks"),
    # -- fallbacks: nothing is refused
    Feature("flash-attn-auto", "flashAttn 'auto' resolved by llama.cpp",
            ("llama_context_params.flash_attn_type", "LLAMA_FLASH_ATTN_TYPE_AUTO",
             "LLAMA_FLASH_ATTN_TYPE_ENABLED", "LLAMA_FLASH_ATTN_TYPE_DISABLED"),
            without="the bool llama_context_params.flash_attn: 'auto' runs without flash attention",
            fallback=("llama_context_params.flash_attn",)),
    Feature("op-offload", "every op kept on the host (core.Context offload False: kv-center's calibration)",
            ("llama_context_params.op_offload",),
            without="offload False keeps the KV ops on the host; a big batch's other ops may still go to a GPU"),
    Feature("n-ctx-seq", "the context per sequence, from llama.cpp",
            ("llama_n_ctx_seq",),
            without="nCtxPerSeq computed: the whole context when unified, else an equal share"),
    Feature("device-rows", "ready.devices: the devices with their memory and layers",
            ("ggml_backend_dev_by_type", "ggml_backend_dev_memory", "ggml_backend_dev_name",
             "ggml_backend_dev_description", "GGML_BACKEND_DEVICE_TYPE_CPU"),
            without="ready.devices is empty"),
    Feature("cvec", "a control vector added to every token of a context (activations/steer.py)",
            ("llama_set_adapter_cvec",),
            without="its earlier name, llama_apply_adapter_cvec or llama_control_vector_apply",
            fallback=("llama_apply_adapter_cvec", "llama_control_vector_apply")),
    Feature("eval-callback-live", "the eval callback set and unset on a live context: capture "
            "only on the decodes that capture (engine/readout.py), and activation patching, rows "
            "written into graph nodes on the decodes that patch (engine/patches.py)",
            ("llama_set_eval_callback",),
            without="the callback is given at context creation: init capture true installs it "
                    "(asked once per graph node on every decode); without it capture is refused; "
                    "patch is refused (patches.refusal names the build that has it)",
            build="activations"),
    Feature("cvec-seq", "a control vector's strength per sequence in one batch",
            ("llama_set_adapter_cvec_seq", "llama_clear_adapter_cvec_seq"),
            field="controlVectorStrength", request="infer", build="activations",
            refused="a per-request controlVectorStrength",
            without="init's controlVector still steers every sequence alike (llama_set_adapter_cvec)"),
    Feature("logit-lens", "the logit lens: the model file's final norm and output head applied to "
            "captured l_out rows in a ggml graph of its own (activations/lens.py)",
            ("gguf_init_from_file", "gguf_find_key", "gguf_get_val_str", "gguf_get_val_f32",
             "gguf_find_tensor", "gguf_get_tensor_offset", "gguf_get_tensor_size", "gguf_get_data_offset",
             "gguf_free",
             "ggml_get_tensor", "ggml_backend_cpu_buffer_from_ptr", "ggml_backend_tensor_alloc",
             "ggml_rms_norm", "ggml_top_k", "ggml_argmax", "ggml_soft_max", "ggml_sum_rows", "ggml_concat"),
            field="lens", request="infer", refused="a request's lens"),
    Feature("steer-slots", "each request's own steering vectors: K direction slots per context, "
            "strengths per token and layer, triggers and in-graph gates (activations/steering.py)",
            ("llama_steer_set_slots", "llama_steer_set_slot", "llama_steer_set_table", "llama_steer_set_gate",
             "llama_steer_n_reserve"),
            field="steer", request="infer", build="activations",
            refused="a request's steer (and the vector request)",
            without="requests steer only through init's controlVector"),
    Feature("kv-center", "key centering in the graph: each key stored minus its layer's "
            "calibrated mean key (llama/kvcenter.py, docs/KV-RESEARCH.md)",
            ("llama_set_kv_center",),
            field="kvCenter", asked=lambda r: r.kvCenter is not None,
            refused="init's kvCenter", build="kvcenter"),
    Feature("backend-modules", "a CPU backend loaded at run time (a PORTABLE=1 build's variants)",
            ("ggml_backend_load_all_from_path",),
            without="a build whose CPU backend is a run-time module (PORTABLE=1) is refused at "
                    "load; native builds need nothing"),
)
BY_NAME = {f.name: f for f in FEATURES}


class FeatureMissing(ValueError):
    """A request needs a feature this build lacks; `field` is the request field to blame."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def lacking(feature: str | Feature, have: Have) -> list[str]:
    """The names of the feature this build lacks ([] where it is available)."""
    f = BY_NAME[feature] if isinstance(feature, str) else feature
    return [n for n in f.needs if not have(n)]


def for_manifest(m: dict) -> Have:
    """`have` over a generated manifest (bindgen): no library loaded."""
    enum_values = {v for vals in m.get("enums", {}).values() for v in vals}
    fields = {f"{rec.split(' ', 1)[-1]}.{f['name']}" for rec, r in m.get("records", {}).items()
              for f in r.get("fields", [])}
    names = set(m.get("functions", {})) | set(m.get("constants", {})) | enum_values \
        | set(m.get("callbacks", {})) | set(m.get("records", {})) | fields
    return names.__contains__


def for_native(nat: Any) -> Have:
    """`have` over a loaded build's bindings (clickpaca.llama.native.Native), cached per build."""
    cached = _native_have.get(nat.name)
    if cached is None or cached[0] is not nat:
        cached = _native_have[nat.name] = (nat, {})
    seen = cached[1]

    def have(name: str) -> bool:
        if name not in seen:
            seen[name] = _native_has(nat, name)
        return seen[name]
    return have


_native_have: dict[str, tuple[Any, dict[str, bool]]] = {}


def _native_has(nat: Any, name: str) -> bool:
    ffi = nat.ffi
    record, dot, field = name.partition(".")
    if dot or name.startswith(("struct ", "union ")) or name.endswith("_t"):
        spelled = [f"struct {record}", record] if dot else [name]
        for text in spelled:
            try:
                t = ffi.typeof(text)
            except Exception:  # noqa: BLE001 - cffi's errors for an unknown type vary
                continue
            if t.kind not in ("struct", "union"):
                return not dot  # a typedef (a callback type); no fields
            fields = t.fields  # None: undeclared or opaque, as cffi takes an unknown struct
            return fields is not None and (not dot or field in dict(fields))
        return False
    return hasattr(nat.lib, name)  # a function, constant or enum value (native.Lib)


def available(nat: Any, feature: str) -> bool:
    return not lacking(feature, for_native(nat))


def refusal(feature: str | Feature, missing: list[str], build: str) -> FeatureMissing:
    """The error naming the request field, the build and what it lacks (and which build
    has it, for a patched flavor's feature)."""
    f = BY_NAME[feature] if isinstance(feature, str) else feature
    where = f"; build {f.build!r} has it (make {f.build})" if f.build else ""
    return FeatureMissing(f.field or "build", f"build {build!r} lacks {', '.join(missing)} "
                                              f"({f.what}), so {f.refused} is refused there{where}")


def require(nat: Any, feature: str) -> None:
    """FeatureMissing naming the field where the build lacks the feature."""
    missing = lacking(feature, for_native(nat))
    if missing:
        raise refusal(feature, missing, nat.name)


def check_init(nat: Any, req: Any) -> None:
    """Before anything is loaded: FeatureMissing for the first feature the init request
    needs that the build lacks (init itself where the build cannot serve at all)."""
    refused = first_refusal(for_native(nat), req, nat.name)
    if refused is not None:
        raise refused


def first_refusal(have: Have, req: Any, build: str) -> FeatureMissing | None:
    """What check_init raises, for any `have`: the features init itself needs first, then
    those the request's options ask for, in table order."""
    for f in FEATURES:
        if f.refuses and f.request == "init" and (f.asked is None or f.asked(req)):
            missing = lacking(f, have)
            if missing:
                return refusal(f, missing, build)
    return None


def table(have: Have) -> list[dict[str, Any]]:
    """Every feature on one build: works / fallback / refused, with what and why."""
    rows = []
    for f in FEATURES:
        missing = lacking(f, have)
        status = "works" if not missing else "refused" if f.refuses else "fallback"
        rows.append({"feature": f.name, "what": f.what, "status": status, "missing": missing,
                     "refused": f.refused if missing and f.refuses else "",
                     "instead": f.without if missing and not f.refuses else ""})
    return rows


def row_of(name: str) -> tuple[Feature | None, Feature | None]:
    """The feature that needs `name`, and the one whose fallback uses it (either None)."""
    need = next((f for f in FEATURES if name in f.needs), None)
    back = next((f for f in FEATURES if name in f.fallback), None)
    return need, back
