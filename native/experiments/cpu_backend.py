#!/usr/bin/env python3
"""A throwaway copy of the turboquant build with another CPU backend (libggml-cpu), for
issue #27 item 3: why the turbo types read a different perplexity on another CPU.

Only the CPU backend is compiled for the CPU (-march=native reaches ggml-cpu alone;
libllama and ggml-base carry no instruction-set flags), so swapping that one library
is a two-ISA comparison that changes one thing. Two backends:

    python native/experiments/cpu_backend.py softmax512 OUT
        the build's own ggml-cpu objects, with ggml_vec_soft_max_f32 computing as an
        AVX-512 build's does (softmax512.c: the same float operations in the same order),
        on this AVX2 CPU, which cannot run AVX-512; about a minute (one object, one link)
    python native/experiments/cpu_backend.py objects TREE OUT
        the ggml-cpu objects of TREE, a configured cmake tree of the same source
        (`native/build.py turboquant --cpu-isa sse42` makes one in the build cache),
        compiled here with TREE's own ninja rules (18 objects, not the 161 steps of the
        whole build)

then CLICKPACA_BUILDS=OUT/builds runs any clickpaca command on the copy and
CLICKPACA_BUILDS=OUT/native on the unchanged build, both under the names `turboquant` and
`mainline` (q8_0 and f16 then run on the same library as the turbo types). Nothing in the
build cache or in builds/ is written (in `objects` mode, TREE's object files are).
Standard library only.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LIB = "libggml-cpu.so.0.25.3"
BASE_LIB = "libggml-base.so.0.25.3"
OBJ_DIR = "llama.cpp/ggml/src/CMakeFiles/ggml-cpu.dir/"
VEC = OBJ_DIR + "ggml-cpu/vec.cpp.o"
SIGNATURE = "ggml_float ggml_vec_soft_max_f32(const int n, float * y, const float * x, float max) {"


def ninja_block(ninja: str, output: str) -> tuple[list[str], dict[str, str]]:
    """The inputs and variables of the build statement that makes `output`."""
    m = re.search(rf"^build {re.escape(output)}: \S+ (.*)$((?:\n  .*)*)", ninja, re.M)
    if not m:
        raise SystemExit(f"cpu_backend: no build statement for {output} in build.ninja")
    inputs = m.group(1).split(" | ")[0].split(" || ")[0].split()
    var = dict(line.strip().split(" = ", 1) for line in m.group(2).strip("\n").splitlines() if " = " in line)
    return inputs, var


def softmax512_vec(src: Path) -> str:
    """vec.cpp with ggml_vec_soft_max_f32 replaced by softmax512.c's."""
    text = src.read_text()
    if text.count(SIGNATURE) != 1:
        raise SystemExit(f"cpu_backend: {src} does not define ggml_vec_soft_max_f32 as expected")
    text = text.replace(SIGNATURE, "[[maybe_unused]] static " + SIGNATURE.replace(
        "ggml_vec_soft_max_f32", "clickpaca_avx2_soft_max_f32"))
    return (text + "\n// ---- clickpaca experiment softmax512 ----\n" + (HERE / "softmax512.c").read_text()
            + "\n" + SIGNATURE + "\n    return clickpaca_soft_max_f32_avx512(n, y, x, max);\n}\n")


def isa_of(tree: Path) -> list[str]:
    """The instruction-set macros TREE's ggml-cpu objects were compiled for."""
    _, var = ninja_block((tree / "build.ninja").read_text(), VEC)
    flags = [f for f in shlex.split(var["FLAGS"]) if f.startswith(("-m", "-march"))]
    out = subprocess.run(["cc", *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                         check=True).stdout
    return sorted(set(re.findall(r"#define (__(?:SSE\w*|SSSE3|AVX\w*|F16C|FMA|BMI2?|POPCNT)__)\b", out)))


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("softmax512", "objects") or len(argv) != (2 if argv[0] == "softmax512" else 3):
        print(__doc__, file=sys.stderr)
        return 2
    mode, out = argv[0], Path(argv[-1]).resolve()
    base = (ROOT / "builds" / "turboquant").resolve()
    info = json.loads((base / "build-info.json").read_text())
    if "__AVX2__" not in info["cpu"]["isa"] or "__AVX512F__" in info["cpu"]["isa"]:
        raise SystemExit("cpu_backend: builds/turboquant must be a native AVX2 build without AVX-512")
    tree = base / "cmake" if mode == "softmax512" else Path(argv[1]).resolve()
    ninja = (tree / "build.ninja").read_text()
    objs, lv = ninja_block(ninja, f"bin/{LIB}")
    work = out / "work"
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True)
    if mode == "softmax512":
        (vec_src,), cv = ninja_block(ninja, VEC)
        src = work / "vec.cpp"
        src.write_text(softmax512_vec(Path(vec_src)))
        # the build's own compile command for vec.cpp, on the copy (its includes are absolute)
        subprocess.run(["/usr/bin/c++", *shlex.split(cv["DEFINES"]), *shlex.split(cv["INCLUDES"]),
                        *shlex.split(cv["FLAGS"]), "-o", str(work / "vec.cpp.o"), "-c", str(src)],
                       check=True, cwd=tree)
        objs = [str(work / "vec.cpp.o") if o == VEC else o for o in objs]
        note = ("softmax512: ggml_vec_soft_max_f32 computes as an AVX-512 build's "
                "(native/experiments/softmax512.c); every other object is the build's own")
        isa = info["cpu"]["isa"]
    else:
        subprocess.run(["ninja", "-C", str(tree), *objs], check=True)
        isa = isa_of(tree)
        note = f"CPU backend from the ggml-cpu objects of {tree} ({' '.join(isa)}); the rest is the build's own"
    build = out / "build"
    shutil.copytree(base, build, symlinks=True, ignore=shutil.ignore_patterns("cmake", "build.log"))
    (build / "lib" / LIB).unlink()
    # linked as the build links it, against the unchanged build's ggml-base
    libs = [str(base / "lib" / BASE_LIB) if x.endswith(BASE_LIB) else x
            for x in shlex.split(lv["LINK_LIBRARIES"].replace("\\$$", "$"))]
    subprocess.run(["/usr/bin/c++", "-fPIC", *shlex.split(lv.get("LANGUAGE_COMPILE_FLAGS", "")),
                    *shlex.split(lv.get("ARCH_FLAGS", "")), *shlex.split(lv.get("LINK_FLAGS", "")), "-shared",
                    f"-Wl,-soname,{lv['SONAME']}", "-o", str(build / "lib" / LIB), *objs, *libs],
                   check=True, cwd=tree)
    info["cpu"]["isa"] = isa
    info["experiment"] = note
    info["experiment_of"] = str(base)
    (build / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    for root, target in (("builds", build), ("native", base)):
        (out / root).mkdir()
        for name in ("turboquant", "mainline"):
            (out / root / name).symlink_to(target)
    print(f"cpu_backend: {note}\n  CLICKPACA_BUILDS={out / 'builds'} (this backend), {out / 'native'} (unchanged build)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
