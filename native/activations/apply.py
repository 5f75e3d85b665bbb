#!/usr/bin/env python3
"""Apply the clickpaca activations patch to a COPY of a llama.cpp source tree.

    python3 native/activations/apply.py <llama.cpp-source-dir>

Two small changes for reading and steering activations per sequence:

1. The eval callback set and unset on a live context (llama_set_eval_callback), so a
   decode without a capture runs with no callback at all: upstream takes cb_eval only at
   context creation, and a Python callback asked once per graph node (about 730 nodes a
   decode for Gemma 3 270M) costs microseconds each (docs/ACTIVATIONS.md).

2. The control vector per sequence. Upstream adds layer il's direction to
every token (llama_adapter_cvec::apply_to, called by llm_graph_context::build_cvec, which
every model builder calls once per layer just before naming the node l_out). With this
patch, once a strength has been given for any sequence,

    cur = cur + direction_il * strength[token]        (broadcast over n_embd)

where strength[token] is the strength of the token's sequence (0 for a sequence never
given one): one graph input of n_tokens floats, filled from the micro-batch's sequence
ids in set_input, so strengths change without rebuilding the graph. A token of strength 0
gets cur + 0: exactly its unsteered value. Before any strength is given the graph is
upstream's, bit for bit. New C API (include/llama.h):

    int32_t llama_set_adapter_cvec_seq(struct llama_context * ctx, llama_seq_id seq_id, float strength);
    void    llama_clear_adapter_cvec_seq(struct llama_context * ctx);  // back to upstream's
    void    llama_set_eval_callback(struct llama_context * ctx, ggml_backend_sched_eval_callback cb, void * user_data);

The vector itself is still set by llama_set_adapter_cvec (directions and layer range);
give it unscaled and steer each sequence by its strength.

Every anchor must match exactly once, or nothing at all is written (exit status 1, a
message naming the file and anchor: native/patchset.py, shared with the other patch sets).
Standard library only. Targets b11312 (0c1e57098).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from patchset import Hook, PatchError, PatchSet  # noqa: E402  (native/patchset.py)

MARK = "clickpaca activations"

HOOKS = [
    Hook("include/llama.h",
         "    //\n    // Memory\n    //\n",
         f"    // {MARK}: the control vector per sequence. Once any sequence has a strength, layer\n"
         "    // il's direction is added to each token scaled by its sequence's strength (0 for a\n"
         "    // sequence never given one). Returns 0, or -1 for a seq_id out of range.\n"
         "    LLAMA_API int32_t llama_set_adapter_cvec_seq(\n"
         "            struct llama_context * ctx,\n"
         "                    llama_seq_id   seq_id,\n"
         "                           float   strength);\n\n"
         "    // Back to one strength (1) for every token: upstream's graph.\n"
         "    LLAMA_API void llama_clear_adapter_cvec_seq(struct llama_context * ctx);\n\n"
         "    // The eval callback of a live context (cb_eval of llama_context_params); NULL: none.\n"
         "    LLAMA_API void llama_set_eval_callback(\n"
         "            struct llama_context * ctx,\n"
         "            ggml_backend_sched_eval_callback cb,\n"
         "            void * user_data);\n\n",
         "before", "the public API, next to llama_set_adapter_cvec"),
    Hook("src/llama-adapter.h",
         "    ggml_tensor * apply_to(ggml_context * ctx, ggml_tensor * cur, int  il) const;\n",
         f"\n    // {MARK}: cur + dir_il * strength (strength: F32 [1, cur->ne[1]]); cur where no dir\n"
         "    ggml_tensor * apply_to_scaled(ggml_context * ctx, ggml_tensor * cur, int il, ggml_tensor * strength) const;\n\n"
         "    // per sequence strength, LLAMA_MAX_SEQ entries once any is set; empty: upstream's graph\n"
         "    std::vector<float> seq_strength;\n\n"
         "    bool per_seq() const { return !seq_strength.empty(); }\n",
         "after", "the per-sequence strengths and the scaled add, beside apply_to"),
    Hook("src/llama-adapter.cpp",
         "bool llama_adapter_cvec::init(const llama_model & model) {\n",
         f"// {MARK}\n"
         "ggml_tensor * llama_adapter_cvec::apply_to_scaled(ggml_context * ctx, ggml_tensor * cur, int il, ggml_tensor * strength) const {\n"
         "    ggml_tensor * layer_dir = tensor_for(il);\n"
         "    if (layer_dir == nullptr) {\n"
         "        return cur;\n"
         "    }\n"
         "    // [n_embd] -> [n_embd, n] times [1, n] (broadcast over n_embd)\n"
         "    ggml_tensor * delta = ggml_mul(ctx, ggml_repeat(ctx, layer_dir, cur), strength);\n"
         "    return ggml_add(ctx, cur, delta);\n"
         "}\n\n",
         "before", "the scaled add"),
    Hook("src/llama-graph.h",
         "class llm_graph_input_mean : public llm_graph_input_i {\n",
         f"// {MARK}: the strength of each token's sequence, for the batch and for its output rows\n"
         "// (the last layer of most models keeps only the output rows, via inp_out_ids)\n"
         "class llm_graph_input_cvec : public llm_graph_input_i {\n"
         "public:\n"
         "    llm_graph_input_cvec(const llama_adapter_cvec * cvec, uint32_t n_tokens, uint32_t n_outputs)\n"
         "        : cvec(cvec), n_tokens(n_tokens), n_outputs(n_outputs) {}\n"
         "    virtual ~llm_graph_input_cvec() = default;\n\n"
         "    void set_input(const llama_ubatch * ubatch) override;\n\n"
         "    bool can_reuse(const llm_graph_params & params) override;\n\n"
         "    // each made by the first layer that needs it: an input no node uses is never allocated\n"
         "    ggml_tensor * strength     = nullptr; // F32 [1, n_tokens]\n"
         "    ggml_tensor * strength_out = nullptr; // F32 [1, n_outputs]\n\n"
         "    const llama_adapter_cvec * cvec;\n"
         "    const uint32_t n_tokens;\n"
         "    const uint32_t n_outputs;\n"
         "};\n\n",
         "before", "the graph input class"),
    Hook("src/llama-graph.h",
         "    ggml_tensor * build_cvec(\n             ggml_tensor * cur,\n                     int   il) const;\n",
         f"\n    mutable llm_graph_input_cvec * inp_cvec = nullptr; // {MARK}: built at the first layer that needs it\n",
         "after", "one strength input per graph"),
    Hook("src/llama-graph.cpp",
         "bool llm_graph_input_out_ids::can_reuse(const llm_graph_params & params) {\n",
         f"// {MARK}\n"
         "void llm_graph_input_cvec::set_input(const llama_ubatch * ubatch) {\n"
         "    GGML_ASSERT(!strength     || ggml_backend_buffer_is_host(strength->buffer));\n"
         "    GGML_ASSERT(!strength_out || ggml_backend_buffer_is_host(strength_out->buffer));\n"
         "    float * s = strength     ? (float *) strength->data     : nullptr;\n"
         "    float * o = strength_out ? (float *) strength_out->data : nullptr;\n"
         "    const auto & table = cvec->seq_strength;\n"
         "    uint32_t j = 0;\n"
         "    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {\n"
         "        const llama_seq_id seq = ubatch->seq_id[i][0]; // a token shared by sequences takes the first's\n"
         "        const float v = seq >= 0 && (size_t) seq < table.size() ? table[seq] : 0.0f;\n"
         "        if (s) {\n"
         "            s[i] = v;\n"
         "        }\n"
         "        // the output rows in batch order, as llm_graph_input_out_ids lists them\n"
         "        if (o && j < n_outputs && (n_outputs == ubatch->n_tokens || (ubatch->output && ubatch->output[i]))) {\n"
         "            o[j++] = v;\n"
         "        }\n"
         "    }\n"
         "}\n\n"
         "bool llm_graph_input_cvec::can_reuse(const llm_graph_params & params) {\n"
         "    return n_tokens == params.ubatch.n_tokens && n_outputs == params.n_outputs && params.cvec == cvec\n"
         "        && cvec->per_seq();\n"
         "}\n\n",
         "before", "filling the strengths from the micro-batch's sequence ids"),
    Hook("src/llama-graph.cpp",
         "    return cvec->apply_to(ctx0, cur, il);\n",
         f"    if (cvec->per_seq()) {{ // {MARK}\n"
         "        if (cvec->tensor_for(il) == nullptr || cur->ne[1] == 0) {\n"
         "            return cur;\n"
         "        }\n"
         "        if (inp_cvec == nullptr) {\n"
         "            auto inp = std::make_unique<llm_graph_input_cvec>(cvec, n_tokens, n_outputs);\n"
         "            inp_cvec = inp.get();\n"
         "            res->add_input(std::move(inp));\n"
         "        }\n"
         "        // all the batch's rows, or (the last layer, after inp_out_ids) its output rows\n"
         "        const bool all_rows = cur->ne[1] == n_tokens;\n"
         "        GGML_ASSERT((all_rows || cur->ne[1] == n_outputs) && \"cvec-seq: rows neither the batch nor its outputs\");\n"
         "        ggml_tensor *& s = all_rows ? inp_cvec->strength : inp_cvec->strength_out;\n"
         "        if (s == nullptr) {\n"
         "            s = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, cur->ne[1]);\n"
         "            ggml_set_input(s);\n"
         "            ggml_set_name(s, all_rows ? \"cvec_strength\" : \"cvec_strength_out\");\n"
         "        }\n"
         "        return cvec->apply_to_scaled(ctx0, cur, il, s);\n"
         "    }\n",
         "before", "build_cvec: the scaled add once strengths are per sequence"),
    Hook("src/llama-context.h",
         "    bool set_adapter_cvec(\n            const float * data,\n                 size_t   len,\n"
         "                int32_t   n_embd,\n                int32_t   il_start,\n                int32_t   il_end);\n",
         f"\n    bool set_adapter_cvec_seq(llama_seq_id seq_id, float strength); // {MARK}\n"
         "    void clear_adapter_cvec_seq();\n"
         "    void set_eval_callback(ggml_backend_sched_eval_callback cb, void * user_data);\n",
         "after", "the context methods"),
    Hook("src/llama-context.cpp",
         "llm_graph_result * llama_context::process_ubatch(",
         f"// {MARK}\n"
         "bool llama_context::set_adapter_cvec_seq(llama_seq_id seq_id, float strength) {\n"
         "    if (seq_id < 0 || seq_id >= LLAMA_MAX_SEQ) {\n"
         "        return false;\n"
         "    }\n"
         "    if (cvec->seq_strength.empty()) {\n"
         "        cvec->seq_strength.assign(LLAMA_MAX_SEQ, 0.0f);\n"
         "        sched_need_reserve = true; // the graph gains the strength input: no reuse of the old one\n"
         "    }\n"
         "    cvec->seq_strength[seq_id] = strength; // input data only: the graph is reused\n"
         "    return true;\n"
         "}\n\n"
         "void llama_context::clear_adapter_cvec_seq() {\n"
         "    if (!cvec->seq_strength.empty()) {\n"
         "        cvec->seq_strength.clear();\n"
         "        sched_need_reserve = true;\n"
         "    }\n"
         "}\n\n"
         "void llama_context::set_eval_callback(ggml_backend_sched_eval_callback cb, void * user_data) {\n"
         "    synchronize();\n"
         "    cparams.cb_eval           = cb;\n"
         "    cparams.cb_eval_user_data = user_data;\n"
         "    // a reused graph keeps the scheduler's callback: set it there too\n"
         "    ggml_backend_sched_set_eval_callback(sched.get(), cb, user_data);\n"
         "}\n\n",
         "before", "the context methods' bodies"),
    Hook("src/llama-context.cpp",
         "//\n// memory\n//\n",
         f"// {MARK}\n"
         "int32_t llama_set_adapter_cvec_seq(llama_context * ctx, llama_seq_id seq_id, float strength) {\n"
         "    return ctx->set_adapter_cvec_seq(seq_id, strength) ? 0 : -1;\n"
         "}\n\n"
         "void llama_clear_adapter_cvec_seq(llama_context * ctx) {\n"
         "    ctx->clear_adapter_cvec_seq();\n"
         "}\n\n"
         "void llama_set_eval_callback(llama_context * ctx, ggml_backend_sched_eval_callback cb, void * user_data) {\n"
         "    ctx->set_eval_callback(cb, user_data);\n"
         "}\n\n",
         "before", "the C functions"),
]


PATCH = PatchSet("activations patch", MARK, tuple(HOOKS), HERE)
plan, apply = PATCH.plan, PATCH.apply
__all__ = ["HOOKS", "PATCH", "PatchError", "apply", "plan"]

if __name__ == "__main__":
    sys.exit(PATCH.main(sys.argv[1:], __doc__))
