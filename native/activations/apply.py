#!/usr/bin/env python3
"""Apply the clickpaca activations patch to a COPY of a llama.cpp source tree.

    python3 native/activations/apply.py <llama.cpp-source-dir>

Three changes for reading and steering activations per sequence:

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

3. Steering slots: each request's own vectors (activations/steering.py). K direction sets
live in the context; after layer il, in build_cvec's place,

    cur = cur + dirs_il [n_embd, K] x s_il [K, n_tokens]

one ggml_mul_mat per steered layer, where s_il is a graph input filled in set_input from
a host table of entries {sequence, slot, positions [from, until), layers, strength,
gated}: a token's strength is the sum of the entries that cover its sequence, position
and layer. Triggers are positions the host resolves, so the table changes per tick and
the graph is reused. A gate (llama_steer_set_gate) opens per token where the residual
after layer il, projected on a slot's direction of that layer, exceeds a threshold:
ggml_mul_mat, a subtraction and ggml_step in the graph, multiplying the gated entries'
strengths; the host never reads the residual. Slot contents, the table and thresholds are
data; K and turning gates on re-reserve the graph (llama_steer_n_reserve counts them).
K = 0: upstream's graph. New C API: llama_steer_set_slots, llama_steer_set_slot,
llama_steer_set_table, llama_steer_set_gate, llama_steer_n_reserve (include/llama.h, each
with its comment). The C fills the inputs and composes ggml's own ops; no kernel of ours.

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
         "            void * user_data);\n\n"
         f"    // {MARK}: steering slots. K direction sets (llama_set_adapter_cvec's buffer each: n_embd\n"
         "    // floats per layer from layer 1); after layer il, cur += dirs_il [n_embd, K] x s [K, n_tokens],\n"
         "    // s from the table: entry e adds strengths[e] to slot ints[7e+1] of the tokens of sequence\n"
         "    // ints[7e] at positions [ints[7e+2], ints[7e+3]), layers [ints[7e+4], ints[7e+5]]; ints[7e+6] != 0:\n"
         "    // gated, counted only where the sequence's gate is open (llama_steer_set_gate). Slot contents,\n"
         "    // the table and gate thresholds are data: the graph is reused. K (set_slots) and turning gates\n"
         "    // on or off re-reserve it; llama_steer_n_reserve counts those. K = 0: upstream's graph.\n"
         "    LLAMA_API int32_t llama_steer_set_slots(struct llama_context * ctx, int32_t n_slots, bool gates);\n"
         "    LLAMA_API int32_t llama_steer_set_slot(struct llama_context * ctx, int32_t slot, const float * data, size_t len, int32_t n_embd);\n"
         "    LLAMA_API int32_t llama_steer_set_table(struct llama_context * ctx, const int32_t * ints, const float * strengths, int32_t n_entries);\n"
         "    // the gate of seq_id: open at a token where the residual after layer il (before that layer's\n"
         "    // steering), projected on slot's direction of layer il, exceeds above; slot -1: no gate\n"
         "    LLAMA_API int32_t llama_steer_set_gate(struct llama_context * ctx, llama_seq_id seq_id, int32_t slot, int32_t il, float above);\n"
         "    LLAMA_API int32_t llama_steer_n_reserve(const struct llama_context * ctx);\n\n",
         "before", "the public API, next to llama_set_adapter_cvec"),
    Hook("src/llama-adapter.h",
         "    ggml_tensor * apply_to(ggml_context * ctx, ggml_tensor * cur, int  il) const;\n",
         f"\n    // {MARK}: cur + dir_il * strength (strength: F32 [1, cur->ne[1]]); cur where no dir\n"
         "    ggml_tensor * apply_to_scaled(ggml_context * ctx, ggml_tensor * cur, int il, ggml_tensor * strength) const;\n\n"
         "    // per sequence strength, LLAMA_MAX_SEQ entries once any is set; empty: upstream's graph\n"
         "    std::vector<float> seq_strength;\n\n"
         "    bool per_seq() const { return !seq_strength.empty(); }\n\n"
         "    // steering slots (llama_steer_*): K == 0: none; steer_gen changes with every allocation\n"
         "    int32_t steer_k = 0;\n"
         "    bool    steer_gates = false;\n"
         "    int32_t steer_gen = 0;\n"
         "    int32_t steer_reserves = 0;\n"
         "    std::vector<ggml_tensor *> steer_dirs;   // per layer, F32 [n_embd, K]: the projections (nullptr at layer 0)\n"
         "    std::vector<ggml_tensor *> steer_dirs_t; // per layer, F32 [K, n_embd]: the steering product\n"
         "    std::vector<float> steer_host;           // [n_layer][K][n_embd]\n"
         "    std::vector<ggml_context_ptr> steer_ctxs;\n"
         "    std::vector<ggml_backend_buffer_ptr> steer_bufs;\n"
         "    std::vector<int32_t> steer_ints;  // 7 per entry (llama_steer_set_table)\n"
         "    std::vector<float>   steer_vals;  // the entry's strength\n"
         "    std::vector<int32_t> gate_slot, gate_il; // per sequence; slot -1: no gate\n"
         "    std::vector<float>   gate_above;\n\n"
         "    bool steer_on() const { return steer_k > 0; }\n"
         "    bool set_steer_slots(const llama_model & model, int32_t k);\n"
         "    bool set_steer_slot(const llama_model & model, int32_t slot, const float * data, size_t len, int32_t n_embd);\n",
         "after", "the per-sequence strengths and the scaled add, beside apply_to; the steering slots"),
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
         "}\n\n"
         "bool llama_adapter_cvec::set_steer_slots(const llama_model & model, int32_t k) {\n"
         "    const auto & hp = model.hparams;\n"
         "    const uint32_t n_layer = hp.n_layer();\n"
         "    const int64_t n_embd = hp.n_embd;\n"
         "    steer_dirs.clear();\n"
         "    steer_dirs_t.clear();\n"
         "    steer_bufs.clear();\n"
         "    steer_ctxs.clear();\n"
         "    steer_host.clear();\n"
         "    steer_k = 0;\n"
         "    steer_gen++;\n"
         "    if (k == 0) {\n"
         "        return true;\n"
         "    }\n"
         "    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_map;\n"
         "    std::vector<ggml_tensor *> dirs(n_layer, nullptr), dirs_t(n_layer, nullptr);\n"
         "    for (uint32_t il = 1; il < n_layer; ++il) {\n"
         "        ggml_backend_buffer_type_t buft = model.select_buft(il);\n"
         "        auto it = ctx_map.find(buft);\n"
         "        if (it == ctx_map.end()) {\n"
         "            ggml_init_params params = { 2*n_layer*ggml_tensor_overhead(), NULL, true };\n"
         "            ggml_context * c = ggml_init(params);\n"
         "            if (!c) {\n"
         "                steer_ctxs.clear();\n"
         "                return false;\n"
         "            }\n"
         "            steer_ctxs.emplace_back(c);\n"
         "            it = ctx_map.emplace(buft, c).first;\n"
         "        }\n"
         "        dirs[il]   = ggml_new_tensor_2d(it->second, GGML_TYPE_F32, n_embd, k);\n"
         "        dirs_t[il] = ggml_new_tensor_2d(it->second, GGML_TYPE_F32, k, n_embd);\n"
         "    }\n"
         "    for (auto & [buft, c] : ctx_map) {\n"
         "        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);\n"
         "        if (!buf) {\n"
         "            LLAMA_LOG_ERROR(\"%s: failed to allocate the steering slots\\n\", __func__);\n"
         "            steer_bufs.clear();\n"
         "            steer_ctxs.clear();\n"
         "            return false;\n"
         "        }\n"
         "        ggml_backend_buffer_clear(buf, 0);\n"
         "        steer_bufs.emplace_back(buf);\n"
         "    }\n"
         "    steer_dirs = std::move(dirs);\n"
         "    steer_dirs_t = std::move(dirs_t);\n"
         "    steer_host.assign((size_t) n_layer * k * n_embd, 0.0f);\n"
         "    steer_k = k;\n"
         "    return true;\n"
         "}\n\n"
         "bool llama_adapter_cvec::set_steer_slot(const llama_model & model, int32_t slot, const float * data, size_t len, int32_t n_embd) {\n"
         "    const uint32_t n_layer = model.hparams.n_layer();\n"
         "    if (slot < 0 || slot >= steer_k || n_embd != (int32_t) model.hparams.n_embd\n"
         "            || (data != nullptr && len != (size_t) (n_layer - 1) * n_embd)) {\n"
         "        return false;\n"
         "    }\n"
         "    const size_t k = steer_k;\n"
         "    std::vector<float> t(k * n_embd);\n"
         "    for (uint32_t il = 1; il < n_layer; ++il) {\n"
         "        float * row = steer_host.data() + ((size_t) il * k + slot) * n_embd;\n"
         "        for (int32_t e = 0; e < n_embd; ++e) {\n"
         "            row[e] = data ? data[(size_t) (il - 1) * n_embd + e] : 0.0f;\n"
         "        }\n"
         "        ggml_backend_tensor_set(steer_dirs[il], row, slot * n_embd * sizeof(float), n_embd * sizeof(float));\n"
         "        const float * layer = steer_host.data() + (size_t) il * k * n_embd;\n"
         "        for (int32_t e = 0; e < n_embd; ++e) {\n"
         "            for (size_t j = 0; j < k; ++j) {\n"
         "                t[(size_t) e * k + j] = layer[j * n_embd + e];\n"
         "            }\n"
         "        }\n"
         "        ggml_backend_tensor_set(steer_dirs_t[il], t.data(), 0, t.size() * sizeof(float));\n"
         "    }\n"
         "    return true;\n"
         "}\n\n",
         "before", "the scaled add; the steering slots' tensors (one pair a layer, on the layer's buffer type)"),
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
         "};\n\n"
         "// the steering slots' strengths from the host table, per token and layer\n"
         "class llm_graph_input_steer : public llm_graph_input_i {\n"
         "public:\n"
         "    llm_graph_input_steer(const llama_adapter_cvec * cvec, uint32_t n_tokens, uint32_t n_outputs, uint32_t n_layer)\n"
         "        : cvec(cvec), n_tokens(n_tokens), n_outputs(n_outputs), n_layer(n_layer),\n"
         "          k(cvec->steer_k), gates(cvec->steer_gates), gen(cvec->steer_gen) {}\n"
         "    virtual ~llm_graph_input_steer() = default;\n\n"
         "    void set_input(const llama_ubatch * ubatch) override;\n\n"
         "    bool can_reuse(const llm_graph_params & params) override;\n\n"
         "    ggml_tensor * su      = nullptr; // F32 [K, n_tokens, n_layer]: ungated strengths\n"
         "    ggml_tensor * sg      = nullptr; // F32 [K, n_tokens, n_layer]: gated strengths (gates only)\n"
         "    ggml_tensor * sel     = nullptr; // F32 [K, n_tokens, n_layer]: 1 at each token's gate (slot, layer)\n"
         "    ggml_tensor * above   = nullptr; // F32 [1, n_tokens]: each token's gate threshold\n"
         "    ggml_tensor * out_ids = nullptr; // I32 [n_outputs]: the output rows (the last layer)\n"
         "    ggml_tensor * proj    = nullptr; // graph state, not an input: the gate projection so far\n\n"
         "    const llama_adapter_cvec * cvec;\n"
         "    const uint32_t n_tokens;\n"
         "    const uint32_t n_outputs;\n"
         "    const uint32_t n_layer;\n"
         "    const int32_t k;\n"
         "    const bool gates;\n"
         "    const int32_t gen;\n"
         "};\n\n",
         "before", "the graph input classes"),
    Hook("src/llama-graph.h",
         "    ggml_tensor * build_cvec(\n             ggml_tensor * cur,\n                     int   il) const;\n",
         f"\n    mutable llm_graph_input_cvec * inp_cvec = nullptr; // {MARK}: built at the first layer that needs it\n"
         "    mutable llm_graph_input_steer * inp_steer = nullptr;\n"
         "    ggml_tensor * build_steer(ggml_tensor * cur, int il) const;\n",
         "after", "one strength input per graph; the steering's"),
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
         "}\n\n"
         "void llm_graph_input_steer::set_input(const llama_ubatch * ubatch) {\n"
         "    const size_t K = k, T = ubatch->n_tokens, plane = K * T;\n"
         "    std::vector<float> u(plane * n_layer, 0.0f), g, s, a;\n"
         "    if (gates) {\n"
         "        g.assign(plane * n_layer, 0.0f);\n"
         "        s.assign(plane * n_layer, 0.0f);\n"
         "        a.assign(T, 0.0f);\n"
         "    }\n"
         "    const auto & ints = cvec->steer_ints;\n"
         "    const auto & vals = cvec->steer_vals;\n"
         "    const size_t n_entries = vals.size();\n"
         "    for (size_t i = 0; i < T; ++i) {\n"
         "        const llama_seq_id seq = ubatch->seq_id[i][0]; // a token shared by sequences takes the first's\n"
         "        const llama_pos pos = ubatch->pos[i];\n"
         "        const bool has_gate = gates && seq >= 0 && (size_t) seq < cvec->gate_slot.size() && cvec->gate_slot[seq] >= 0;\n"
         "        const int32_t gil = has_gate ? cvec->gate_il[seq] : 0;\n"
         "        if (has_gate) {\n"
         "            if (gil >= 1 && (uint32_t) gil < n_layer && cvec->gate_slot[seq] < k) {\n"
         "                s[(size_t) gil * plane + i * K + cvec->gate_slot[seq]] = 1.0f;\n"
         "            }\n"
         "            a[i] = cvec->gate_above[seq];\n"
         "        }\n"
         "        for (size_t e = 0; e < n_entries; ++e) {\n"
         "            const int32_t * r = ints.data() + 7 * e;\n"
         "            if (r[0] != seq || r[1] < 0 || r[1] >= k || pos < r[2] || pos >= r[3]) {\n"
         "                continue;\n"
         "            }\n"
         "            const bool gated = r[6] != 0;\n"
         "            if (gated && !has_gate) {\n"
         "                continue;\n"
         "            }\n"
         "            // a gated entry acts from its gate's layer on: the projection exists from there\n"
         "            const int32_t lo = std::max<int32_t>(std::max<int32_t>(r[4], 1), gated ? gil : 1);\n"
         "            const int32_t hi = std::min<int32_t>(r[5], (int32_t) n_layer - 1);\n"
         "            for (int32_t il = lo; il <= hi; ++il) {\n"
         "                (gated ? g : u)[(size_t) il * plane + i * K + r[1]] += vals[e];\n"
         "            }\n"
         "        }\n"
         "    }\n"
         "    ggml_backend_tensor_set(su, u.data(), 0, u.size() * sizeof(float));\n"
         "    if (sg) {\n"
         "        ggml_backend_tensor_set(sg, g.data(), 0, g.size() * sizeof(float));\n"
         "    }\n"
         "    if (sel) {\n"
         "        ggml_backend_tensor_set(sel, s.data(), 0, s.size() * sizeof(float));\n"
         "    }\n"
         "    if (above) {\n"
         "        ggml_backend_tensor_set(above, a.data(), 0, a.size() * sizeof(float));\n"
         "    }\n"
         "    if (out_ids) { // the output rows in batch order, as llm_graph_input_out_ids lists them\n"
         "        std::vector<int32_t> o;\n"
         "        for (uint32_t i = 0; i < T; ++i) {\n"
         "            if (n_outputs == T || (ubatch->output && ubatch->output[i])) {\n"
         "                o.push_back((int32_t) i);\n"
         "            }\n"
         "        }\n"
         "        o.resize(n_outputs, 0);\n"
         "        ggml_backend_tensor_set(out_ids, o.data(), 0, o.size() * sizeof(int32_t));\n"
         "    }\n"
         "}\n\n"
         "bool llm_graph_input_steer::can_reuse(const llm_graph_params & params) {\n"
         "    return n_tokens == params.ubatch.n_tokens && n_outputs == params.n_outputs && params.cvec == cvec\n"
         "        && k == cvec->steer_k && gates == cvec->steer_gates && gen == cvec->steer_gen;\n"
         "}\n\n"
         "ggml_tensor * llm_graph_context::build_steer(ggml_tensor * cur, int il) const {\n"
         "    if (il < 1 || (size_t) il >= cvec->steer_dirs.size() || cur->ne[1] == 0) {\n"
         "        return cur;\n"
         "    }\n"
         "    const int64_t K = cvec->steer_k;\n"
         "    if (inp_steer == nullptr) {\n"
         "        auto inp = std::make_unique<llm_graph_input_steer>(cvec, n_tokens, n_outputs, n_layer);\n"
         "        inp_steer = inp.get();\n"
         "        res->add_input(std::move(inp));\n"
         "        inp_steer->su = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, K, n_tokens, n_layer);\n"
         "        ggml_set_input(inp_steer->su);\n"
         "        ggml_set_name(inp_steer->su, \"steer_strength\");\n"
         "        if (inp_steer->gates) {\n"
         "            inp_steer->sg = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, K, n_tokens, n_layer);\n"
         "            ggml_set_input(inp_steer->sg);\n"
         "            ggml_set_name(inp_steer->sg, \"steer_strength_gated\");\n"
         "            inp_steer->sel = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, K, n_tokens, n_layer);\n"
         "            ggml_set_input(inp_steer->sel);\n"
         "            ggml_set_name(inp_steer->sel, \"steer_gate_select\");\n"
         "            inp_steer->above = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_tokens);\n"
         "            ggml_set_input(inp_steer->above);\n"
         "            ggml_set_name(inp_steer->above, \"steer_gate_above\");\n"
         "        }\n"
         "    }\n"
         "    llm_graph_input_steer * in = inp_steer;\n"
         "    // all the batch's rows, or (the last layer, after inp_out_ids) its output rows\n"
         "    const bool all_rows = cur->ne[1] == n_tokens;\n"
         "    GGML_ASSERT((all_rows || cur->ne[1] == n_outputs) && \"steer: rows neither the batch nor its outputs\");\n"
         "    if (!all_rows && in->out_ids == nullptr) {\n"
         "        in->out_ids = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_outputs);\n"
         "        ggml_set_input(in->out_ids);\n"
         "        ggml_set_name(in->out_ids, \"steer_out_ids\");\n"
         "    }\n"
         "    auto rows = [&](ggml_tensor * t) { // [X, n_tokens] -> the rows cur has\n"
         "        return all_rows || t->ne[1] != n_tokens ? t : ggml_get_rows(ctx0, t, in->out_ids);\n"
         "    };\n"
         "    auto layer = [&](ggml_tensor * t) { // layer il's [K, n_tokens] plane, in cur's rows\n"
         "        return rows(ggml_view_2d(ctx0, t, K, n_tokens, t->nb[1], il * t->nb[2]));\n"
         "    };\n"
         "    ggml_tensor * s = layer(in->su);\n"
         "    if (in->gates) {\n"
         "        // the projections of this layer's residual on every slot's direction, kept at each\n"
         "        // token's gate (slot, layer) only: summed over the layers, the gate's projection\n"
         "        ggml_tensor * p = ggml_mul_mat(ctx0, cvec->steer_dirs[il], cur); // [K, rows]\n"
         "        p = ggml_sum_rows(ctx0, ggml_mul(ctx0, p, layer(in->sel)));     // [1, rows]\n"
         "        in->proj = in->proj == nullptr ? p : ggml_add(ctx0, rows(in->proj), p);\n"
         "        ggml_format_name(in->proj, \"steer_proj-%d\", il);\n"
         "        ggml_tensor * open = ggml_step(ctx0, ggml_sub(ctx0, in->proj, rows(in->above))); // [1, rows]\n"
         "        ggml_format_name(open, \"steer_gate-%d\", il);\n"
         "        s = ggml_add(ctx0, s, ggml_mul(ctx0, layer(in->sg), open));\n"
         "    }\n"
         "    // one small product: [K, n_embd]^T x [K, rows] = [n_embd, rows]\n"
         "    return ggml_add(ctx0, cur, ggml_mul_mat(ctx0, cvec->steer_dirs_t[il], s));\n"
         "}\n\n",
         "before", "filling the strengths from the micro-batch's sequence ids"),
    Hook("src/llama-graph.cpp",
         "ggml_tensor * llm_graph_context::build_cvec(\n         ggml_tensor * cur,\n                 int   il) const {\n",
         f"    if (cvec->steer_on()) {{ // {MARK}: the slots, then the context's vector below\n"
         "        cur = build_steer(cur, il);\n"
         "    }\n",
         "after", "build_cvec: the steering slots' product, every layer from 1"),
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
         "    void set_eval_callback(ggml_backend_sched_eval_callback cb, void * user_data);\n"
         "    bool steer_set_slots(int32_t n_slots, bool gates);\n"
         "    bool steer_set_slot(int32_t slot, const float * data, size_t len, int32_t n_embd);\n"
         "    bool steer_set_table(const int32_t * ints, const float * strengths, int32_t n_entries);\n"
         "    bool steer_set_gate(llama_seq_id seq_id, int32_t slot, int32_t il, float above);\n"
         "    int32_t steer_n_reserve() const { return cvec->steer_reserves; }\n",
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
         "}\n\n"
         "bool llama_context::steer_set_slots(int32_t n_slots, bool gates) {\n"
         "    if (n_slots < 0 || n_slots > 256) {\n"
         "        return false;\n"
         "    }\n"
         "    gates = gates && n_slots > 0;\n"
         "    if (n_slots == cvec->steer_k && gates == cvec->steer_gates) {\n"
         "        return true; // nothing changes: the graph stays\n"
         "    }\n"
         "    synchronize();\n"
         "    if (n_slots != cvec->steer_k && !cvec->set_steer_slots(model, n_slots)) {\n"
         "        return false;\n"
         "    }\n"
         "    cvec->steer_gates = gates;\n"
         "    if (n_slots > 0 && cvec->gate_slot.empty()) {\n"
         "        cvec->gate_slot.assign(LLAMA_MAX_SEQ, -1);\n"
         "        cvec->gate_il.assign(LLAMA_MAX_SEQ, 0);\n"
         "        cvec->gate_above.assign(LLAMA_MAX_SEQ, 0.0f);\n"
         "    }\n"
         "    sched_need_reserve = true; // the graph gains or loses inputs and nodes\n"
         "    cvec->steer_reserves++;\n"
         "    return true;\n"
         "}\n\n"
         "bool llama_context::steer_set_slot(int32_t slot, const float * data, size_t len, int32_t n_embd) {\n"
         "    synchronize();\n"
         "    return cvec->set_steer_slot(model, slot, data, len, n_embd); // tensor data only\n"
         "}\n\n"
         "bool llama_context::steer_set_table(const int32_t * ints, const float * strengths, int32_t n_entries) {\n"
         "    if (n_entries < 0 || (n_entries > 0 && (ints == nullptr || strengths == nullptr))) {\n"
         "        return false;\n"
         "    }\n"
         "    cvec->steer_ints.assign(ints, ints + 7 * (size_t) n_entries);\n"
         "    cvec->steer_vals.assign(strengths, strengths + n_entries);\n"
         "    return true;\n"
         "}\n\n"
         "bool llama_context::steer_set_gate(llama_seq_id seq_id, int32_t slot, int32_t il, float above) {\n"
         "    if (seq_id < 0 || seq_id >= LLAMA_MAX_SEQ || cvec->gate_slot.empty() || slot >= cvec->steer_k\n"
         "            || (slot >= 0 && (il < 1 || il >= (int32_t) model.hparams.n_layer()))) {\n"
         "        return false;\n"
         "    }\n"
         "    cvec->gate_slot[seq_id] = slot < 0 ? -1 : slot;\n"
         "    cvec->gate_il[seq_id] = il;\n"
         "    cvec->gate_above[seq_id] = above;\n"
         "    return true;\n"
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
         "}\n\n"
         "int32_t llama_steer_set_slots(llama_context * ctx, int32_t n_slots, bool gates) {\n"
         "    return ctx->steer_set_slots(n_slots, gates) ? 0 : -1;\n"
         "}\n\n"
         "int32_t llama_steer_set_slot(llama_context * ctx, int32_t slot, const float * data, size_t len, int32_t n_embd) {\n"
         "    return ctx->steer_set_slot(slot, data, len, n_embd) ? 0 : -1;\n"
         "}\n\n"
         "int32_t llama_steer_set_table(llama_context * ctx, const int32_t * ints, const float * strengths, int32_t n_entries) {\n"
         "    return ctx->steer_set_table(ints, strengths, n_entries) ? 0 : -1;\n"
         "}\n\n"
         "int32_t llama_steer_set_gate(llama_context * ctx, llama_seq_id seq_id, int32_t slot, int32_t il, float above) {\n"
         "    return ctx->steer_set_gate(seq_id, slot, il, above) ? 0 : -1;\n"
         "}\n\n"
         "int32_t llama_steer_n_reserve(const llama_context * ctx) {\n"
         "    return ctx->steer_n_reserve();\n"
         "}\n\n",
         "before", "the C functions"),
]


PATCH = PatchSet("activations patch", MARK, tuple(HOOKS), HERE)
plan, apply = PATCH.plan, PATCH.apply
__all__ = ["HOOKS", "PATCH", "PatchError", "apply", "plan"]

if __name__ == "__main__":
    sys.exit(PATCH.main(sys.argv[1:], __doc__))
