#!/usr/bin/env python3
"""Apply the clickpaca turboquant patch set to a COPY of a llama.cpp source tree.

    python3 native/turboquant/apply.py <llama.cpp-source-dir>

Adds the KV-cache types GGML_TYPE_TURBO2/3/4 ("turbo2", "turbo3", "turbo4"): TurboQuant-mse,
Lloyd-Max codebooks on Hadamard-rotated blocks of 128 values (see clickpaca/llama/turboquant.py,
the numpy reference, and docs/KV-RESEARCH.md, where they are measured).

What it does:
* copies the self-contained sources next to ggml's own (ggml/src/ggml-turbo.{h,c},
  ggml-turbo-tables.h, ggml/src/ggml-cpu/ggml-turbo-cpu.{h,c});
* makes small edits ("hooks") at exact anchors: the type enum, the type-traits tables,
  ggml_quantize_chunk, ggml_validate_row_data, the two CMake source lists, flash attention's
  tiled CPU path (so prompt processing with turbo K/V uses the GEMM path, dequantizing tiles
  like it converts F16 ones), and the cache type names accepted by common/arg.cpp (-ctk/-ctv)
  and llama-bench.

Every anchor must match exactly once. If one is missing or ambiguous (another llama.cpp
version, or a tree that was already patched) nothing at all is written and the script exits
with status 1 and a message naming the file and anchor (native/patchset.py, shared with the
other patch sets). Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from patchset import Hook, PatchError, PatchSet  # noqa: E402  (native/patchset.py)

MARK = "clickpaca turboquant"

# (file in this directory, destination in the llama.cpp tree)
NEW_FILES = [
    ("ggml-turbo.h", "ggml/src/ggml-turbo.h"),
    ("ggml-turbo.c", "ggml/src/ggml-turbo.c"),
    ("ggml-turbo-tables.h", "ggml/src/ggml-turbo-tables.h"),
    ("ggml-turbo-cpu.h", "ggml/src/ggml-cpu/ggml-turbo-cpu.h"),
    ("ggml-turbo-cpu.c", "ggml/src/ggml-cpu/ggml-turbo-cpu.c"),
]


HOOKS = [
    Hook("ggml/include/ggml.h",
         "        GGML_TYPE_COUNT   = 43,\n",
         f"        GGML_TYPE_TURBO2  = 43, // {MARK}: 2-bit Lloyd-Max, 128 values per block\n"
         "        GGML_TYPE_TURBO3  = 44,\n"
         "        GGML_TYPE_TURBO4  = 45,\n"
         "        GGML_TYPE_COUNT   = 46,\n",
         "replace", "new type ids after the existing ones"),
    Hook("ggml/src/ggml.c",
         '#include "ggml-quants.h"\n',
         f'#include "ggml-turbo.h" // {MARK}\n',
         "after", "declarations for the type traits"),
    Hook("ggml/src/ggml.c",
         "};\n\nconst struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type) {",
         f"    GGML_TURBO_TYPE_TRAITS // {MARK}\n",
         "before", "type traits: name, block size, type size, to_float, from_float_ref"),
    Hook("ggml/src/ggml.c",
         "        case GGML_TYPE_IQ4_XS:  result = quantize_iq4_xs (src + start, (char *) dst + start_row * row_size, nrows, n_per_row, imatrix); break;\n",
         f"        GGML_TURBO_QUANTIZE_CASES // {MARK}\n",
         "after", "ggml_quantize_chunk"),
    Hook("ggml/src/ggml-quants.c",
         '#include "ggml-quants.h"\n',
         f'#include "ggml-turbo.h" // {MARK}\n',
         "after", "declarations for row validation"),
    Hook("ggml/src/ggml-quants.c",
         "        case GGML_TYPE_Q1_0:\n            {\n                VALIDATE_ROW_DATA_D_F16_IMPL(block_q1_0, data, nb);",
         f"        GGML_TURBO_VALIDATE_CASES // {MARK}\n",
         "before", "ggml_validate_row_data"),
    Hook("ggml/src/CMakeLists.txt",
         "            ggml-quants.c\n            ggml-quants.h\n",
         f"            ggml-turbo.c # {MARK}\n            ggml-turbo.h\n            ggml-turbo-tables.h\n",
         "after", "ggml-base sources"),
    Hook("ggml/src/ggml-cpu/CMakeLists.txt",
         "        ggml-cpu/quants.c\n        ggml-cpu/quants.h\n",
         f"        ggml-cpu/ggml-turbo-cpu.c # {MARK}\n        ggml-cpu/ggml-turbo-cpu.h\n",
         "after", "ggml-cpu sources"),
    Hook("ggml/src/ggml-cpu/ggml-cpu.c",
         '#include "quants.h"\n',
         f'#include "ggml-turbo-cpu.h" // {MARK}\n',
         "after", "declarations for the CPU traits"),
    Hook("ggml/src/ggml-cpu/ggml-cpu.c",
         "static const struct ggml_type_traits_cpu type_traits_cpu[GGML_TYPE_COUNT] = {\n",
         f"    GGML_TURBO_TYPE_TRAITS_CPU // {MARK}\n",
         "after", "CPU traits: from_float, vec_dot against F32"),
    Hook("ggml/src/ggml-cpu/ops.cpp",
         '#include "vec.h"\n',
         f'#include "ggml-turbo-cpu.h" // {MARK}\n',
         "after", "declarations for flash attention's tiled path"),
    Hook("ggml/src/ggml-cpu/ops.cpp",
         "    GGML_ASSERT(k->type == v->type);\n    const ggml_type kv_type = k->type;\n",
         f"    GGML_ASSERT(k->type == v->type || ggml_turbo_fa_tiled(k->type, v->type)); // {MARK}\n",
         "replace", "tiled flash attention: K and V types may differ when one is a turbo type"),
    Hook("ggml/src/ggml-cpu/ops.cpp",
         "                if (kv_type == GGML_TYPE_F16) {\n"
         "                    const ggml_fp16_t * k_f16 = (const ggml_fp16_t *)k_data;\n",
         f"                if (k->type != GGML_TYPE_F16 && k->type != GGML_TYPE_F32) {{ // {MARK}: quantized K row -> F32\n"
         "                    GGML_ASSERT(DK <= Q_TILE_SZ * KV_TILE_SZ);\n"
         "                    ggml_get_type_traits(k->type)->to_float(k_data, KQ, DK); // KQ is scratch until it is zeroed below\n"
         "                    for (int64_t dk = 0; dk < DK; dk++) {\n"
         "                        K_f32[dk * KV_TILE_SZ + tk] = KQ[dk];\n"
         "                    }\n"
         "                } else if (k->type == GGML_TYPE_F16) {\n"
         "                    const ggml_fp16_t * k_f16 = (const ggml_fp16_t *)k_data;\n",
         "replace", "tiled flash attention: K tile from a turbo type"),
    Hook("ggml/src/ggml-cpu/ops.cpp",
         "                if (kv_type == GGML_TYPE_F16) {\n"
         "                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)v_data, V32 + tk * DV, DV);\n",
         f"                if (v->type != GGML_TYPE_F16 && v->type != GGML_TYPE_F32) {{ // {MARK}: quantized V row -> F32\n"
         "                    ggml_get_type_traits(v->type)->to_float(v_data, V32 + tk * DV, DV);\n"
         "                } else if (v->type == GGML_TYPE_F16) {\n"
         "                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)v_data, V32 + tk * DV, DV);\n",
         "replace", "tiled flash attention: V tile from a turbo type"),
    Hook("ggml/src/ggml-cpu/ops.cpp",
         "                                kv_is_f32_or_f16 &&\n"
         "                                k->type == v->type &&\n",
         "                                ((kv_is_f32_or_f16 && k->type == v->type) ||\n"
         f"                                 ggml_turbo_fa_tiled(k->type, v->type)) && // {MARK}\n",
         "replace", "flash attention takes the tiled (GEMM) path for turbo K/V in prompt processing"),
    Hook("common/arg.cpp",
         "    GGML_TYPE_Q5_1,\n};\n",
         f"    GGML_TYPE_Q5_1,\n    GGML_TYPE_TURBO2, // {MARK}\n    GGML_TYPE_TURBO3,\n    GGML_TYPE_TURBO4,\n}};\n",
         "replace", "-ctk / -ctv names in the common argument parser"),
    Hook("tools/llama-bench/llama-bench.cpp",
         '    if (s == "iq4_nl") {\n        return GGML_TYPE_IQ4_NL;\n    }\n',
         f'    if (s == "turbo2") {{ // {MARK}\n        return GGML_TYPE_TURBO2;\n    }}\n'
         '    if (s == "turbo3") {\n        return GGML_TYPE_TURBO3;\n    }\n'
         '    if (s == "turbo4") {\n        return GGML_TYPE_TURBO4;\n    }\n',
         "after", "-ctk / -ctv names in llama-bench"),
]


PATCH = PatchSet("turboquant patch set", MARK, tuple(HOOKS), HERE, tuple(NEW_FILES),
                 requires=("include/llama.h", "ggml/include/ggml.h"))
plan, apply = PATCH.plan, PATCH.apply
__all__ = ["HOOKS", "NEW_FILES", "PATCH", "PatchError", "apply", "plan"]

if __name__ == "__main__":
    sys.exit(PATCH.main(sys.argv[1:], __doc__))
