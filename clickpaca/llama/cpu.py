"""Which CPU a build was made for, and whether this CPU can run it.

native/build.py records the instruction-set macros the compiler defined for the build
(`build-info.json` cpu.isa, e.g. `__AVX512F__`); they are part of the cache key, so a
shared cache never hands a build to the wrong CPU. This module is the load-time half: a
build linked from elsewhere (a network home, a copied checkout) whose instructions this
CPU lacks is refused in one line instead of dying with SIGILL on the first prompt.
"""

from __future__ import annotations

import platform
from pathlib import Path

#: Compiler macro -> the /proc/cpuinfo flag of the same instructions (x86). Macros not
#: listed (SSE2, the *_MATH macros, ...) are baseline or carry no flag of their own.
CPUINFO_FLAG = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__SSE4A__": "sse4a", "__POPCNT__": "popcnt", "__AES__": "aes", "__PCLMUL__": "pclmulqdq",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe",
    "__SHA__": "sha_ni", "__GFNI__": "gfni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AVX512VP2INTERSECT__": "avx512_vp2intersect",
    "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8", "__AMX_BF16__": "amx_bf16",
    "__AMX_FP16__": "amx_fp16",
}

#: ggml's CPU-variant feature names (ggml/src/CMakeLists.txt, the GGML_CPU_ALL_VARIANTS
#: list a portable build records in build-info.json) -> the cpuinfo flags each needs.
GGML_VARIANT_FLAGS = {
    "SSE42": {"sse4_2"}, "AVX": {"avx"}, "F16C": {"f16c"}, "FMA": {"fma"}, "AVX2": {"avx2"},
    "BMI2": {"bmi2"}, "AVX_VNNI": {"avx_vnni"},
    "AVX512": {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
    "AVX512_VBMI": {"avx512vbmi"}, "AVX512_VNNI": {"avx512_vnni"}, "AVX512_BF16": {"avx512_bf16"},
    "AMX_TILE": {"amx_tile"}, "AMX_INT8": {"amx_int8"},
}


def variant_flags(variant_features: list[str]) -> set[str]:
    """The cpuinfo flags a portable build's CPU variant was compiled for."""
    return set().union(*(GGML_VARIANT_FLAGS[f] for f in variant_features))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """This CPU's feature flags, or None where the kernel does not list them (macOS)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lacking(isa: list[str], flags: set[str] | None) -> list[str]:
    """The cpuinfo flags a build compiled for `isa` needs and this CPU lacks (sorted);
    [] when the CPU's flags are unknown (nothing to check against)."""
    if flags is None:
        return []
    return sorted({CPUINFO_FLAG[m] for m in isa if m in CPUINFO_FLAG} - flags)


def features(isa: list[str]) -> list[str]:
    """The build's instruction sets by their cpuinfo names, for `ready` (sorted)."""
    return sorted({CPUINFO_FLAG[m] for m in isa if m in CPUINFO_FLAG})


def check_build(name: str, info: dict, flags: set[str] | None = None) -> str | None:
    """None if this CPU can run build `name` (its build-info.json `info`), else the one
    line that says why not and what to run."""
    cpu = info.get("cpu") or {}
    missing = lacking(cpu.get("isa") or [], cpu_flags() if flags is None else flags)
    if not missing:
        return None
    return (f"build {name!r} was compiled for {', '.join(missing)}, which this CPU "
            f"({cpu_name()}) lacks (it was built on {cpu.get('built_on', 'another machine')}); "
            # paths.make_target's rule, spelled out: native/build.py loads this file alone
            f"run `make {name if name in ('mainline', 'turboquant', 'activations') else 'setup'}` here to build "
            "one for this CPU (builds are keyed by instruction set), or PORTABLE=1 for one that "
            "runs on any x86-64")


def signal_name(returncode: int) -> str | None:
    """'SIGILL (illegal instruction)' for a process a signal ended (a negative return code
    from subprocess), else None."""
    import signal

    if returncode >= 0:
        return None
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    return f"{sig.name} ({(signal.strsignal(sig) or sig.name).lower()})"


#: What a native crash most likely means, by signal, and what to do about it.
CRASH_HINTS = {
    "SIGILL": "an instruction this CPU does not run: a build made for another CPU, or ggml's AMX "
              "path on a CPU with AMX (compiled out unless AMX=1); remedy: `make mainline` on this "
              "machine without AMX=1, or PORTABLE=1",
    "SIGSEGV": "a fault in the native code, often an extra buffer type (repack, AMX); remedy: "
               "report it with the log, try AMX=0 or PORTABLE=1",
    "SIGBUS": "a model or state file changed or truncated while mapped; remedy: check the file",
    "SIGKILL": "killed from outside, often the kernel's out-of-memory killer; remedy: a smaller "
               "nCtx/nSeqMax, or see `dmesg`",
}


def describe_exit(returncode: int) -> str:
    """One phrase for how a native process ended: the signal with its likely cause and
    remedy, or the exit status."""
    sig = signal_name(returncode)
    if sig is None:
        return f"exit status {returncode}"
    hint = CRASH_HINTS.get(sig.split(" ")[0])
    return f"{sig} on CPU {cpu_name()!r}" + (f"; likely cause: {hint}" if hint else "")
