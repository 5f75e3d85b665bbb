#!/usr/bin/env python3
"""Apply the clickpaca turboquant patch set to a COPY of a llama.cpp source tree.

    python3 native/turboquant/apply.py <llama.cpp-source-dir>

Adds the KV-cache types GGML_TYPE_TURBO2/3/4 ("turbo2", "turbo3", "turbo4"): TurboQuant-mse,
Lloyd-Max codebooks on Hadamard-rotated blocks of 128 values (see clickpaca/turboquant.py,
the numpy reference, and docs/turboquant-findings.md).

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
with status 1 and a message naming the file and anchor. Standard library only.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "clickpaca turboquant"

# (file in this directory, destination in the llama.cpp tree)
NEW_FILES = [
    ("ggml-turbo.h", "ggml/src/ggml-turbo.h"),
    ("ggml-turbo.c", "ggml/src/ggml-turbo.c"),
    ("ggml-turbo-tables.h", "ggml/src/ggml-turbo-tables.h"),
    ("ggml-turbo-cpu.h", "ggml/src/ggml-cpu/ggml-turbo-cpu.h"),
    ("ggml-turbo-cpu.c", "ggml/src/ggml-cpu/ggml-turbo-cpu.c"),
]


@dataclass(frozen=True)
class Hook:
    path: str
    anchor: str
    text: str
    where: str  # "before" or "after" the anchor, or "replace" it
    why: str


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


class PatchError(RuntimeError):
    pass


def plan(src: Path) -> dict[Path, str]:
    """Compute every edited file's new text in memory; raise PatchError on any problem."""
    if not (src / "include" / "llama.h").is_file() or not (src / "ggml" / "include" / "ggml.h").is_file():
        raise PatchError(f"{src} is not a llama.cpp source tree (no include/llama.h, ggml/include/ggml.h)")
    for _, dest in NEW_FILES:
        if (src / dest).exists():
            raise PatchError(f"{dest} already exists in {src}: already patched, or a newer llama.cpp "
                             "with its own file of that name; refusing to overwrite")
    texts: dict[Path, str] = {}
    for hook in HOOKS:
        path = src / hook.path
        if path not in texts:
            if not path.is_file():
                raise PatchError(f"{hook.path}: file not found ({hook.why})")
            texts[path] = path.read_text()
            if MARK in texts[path]:
                raise PatchError(f"{hook.path} already carries the {MARK} patch")
        text = texts[path]
        count = text.count(hook.anchor)
        if count != 1:
            raise PatchError(
                f"{hook.path}: anchor for '{hook.why}' matches {count} times (need exactly 1). "
                f"This patch set targets llama.cpp b11312 (0c1e57098); anchor was:\n{hook.anchor}")
        if hook.where == "before":
            new = hook.text + hook.anchor
        elif hook.where == "after":
            new = hook.anchor + hook.text
        elif hook.where == "replace":
            new = hook.text
        else:
            raise AssertionError(hook.where)
        texts[path] = text.replace(hook.anchor, new, 1)
    return texts


def apply(src: Path) -> None:
    texts = plan(src)  # nothing is written unless every anchor matched
    for name, dest in NEW_FILES:
        shutil.copyfile(HERE / name, src / dest)
    for path, text in texts.items():
        path.write_text(text)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0]).resolve()
    try:
        apply(src)
    except PatchError as e:
        print(f"turboquant patch set: {e}", file=sys.stderr)
        return 1
    print(f"turboquant patch set applied to {src}: {len(NEW_FILES)} new files, {len(HOOKS)} hooks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
