#!/usr/bin/env python3
"""Apply the clickpaca key-centering patch to a COPY of a llama.cpp source tree.

    python3 native/kvcenter/apply.py <llama.cpp-source-dir>

Key centering (docs/KV-RESEARCH.md, "Centering with the real kernels"): one calibrated
vector per layer (the mean key of each KV head) is subtracted from every key before it is
stored, so the cache quantizes k - c instead of k. Exact for attention: q.(k - c) differs
from q.k by one constant per query, which softmax removes. The study measured it through
the eval callback (a Python subtraction per layer per decode, CPU only); this patch puts
the subtraction in the graph, one ggml_sub per layer:

    k_cur = k_cur - center_il        (F32 [n_embd_head_k, n_head_kv], broadcast over tokens)

at the start of build_attn for the KV-cache attentions (llm_graph_input_attn_kv and
llm_graph_input_attn_kv_iswa: llama, Gemma 3 and most models), after RoPE and before
mainline's rotation of quantized caches, the point where the study's callback changed
`Kcur-L`. No ggml op of ours: the ops exist, llama.cpp has no place to insert them.
Before a center is set, and after it is cleared, the graph is upstream's, bit for bit.
New C API (include/llama.h):

    int32_t llama_set_kv_center(struct llama_context * ctx, const float * center, size_t len);

center: for every layer in order, n_embd_k_gqa(il) floats; NULL clears. The centers live
next to the control vector (llama_adapter_cvec), one tensor per layer in that layer's
buffer type. Keys stored under one center mean nothing under another: a KV state saved
centered loads correctly only into a context with the same center (the caller's check),
and a RoPE shift of centered keys is not exact (K-shift rotates the center too).

Every anchor must match exactly once, or nothing at all is written (native/patchset.py).
Standard library only. Targets b11312 (0c1e57098); applied after the activations set.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from patchset import Hook, PatchError, PatchSet  # noqa: E402  (native/patchset.py)

MARK = "clickpaca kvcenter"

HOOKS = [
    Hook("include/llama.h",
         "    //\n    // Memory\n    //\n",
         f"    // {MARK}: key centering. center holds, for every layer il in order,\n"
         "    // n_embd_k_gqa(il) floats (the mean key of each KV head, after RoPE, before the\n"
         "    // cache's own rotation); each key is then stored as k - center_il. Exact for\n"
         "    // attention (q.(k - c) differs from q.k by a constant per query). NULL clears.\n"
         "    // Returns 0, or -1 when len is not the sum of n_embd_k_gqa over the layers.\n"
         "    LLAMA_API int32_t llama_set_kv_center(\n"
         "            struct llama_context * ctx,\n"
         "                     const float * center,\n"
         "                          size_t   len);\n\n",
         "before", "the public API"),
    Hook("src/llama-adapter.h",
         "private:\n    bool init(const llama_model & model);\n",
         f"    // {MARK}: k_cur - center_il, or k_cur where no center is set\n"
         "    ggml_tensor * center_k(ggml_context * ctx, ggml_tensor * k_cur, int il) const;\n\n"
         "    // every layer's center (n_embd_k_gqa(il) floats each, in layer order); NULL clears\n"
         "    bool set_k_center(const llama_model & model, const float * data, size_t len);\n\n"
         "    bool has_k_center() const { return !k_center.empty(); }\n\n",
         "before", "the centering methods, public"),
    Hook("src/llama-adapter.h",
         "    std::vector<ggml_tensor *> tensors; // per layer\n};\n",
         f"\n    // {MARK}: F32 [n_embd_head_k, n_head_kv] per layer; empty when none is set\n"
         "    std::vector<ggml_tensor *> k_center;\n"
         "    std::vector<ggml_context_ptr> k_center_ctxs;\n"
         "    std::vector<ggml_backend_buffer_ptr> k_center_bufs;\n",
         "before", "the centers' storage"),
    Hook("src/llama-adapter.cpp",
         "bool llama_adapter_cvec::init(const llama_model & model) {\n",
         f"// {MARK}\n"
         "ggml_tensor * llama_adapter_cvec::center_k(ggml_context * ctx, ggml_tensor * k_cur, int il) const {\n"
         "    if (k_cur == nullptr || il < 0 || (size_t) il >= k_center.size()) {\n"
         "        return k_cur;\n"
         "    }\n"
         "    GGML_ASSERT(k_cur->ne[0] == k_center[il]->ne[0] && k_cur->ne[1] == k_center[il]->ne[1]\n"
         "                && \"kv center: the keys' shape is not the center's\");\n"
         "    return ggml_sub(ctx, k_cur, k_center[il]); // broadcast over the tokens\n"
         "}\n\n"
         "bool llama_adapter_cvec::set_k_center(const llama_model & model, const float * data, size_t len) {\n"
         "    const auto & hparams = model.hparams;\n"
         "    const uint32_t n_layer = hparams.n_layer();\n"
         "    size_t need = 0;\n"
         "    for (uint32_t il = 0; il < n_layer; ++il) {\n"
         "        need += hparams.n_embd_k_gqa(il);\n"
         "    }\n"
         "    if (data != nullptr && len != need) {\n"
         "        LLAMA_LOG_ERROR(\"%s: center has %zu floats, the layers' keys need %zu\\n\", __func__, len, need);\n"
         "        return false;\n"
         "    }\n"
         "    k_center.clear();\n"
         "    k_center_bufs.clear();\n"
         "    k_center_ctxs.clear();\n"
         "    if (data == nullptr) {\n"
         "        return true;\n"
         "    }\n"
         "    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_map;\n"
         "    for (uint32_t il = 0; il < n_layer; ++il) {\n"
         "        ggml_backend_buffer_type_t buft = model.select_buft(il);\n"
         "        auto it = ctx_map.find(buft);\n"
         "        if (it == ctx_map.end()) {\n"
         "            ggml_init_params params = { n_layer*ggml_tensor_overhead(), NULL, true };\n"
         "            ggml_context * ctx = ggml_init(params);\n"
         "            if (!ctx) {\n"
         "                k_center.clear();\n"
         "                return false;\n"
         "            }\n"
         "            k_center_ctxs.emplace_back(ctx);\n"
         "            it = ctx_map.emplace(buft, ctx).first;\n"
         "        }\n"
         "        k_center.push_back(ggml_new_tensor_2d(it->second, GGML_TYPE_F32,\n"
         "                                              hparams.n_embd_head_k(il), hparams.n_head_kv(il)));\n"
         "    }\n"
         "    for (auto & [buft, ctx] : ctx_map) {\n"
         "        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);\n"
         "        if (!buf) {\n"
         "            LLAMA_LOG_ERROR(\"%s: failed to allocate the kv center\\n\", __func__);\n"
         "            k_center.clear();\n"
         "            k_center_bufs.clear();\n"
         "            k_center_ctxs.clear();\n"
         "            return false;\n"
         "        }\n"
         "        k_center_bufs.emplace_back(buf);\n"
         "    }\n"
         "    size_t off = 0;\n"
         "    for (uint32_t il = 0; il < n_layer; ++il) {\n"
         "        ggml_backend_tensor_set(k_center[il], data + off, 0, ggml_nbytes(k_center[il]));\n"
         "        off += hparams.n_embd_k_gqa(il);\n"
         "    }\n"
         "    return true;\n"
         "}\n\n",
         "before", "the centering methods' bodies"),
    Hook("src/llama-graph.cpp",
         "    GGML_ASSERT(v_mla == nullptr);\n\n    if (inp->self_k_rot) {\n",
         f"    GGML_ASSERT(v_mla == nullptr);\n\n"
         f"    k_cur = cvec->center_k(ctx0, k_cur, il); // {MARK}: before the cache's rotation\n\n"
         "    if (inp->self_k_rot) {\n",
         "replace", "centering in the KV attention"),
    Hook("src/llama-graph.cpp",
         "    const bool is_swa = hparams.is_swa(il);\n\n"
         "    auto * k_rot = is_swa ? inp->self_k_rot_swa : inp->self_k_rot;\n"
         "    auto * v_rot = is_swa ? inp->self_v_rot_swa : inp->self_v_rot;\n\n"
         "    if (k_rot) {\n        q_cur = llama_mul_mat_hadamard(ctx0, q_cur, k_rot);\n"
         "        if (k_cur) {\n",
         "    const bool is_swa = hparams.is_swa(il);\n\n"
         f"    k_cur = cvec->center_k(ctx0, k_cur, il); // {MARK}: before the cache's rotation (null: shared KV)\n\n"
         "    auto * k_rot = is_swa ? inp->self_k_rot_swa : inp->self_k_rot;\n"
         "    auto * v_rot = is_swa ? inp->self_v_rot_swa : inp->self_v_rot;\n\n"
         "    if (k_rot) {\n        q_cur = llama_mul_mat_hadamard(ctx0, q_cur, k_rot);\n"
         "        if (k_cur) {\n",
         "replace", "centering in the sliding-window KV attention"),
    Hook("src/llama-context.h",
         "    void set_eval_callback(ggml_backend_sched_eval_callback cb, void * user_data);\n",
         f"    bool set_kv_center(const float * center, size_t len); // {MARK}\n",
         "after", "the context method"),
    Hook("src/llama-context.cpp",
         "void llama_context::set_eval_callback(ggml_backend_sched_eval_callback cb, void * user_data) {\n",
         f"// {MARK}\n"
         "bool llama_context::set_kv_center(const float * center, size_t len) {\n"
         "    synchronize(); // no decode in flight reads the old center\n"
         "    const bool had = cvec->has_k_center();\n"
         "    const bool ok = cvec->set_k_center(model, center, len);\n"
         "    if (had || cvec->has_k_center()) {\n"
         "        sched_need_reserve = true; // the graph gains or loses the subtraction: no reuse\n"
         "    }\n"
         "    return ok;\n"
         "}\n\n",
         "before", "the context method's body"),
    Hook("src/llama-context.cpp",
         "//\n// memory\n//\n",
         f"// {MARK}\n"
         "int32_t llama_set_kv_center(llama_context * ctx, const float * center, size_t len) {\n"
         "    return ctx->set_kv_center(center, len) ? 0 : -1;\n"
         "}\n\n",
         "before", "the C function"),
]


PATCH = PatchSet("kvcenter patch", MARK, tuple(HOOKS), HERE)
plan, apply = PATCH.plan, PATCH.apply
__all__ = ["HOOKS", "PATCH", "PatchError", "apply", "plan"]

if __name__ == "__main__":
    sys.exit(PATCH.main(sys.argv[1:], __doc__))
