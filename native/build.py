#!/usr/bin/env python3
"""Build llama.cpp (a flavor of it) into a cache outside the checkout.

Why a script and not only CMake: the source comes from a package registry (the
llama-cpp-python sdist vendors llama.cpp), must be verified against a pinned sha256,
may be patched (the patched flavor: the turboquant, activations and kvcenter patch sets in
one build, loaded by any of those names), and a finished build is reused
whenever the same source, preset, patches and recipe are asked for again. CMake does the
compiling through the top-level CMakeLists.txt and CMakePresets.json.

    python3 native/build.py mainline [--preset linux-cpu]
    python3 native/build.py patched        # also: turboquant, activations, kvcenter (the same build)
    python3 native/build.py compat --sdist-version 0.3.16 [--tools]
    python3 native/build.py turboquant --cpu-isa sse42   # the CPU backend for SSE4.2, keyed apart
    CUDA_ARCH=90 python3 native/build.py mainline --preset linux-cuda --only-tools ""   # GPU, library only

Result: builds/<name> in the checkout for each of the flavor's names (BUILD_NAMES), links to
$CLICKPACA_CACHE/builds/<flavor>-<preset>-<key>/ holding lib/, bin/, include/ and
build-info.json. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
sys.path.insert(0, str(NATIVE))
import cudakit as cuda  # noqa: E402  (native/cudakit.py: a CUDA preset's toolkit, architecture and options)
# Bump when the way a build is made changes in a way the key would not otherwise see.
RECIPE_VERSION = "2"
TOOLS = [
    "llama-bench",
    "llama-batched-bench",
    "llama-perplexity",
    "llama-completion",
    "llama-tokenize",
    "ggml-rpc-server",  # the RPC backend's worker (GGML_RPC=ON in every preset)
]
# Names a tool is also reachable by in bin/: older trees and llama.cpp's docs say rpc-server.
TOOL_ALIASES = {"ggml-rpc-server": "rpc-server"}
HEADER_DIRS = ["include", "ggml/include"]
# The flavors of the pinned source and the patch sets each applies, in order: native/<set>/,
# applied by its apply.py. mainline is upstream's, the oracle the others are compared with.
# One patched flavor holds all of our patch sets (turboquant touches ggml's files, the other
# two llama's at distinct anchors, and each is inert unless asked for), so a cold set-up compiles llama.cpp twice,
# not three times (issue #37).
PATCH_SETS = {"mainline": (), "patched": ("turboquant", "activations", "kvcenter")}
# The names a flavor's build is loaded by (builds/<name>, init's `build`): the patched
# build answers to the name of each patch set it holds.
BUILD_NAMES = {"mainline": ("mainline",), "patched": ("patched", "turboquant", "activations", "kvcenter")}
FLAVOR_OF = {name: flavor for flavor, names in BUILD_NAMES.items() for name in names}
# The applier every patch set imports (native/patchset.py): in every patched flavor's key.
SHARED_PATCH_FILES = [NATIVE / "patchset.py"]
# Bump when the compat recipe changes (compat keys only; the PATCH_SETS flavors' keys ignore it).
COMPAT_RECIPE = "2"
# ggml's AMX extra buffer type dies with SIGILL (tileloadd) on the pinned source on
# Sapphire Rapids class CPUs (issue #23, docs/DETERMINISM.md): compiled out unless AMX=1.
NO_AMX_FLAGS = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
# Instruction-set macros a compiler predefines for its target: what a native build uses.
# A GGML_BACKEND_DL build (PORTABLE=1) has no CPU code in libggml: ggml loads one
# libggml-<backend>[-<variant>].so per backend at run time, from the directory it is given
# (clickpaca: lib/) or else the executable's (the tools: bin/). libggml-base is not one.
BACKEND_MODULE = re.compile(r"^libggml-(?!base\b)[\w.-]+\.so$")
CPU_VARIANT = re.compile(r"^libggml-cpu-([\w.]+)\.so$")
# ggml's CMakeLists.txt declares each CPU variant as `ggml_add_cpu_backend_variant(name FEATURE ...)`.
VARIANT_DECL = re.compile(r"\bggml_add_cpu_backend_variant\(\s*([\w.]+)([^)]*)\)")
ISA_MACRO = re.compile(
    r"#define (__(?:SSE\w*|SSSE3|AVX\w*|AMX\w*|F16C|FMA4?|BMI2?|POPCNT|LZCNT|MOVBE|PCLMUL|AES"
    r"|SHA|GFNI|VAES|VPCLMULQDQ|ARM_NEON|ARM_FEATURE_\w+)__)\b")


class BuildError(RuntimeError):
    """A build step failed in a way the user can act on; the message says how."""


def log(msg: str) -> None:
    print(f"[native] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("CLICKPACA_CACHE", Path.home() / ".cache" / "clickpaca"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_lock(path: Path = NATIVE / "llama-cpp.lock") -> dict[str, str]:
    """Parse the `key = value` pin file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


# ---------------------------------------------------------------- source


def fetch_sdist(package: str, version: str, sdist: str, sha256: str | None) -> Path:
    """Download the sdist through pip (the registry) unless cached; verify sha256."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    target = downloads / sdist
    if not target.exists() and offline_module().active():  # make setup BUNDLE=dir: no network
        try:
            offline_module().from_bundle(sdist, downloads)
        except offline_module().BundleError as e:
            raise BuildError(str(e)) from None
        log(f"{sdist}: taken from the bundle {offline_module().active()}")
    if not target.exists():
        log(f"downloading {package}=={version} (sdist) from the package registry ...")
        with_tmp = downloads / f".tmp-{os.getpid()}"
        with_tmp.mkdir(exist_ok=True)
        # --no-build-isolation avoids installing the sdist's build backend just to read
        # its metadata; the metadata step still runs but is quick.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", f"{package}=={version}", "-d", str(with_tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = list(with_tmp.glob("*.tar.gz"))
        if not got:
            # Retry with build isolation: some pip versions need the backend to prepare metadata.
            cmd.remove("--no-build-isolation")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = list(with_tmp.glob("*.tar.gz"))
        if not got:
            raise BuildError(f"pip could not download {package}=={version}:\n{proc.stderr[-2000:]}")
        got[0].rename(target)
        shutil.rmtree(with_tmp, ignore_errors=True)
    actual = sha256_file(target)
    if sha256 and actual != sha256:
        raise BuildError(
            f"{target} has sha256 {actual}, but native/llama-cpp.lock pins {sha256}. "
            "Delete the file to download it again; if the registry serves different bytes "
            "for the same version, do not build from it.")
    return target


def extract_sdist(archive: Path, subdir: str) -> Path:
    """Extract once into the cache; a marker file says the extraction finished."""
    stem = archive.name.removesuffix(".tar.gz")
    dest = cache_dir() / "src" / stem
    marker = dest / ".clickpaca-extracted"
    if not marker.exists():
        log(f"extracting {archive.name} ...")
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest.parent, filter="data")
        marker.write_text(archive.name + "\n")
    src = dest / subdir
    if not (src / "include" / "llama.h").exists():
        raise BuildError(f"{archive.name} has no {subdir}/include/llama.h")
    return src


def tree_digest(src: Path) -> str:
    """Identity of a user-supplied source tree: its git HEAD and diff, else its files."""
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "-C", str(src), "diff", "HEAD"],
                              capture_output=True, check=True).stdout
        return "git:" + head + ":" + hashlib.sha256(diff).hexdigest()[:16]
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    h = hashlib.sha256()
    for sub in ("include", "src", "ggml", "common", "tools", "CMakeLists.txt", "cmake"):
        base = src / sub
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in files:
            h.update(str(p.relative_to(src)).encode())
            h.update(p.read_bytes())
    return "tree:" + h.hexdigest()


def git_build_info(src: Path) -> tuple[str, int]:
    """Commit and build number of a git checkout; (commit, 0) when the number is unknown."""
    ident = git_identity(src)
    return ident["commit"], ident["build_number"]


def _git(src: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def git_identity(src: Path, pins: dict[str, str] | None = None) -> dict:
    """Commit and upstream build number of a llama.cpp tree with git metadata.

    The sdist keeps the vendored tree's git module (`.git/modules/vendor/llama.cpp`, a
    shallow clone), so the commit is exact. The build number is upstream's commit count,
    which a shallow clone cannot count: it comes from a `bNNNN` release tag at HEAD when
    the clone has one, else from a pin in native/llama-cpp.lock (`build_number.<commit>`),
    else from `git rev-list --count` of a full clone; otherwise 0 ("unknown").
    """
    try:
        commit = _git(src, "rev-parse", "--short=9", "HEAD")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": "unknown", "build_number": 0, "build_number_from": "unknown"}
    tags = _git(src, "tag", "--points-at", "HEAD").split()
    numbers = [int(t[1:]) for t in tags if t[:1] == "b" and t[1:].isdigit()]
    if numbers:
        return {"commit": commit, "build_number": max(numbers),
                "build_number_from": f"git tag b{max(numbers)}"}
    pin = (pins or {}).get(f"build_number.{commit}")
    if pin:
        return {"commit": commit, "build_number": int(pin),
                "build_number_from": "native/llama-cpp.lock (upstream release tag)"}
    if _git(src, "rev-parse", "--is-shallow-repository") == "false":
        return {"commit": commit, "build_number": int(_git(src, "rev-list", "--count", "HEAD")),
                "build_number_from": "git rev-list --count"}
    return {"commit": commit, "build_number": 0, "build_number_from": "unknown (shallow clone)"}


def resolve_source(flavor: str, sdist_version: str | None) -> dict:
    """Where the source is, and what identifies it (commit, build number, digest)."""
    override = os.environ.get("LLAMA_CPP_SRC")
    if override and flavor != "compat":
        src = Path(override).resolve()
        if not (src / "include" / "llama.h").exists():
            raise BuildError(f"LLAMA_CPP_SRC={override} is not a llama.cpp tree (no include/llama.h)")
        commit, number = git_build_info(src)
        return {"src": src, "origin": f"LLAMA_CPP_SRC={src}", "commit": commit,
                "build_number": number, "digest": tree_digest(src)}
    lock = read_lock()
    if flavor == "compat":
        version = sdist_version or "0.3.16"
        sdist = f"llama_cpp_python-{version}.tar.gz"
        archive = fetch_sdist(lock["package"], version, sdist, lock.get(f"sha256.{version}"))
        digest = sha256_file(archive)
        src = extract_sdist(archive, lock["subdir"])
        ident = git_identity(src, lock)
        return {"src": src, "origin": f"{lock['package']}=={version} sdist sha256 {digest}",
                "commit": ident["commit"], "build_number": ident["build_number"],
                "build_number_from": ident["build_number_from"], "digest": "sdist:" + digest}
    archive = fetch_sdist(lock["package"], lock["version"], lock["sdist"], lock["sha256"])
    src = extract_sdist(archive, lock["subdir"])
    return {"src": src, "origin": f"{lock['package']}=={lock['version']} sdist sha256 {lock['sha256']}",
            "commit": lock["commit"], "build_number": int(lock["build_number"]),
            "digest": "sdist:" + lock["sha256"]}


# ---------------------------------------------------------------- patches


def patch_files(flavor: str) -> list[Path]:
    """What a flavor's patches are made of, all of it in the build's key: the shared
    applier and every file of its patch sets (PATCH_SETS); [] for an unpatched flavor."""
    sets = PATCH_SETS.get(flavor, ())
    files = list(SHARED_PATCH_FILES) if sets else []
    for name in sets:
        d = NATIVE / name
        if not (d / "apply.py").is_file():
            raise BuildError(f"native/{name}/ holds no patch set (no apply.py)")
        files += sorted(p for p in d.rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    return files


def patches_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(NATIVE)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def apply_patch_set(flavor: str, src: Path, digest: str) -> Path:
    """Copy the source and apply the flavor's patch sets (native/<set>/apply.py, in
    PATCH_SETS order) to the copy, once."""
    dest = cache_dir() / "src" / f"{flavor}-{digest[:16]}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}"
    marker = dest / ".clickpaca-patched"
    if marker.exists():
        return dest
    log(f"applying the {flavor} patch set to a copy of {src} ...")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, symlinks=True)
    for name in PATCH_SETS[flavor]:
        applier = NATIVE / name / "apply.py"
        proc = subprocess.run([sys.executable, str(applier), str(dest)], capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)
            raise BuildError(f"the {name} patch set does not apply to {src}:\n"
                             f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    marker.write_text(digest + "\n")
    return dest


# ---------------------------------------------------------------- build


def preset_digest(preset: str) -> str:
    data = json.loads((ROOT / "CMakePresets.json").read_text())
    names = {p["name"] for p in data["configurePresets"] if not p.get("hidden")}
    if preset not in names:
        raise BuildError(f"unknown preset {preset!r}; CMakePresets.json offers {sorted(names)}")
    return hashlib.sha256((ROOT / "CMakePresets.json").read_bytes()
                          + (ROOT / "CMakeLists.txt").read_bytes()).hexdigest()


def run_streamed(cmd: list[str], env: dict, logfile: Path) -> None:
    """Run a step, show ninja's [n/m] progress lines, keep the full log in a file."""
    log("$ " + " ".join(cmd))
    with open(logfile, "a") as lf:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        last = 0.0
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            now = time.monotonic()
            if line.startswith("[") and now - last > 5:
                print("  " + line.rstrip()[:150], file=sys.stderr, flush=True)
                last = now
        if proc.wait() != 0:
            lf.flush()  # the tail below is read back from the file
            tail = logfile.read_text()[-4000:]
            raise BuildError(f"step failed: {' '.join(cmd)}\n--- last lines of {logfile} ---\n{tail}")


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# Older trees name a tool's target differently (rpc-server before ggml-rpc-server).
TARGET_NAMES = {"ggml-rpc-server": ["ggml-rpc-server", "rpc-server"]}


def configured_targets(build_dir: Path) -> set[str]:
    """Every target the configured build defines: what exists under the preset's options
    (an older tree keeps its tools under examples/, which the presets turn off)."""
    out = subprocess.run(["ninja", "-C", str(build_dir), "-t", "targets", "all"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split(":", 1)[0].strip() for line in out.splitlines() if ":" in line}


def tools_in(targets: set[str]) -> dict[str, str]:
    """tool -> the target that builds it in this tree, for the tools the tree defines."""
    found = {}
    for tool in TOOLS:
        name = next((n for n in TARGET_NAMES.get(tool, [tool]) if n in targets), None)
        if name is not None:
            found[tool] = name
    return found


@contextlib.contextmanager
def cache_lock(flavor: str, preset: str = "linux-cpu"):
    """One build of a flavour at a time per cache: two `make setup` runs on one cache wait
    for each other instead of deleting each other's half-built trees. Per flavour, so a
    long compat build does not hold up a turboquant one, and per GPU preset, so an hour-long
    CUDA compile on two cores does not hold up a CPU build (the CPU presets keep the
    flavour's own lock file)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    name = f"{flavor}-{preset}" if cuda.is_cuda_preset(preset) else flavor
    with open(cache_dir() / f".build-{name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another {flavor} build using {cache_dir()} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def preset_native(preset: str) -> bool:
    """Whether a preset compiles for the build machine's CPU (GGML_NATIVE, default ON)."""
    data = json.loads((ROOT / "CMakePresets.json").read_text())
    byname = {p["name"]: p for p in data["configurePresets"]}
    p, value = byname.get(preset), "ON"
    chain = []
    while p is not None:
        chain.append(p)
        p = byname.get(p.get("inherits")) if isinstance(p.get("inherits"), str) else None
    for p in reversed(chain):
        value = p.get("cacheVariables", {}).get("GGML_NATIVE", value)
    return str(value).upper() in ("ON", "1", "TRUE")


def cpu_from_env() -> dict:
    """The CPU choices of `make ... AMX=1 PORTABLE=1 CPU_ISA=...` (all off by default)."""
    return cpu_options(os.environ.get("AMX", "0") == "1", os.environ.get("PORTABLE", "0") == "1",
                       os.environ.get("CPU_ISA") or None)


# ggml's own x86 instruction-set options (GGML_NATIVE=OFF): the compiler flag each adds to
# the CPU backend alone, and the levels --cpu-isa offers (ggml's CPU variants' names).
GGML_X86_ISA = {"SSE42": "-msse4.2", "AVX": "-mavx", "AVX2": "-mavx2", "FMA": "-mfma", "F16C": "-mf16c",
                "BMI2": "-mbmi2", "AVX_VNNI": "-mavxvnni", "AVX512": "-mavx512f"}
CPU_ISA_LEVELS = {"sse42": ["SSE42"], "sandybridge": ["SSE42", "AVX"],
                  "haswell": ["SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"]}


def cpu_options(amx: bool, portable: bool, cpu_isa: str | None = None) -> dict:
    """Compiler flags and CMake options of the CPU choices (AMX=1, PORTABLE=1, CPU_ISA=...).
    `cpu_isa`: the CPU backend (ggml-cpu, the only part -march=native reaches) compiled for
    that instruction set level instead of this CPU's, everything else as in the native
    build: an experiment on the kernels' ISA dependence (issue #27), never the default."""
    if cpu_isa and portable:
        raise BuildError("--cpu-isa and --portable exclude each other (a portable build picks its variant at run time)")
    if cpu_isa and cpu_isa not in CPU_ISA_LEVELS:
        raise BuildError(f"--cpu-isa: {cpu_isa!r} is not one of {', '.join(CPU_ISA_LEVELS)}")
    cflags = [] if amx or not is_x86() else list(NO_AMX_FLAGS)
    cmake = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"] if portable else []
    if cpu_isa:
        on = CPU_ISA_LEVELS[cpu_isa]
        cmake += ["-DGGML_NATIVE=OFF", *(f"-DGGML_{o}={'ON' if o in on else 'OFF'}" for o in GGML_X86_ISA)]
    return {"cflags": cflags, "cmake": cmake, "amx": amx, "portable": portable, "cpu_isa": cpu_isa}


def target_isa(cflags: list[str], native: bool = True) -> list[str]:
    """The instruction-set macros the compiler defines for `-march=native` plus our flags:
    what a native build's code may use. Part of the key, so a cache shared between machines
    never hands a build to a CPU it was not made for; recorded in build-info.json, where
    clickpaca/llama/cpu.py checks it against the running CPU."""
    cc = os.environ.get("CC", "cc")
    cmd = [cc, *(["-march=native"] if native and is_x86() else []), *cflags, "-dM", "-E", "-x", "c", os.devnull]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"could not ask the C compiler which instructions it targets ({' '.join(cmd)}): {e}")
    return sorted({m.group(1) for m in ISA_MACRO.finditer(out)})


def build_key(flavor: str, preset: str, source_digest: str, pdigest: str, extra: list[str],
              compat_stamp: list | None = None, cpu: dict | None = None,
              isa: list[str] | None = None, compat_tools: bool = True,
              tools: list[str] | None = None) -> str:
    """The cache key: everything that decides what a build produces, including the
    instruction sets it was compiled for (`isa`) and the CPU choices (`cpu`). `tools`: the
    native tools built beside the library when not all of TOOLS (--only-tools); a CUDA
    preset's options (architecture, toolkit) come in `extra`."""
    fields = {
        "recipe": RECIPE_VERSION, "flavor": flavor, "preset": preset,
        "presets": preset_digest(preset), "source": source_digest,
        "patches": pdigest, "targets": ["llama", *(TOOLS if tools is None else tools)],
        **({"extra": extra} if extra else {}),
        **({"cpu": {k: cpu[k] for k in ("cflags", "cmake")}} if cpu else {}),
        **({"isa": isa} if isa is not None else {}),
    }
    if compat_stamp is not None:
        # Compat-only recipe, keyed apart from the PATCH_SETS flavors: targets found by
        # configuring, libraries collected wherever the tree puts them, real stamp.
        # Library only unless the tools are asked for (what the serve smoke needs).
        fields.update(targets="configured" if compat_tools else ["llama"],
                      compat_recipe=COMPAT_RECIPE, stamp=compat_stamp)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def build_cpu(preset: str, cpu: dict) -> list[str]:
    """The `isa` of a build with these CPU choices on this machine ([] when portable or
    not native: such a build picks its kernels at run time)."""
    if cpu.get("cpu_isa"):
        return target_isa([*cpu["cflags"], *(GGML_X86_ISA[o] for o in CPU_ISA_LEVELS[cpu["cpu_isa"]])], native=False)
    if cpu["portable"] or not preset_native(preset):
        return []
    return target_isa(cpu["cflags"])


def finished_pinned_build(flavor: str, preset: str, cpu: dict,
                          tools: list[str] | None = None) -> Path | None:
    """A finished build of the pinned source (a PATCH_SETS flavor), found without the lock
    and without writing anything (its key needs only the lock file, the patches and what
    the compiler targets on this machine)."""
    flavor = FLAVOR_OF.get(flavor, flavor)
    if flavor not in PATCH_SETS or os.environ.get("LLAMA_CPP_SRC"):
        return None
    pfiles = patch_files(flavor)
    key = build_key(flavor, preset, "sdist:" + read_lock()["sha256"],
                    patches_digest(pfiles) if pfiles else "", preset_options(preset)[0], cpu=cpu,
                    isa=build_cpu(preset, cpu), tools=tools)
    out = cache_dir() / "builds" / f"{flavor}-{preset}-{key}"
    return out if (out / ".complete").exists() else None


def preset_options(preset: str) -> tuple[list[str], dict]:
    """A preset's own CMake options beyond CMakePresets.json, in the key, and their record:
    for a CUDA preset the toolkit and architecture (native/cudakit.py), none for a CPU one."""
    try:
        return cuda.preset_cmake(preset)
    except cuda.CudaError as e:
        raise BuildError(str(e)) from None


def selected_tools(only: str | None) -> list[str] | None:
    """--only-tools "a,b" -> those of TOOLS ("" -> the library alone); None: all of them."""
    if only is None:
        return None
    names = [t.strip() for t in only.split(",") if t.strip()]
    unknown = [t for t in names if t not in TOOLS]
    if unknown:
        raise BuildError(f"--only-tools: {', '.join(unknown)} not among {', '.join(TOOLS)}")
    return [t for t in TOOLS if t in names]


def link_build(name: str, out: Path) -> None:
    """builds/<name> -> out, replaced atomically: two set-ups linking at once (two `make
    setup` on one checkout) must not meet a link the other has just removed."""
    link = Path(os.environ.get("CLICKPACA_BUILDS", ROOT / "builds")) / name
    link.parent.mkdir(exist_ok=True)
    tmp = link.with_name(f".{name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(out)
    os.replace(tmp, link)
    log(f"builds/{name} -> {out}")


def build(flavor: str, preset: str, sdist_version: str | None, jobs: int,
          cpu: dict | None = None, smoke_model: Path | None = None,
          compat_tools: bool = False, tools: list[str] | None = None) -> Path:
    cpu = cpu or cpu_from_env()
    flavor = FLAVOR_OF.get(flavor, flavor)
    out = finished_pinned_build(flavor, preset, cpu, tools)
    if out is not None:
        log(f"{flavor}: cached build {out}")
        for name in link_names(flavor, sdist_version, cpu):
            link_build(name, out)
        return out
    with cache_lock(flavor, preset):
        return build_locked(flavor, preset, sdist_version, jobs, cpu, smoke_model, compat_tools, tools)


def build_locked(flavor: str, preset: str, sdist_version: str | None, jobs: int,
                 cpu: dict | None = None, smoke_model: Path | None = None,
                 compat_tools: bool = False, only_tools: list[str] | None = None) -> Path:
    """`compat_tools`: a compat build also builds the native tools its tree defines;
    without, it is the library alone (all the bindings and the serve smoke need, and
    about a third less to compile). `only_tools`: a pinned flavor's tools when not all."""
    cpu = cpu or cpu_from_env()
    preset_extra, preset_info = preset_options(preset)  # before any download: no nvcc, one line
    source = resolve_source(flavor, sdist_version)
    src: Path = source["src"]
    extra: list[str] = []
    if flavor == "compat":
        # Older trees: common/ wanted CURL by default. Which tools exist is found after
        # configuring (configured_targets); none is required for the bindings' smoke test.
        extra = ["-DLLAMA_CURL=OFF"]
    extra += preset_extra
    pfiles = patch_files(flavor)
    pdigest = patches_digest(pfiles) if pfiles else ""
    if pfiles:
        src = apply_patch_set(flavor, src, pdigest)
    compat = [source["commit"], source["build_number"]] if flavor == "compat" else None
    isa = build_cpu(preset, cpu)
    key = build_key(flavor, preset, source["digest"], pdigest, extra, compat_stamp=compat,
                    cpu=cpu, isa=isa, compat_tools=compat_tools, tools=only_tools)
    out = cache_dir() / "builds" / f"{flavor}-{preset}-{key}"
    done = out / ".complete"
    if done.exists():
        log(f"{flavor}: cached build {out} (key {key})")
    else:
        t0 = time.monotonic()
        if (out / "cmake" / "build.ninja").exists():
            # An interrupted build of this very key (a CUDA compile on two cores takes hours):
            # ninja goes on where it stopped (an object with no entry in its log is built
            # again); what the last attempt assembled is made anew.
            log(f"{flavor}: resuming the interrupted build in {out} (key {key})")
            for sub in ("lib", "bin", "include"):
                shutil.rmtree(out / sub, ignore_errors=True)
        else:
            log(f"{flavor}: building {src} with preset {preset} into {out} (key {key})")
            shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CLICKPACA_BUILD_DIR=str(out / "cmake"))
        if preset_info:
            link_driver_stub(env, Path(preset_info["root"]), out)
        if cpu["cflags"]:
            for var in ("CFLAGS", "CXXFLAGS"):
                env[var] = " ".join([env.get(var, ""), *cpu["cflags"]]).strip()
        logfile = out / "build.log"
        run_streamed(["cmake", "--preset", preset, f"-DLLAMA_CPP_SRC={src}",
                      f"-DLLAMA_BUILD_NUMBER={source['build_number']}",
                      f"-DLLAMA_BUILD_COMMIT={source['commit']}", *extra, *cpu["cmake"]],
                     env, logfile)
        if flavor == "compat" and not compat_tools:
            tools = {}
            log(f"{flavor}: library only (--tools also builds the native tools the tree defines)")
        elif flavor == "compat":
            tools = tools_in(configured_targets(out / "cmake"))
            log(f"{flavor}: tools this tree defines under preset {preset}: "
                f"{', '.join(tools) or 'none (library only)'}")
        else:
            tools = {t: t for t in (TOOLS if only_tools is None else only_tools)}
        run_streamed(["cmake", "--build", str(out / "cmake"), "-j", str(jobs),
                      "--target", "llama", *tools.values()], env, logfile)
        modules = assemble(out, src, tools, cpu)
        try:
            if preset_info and not cuda.local_archs():
                log(f"{flavor}: smoke test skipped (a {preset} build and no GPU here to run it on)")
            else:
                smoke(out, flavor, smoke_model, jobs, strict=flavor != "compat")
        except BuildError:
            shutil.rmtree(out, ignore_errors=True)  # nothing a later run could take as finished
            raise
        header_sha = sha256_file(out / "include" / "llama.h")
        info = {
            "flavor": flavor, "preset": preset, "key": key,
            "commit": source["commit"], "build_number": source["build_number"],
            **({"build_number_from": source["build_number_from"]}
               if "build_number_from" in source else {}),
            "origin": source["origin"], "source_dir": str(src),
            "tools": sorted(tools),
            "cpu": {"amx": cpu["amx"], "portable": cpu["portable"], "cpu_isa": cpu.get("cpu_isa"),
                    "cflags": cpu["cflags"],
                    "cmake": cpu["cmake"], "isa": isa, "machine": platform.machine(),
                    "built_on": cpu_model_name(), **modules},
            **({"cuda": preset_info} if preset_info else {}),
            "patches": [str(p.relative_to(ROOT)) for p in pfiles], "patches_sha256": pdigest,
            "llama_h_sha256": header_sha,
            "libllama_sha256": sha256_file(out / "lib" / "libllama.so"),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        (out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        done.write_text(key + "\n")
        log(f"{flavor}: built in {info['build_seconds']:.0f} s")
    for name in link_names(flavor, sdist_version, cpu):
        link_build(name, out)
    return out


def link_driver_stub(env: dict, toolkit: Path, out: Path) -> None:
    """Where no NVIDIA driver is installed, the tools' link finds the toolkit's driver
    stub as libcuda.so.1 (cudakit.link_time_driver), through `env` only."""
    stubs = cuda.link_time_driver(toolkit, out / "link-stubs")
    if stubs is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stubs), env.get("LD_LIBRARY_PATH")]))


def link_names(flavor: str, sdist_version: str | None, cpu: dict) -> list[str]:
    """builds/<name> for each name of the build: a compat build by its version, a pinned
    flavor by each of its BUILD_NAMES, a --cpu-isa build by its level (it never replaces
    builds/<name>, which the default commands load)."""
    if flavor == "compat":
        return [f"compat-{sdist_version}"]
    names = BUILD_NAMES.get(flavor, (flavor,))
    return [f"{n}-{cpu['cpu_isa']}" for n in names] if cpu.get("cpu_isa") else list(names)


@functools.lru_cache(maxsize=1)
def offline_module():
    """clickpaca/base/offline.py (standard library only), loaded by path like cpu_module:
    with $CLICKPACA_BUNDLE set the sdist comes from the bundle, never from the network."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("clickpaca_offline", ROOT / "clickpaca" / "base" / "offline.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def cpu_module():
    """clickpaca/llama/cpu.py (standard library only), loaded by path: this script runs before
    any venv exists, and the CPU's name and flags are read in one place."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("clickpaca_cpu", ROOT / "clickpaca" / "llama" / "cpu.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_model_name() -> str:
    return cpu_module().cpu_name()


def smoke(out: Path, flavor: str, model: Path | None, jobs: int, strict: bool = True) -> None:
    """Run the build's own llama-bench on the model before the build counts as finished:
    a 64-token prompt batch (large enough for every extra buffer type: repack, AMX) and a
    one-token decode. A crash is a BuildError of one line naming the signal, the CPU and
    the likely cause; so is any failure when `strict`."""
    bench = out / "bin" / "llama-bench"
    if model is None or not model.exists() or not bench.exists():
        log(f"{flavor}: smoke test skipped ({'no llama-bench' if not bench.exists() else 'no model'})")
        return
    cmd = [str(bench), "-m", str(model), "-p", "64", "-n", "1", "-r", "1", "-t", str(max(1, jobs)), "-o", "csv"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:
        raise BuildError(f"the {flavor} build's smoke test (llama-bench -p 64 -n 1) died with "
                         f"{cpu_module().describe_exit(proc.returncode)}")
    if proc.returncode != 0:
        msg = (f"the {flavor} build's smoke test (llama-bench -p 64 -n 1) exited {proc.returncode}: "
               + (proc.stderr.strip().splitlines() or ["no output"])[-1])
        if strict:
            raise BuildError(msg)
        log(f"{flavor}: {msg} (not a crash; kept)")
        return
    log(f"{flavor}: smoke test passed (llama-bench -p 64 -n 1 on {model.name})")


def shared_libraries(cmake_dir: Path) -> list[Path]:
    """The shared libraries a build produced, wherever the tree puts them: bin/ in newer
    trees, src/ and ggml/src/ (and backend subdirectories) in older ones. One per name,
    bin/ first."""
    found: dict[str, Path] = {}
    for so in sorted((cmake_dir / "bin").glob("*.so*")) + sorted(cmake_dir.rglob("*.so*")):
        if "CMakeFiles" not in so.parts and so.name not in found:
            found[so.name] = so
    return list(found.values())


def cpu_variant_features(src: Path) -> dict[str, list[str]]:
    """ggml's CPU variants (GGML_CPU_ALL_VARIANTS) and the features each is compiled for,
    as the source tree's ggml/src/CMakeLists.txt declares them (every architecture's)."""
    cmake = src / "ggml" / "src" / "CMakeLists.txt"
    text = cmake.read_text(errors="replace") if cmake.exists() else ""
    return {m.group(1): m.group(2).split() for m in VARIANT_DECL.finditer(text)}


def backend_dl(cpu: dict | None) -> bool:
    """Whether the build loads its backends at run time (GGML_BACKEND_DL: PORTABLE=1)."""
    return "-DGGML_BACKEND_DL=ON" in ((cpu or {}).get("cmake") or [])


def arrange_backend_modules(out: Path, src: Path, amx: bool) -> dict:
    """A GGML_BACKEND_DL build's run-time modules: AMX variants left out of lib/ unless
    `amx` (ggml's AMX path dies with SIGILL on the pinned source, #23; the loader then picks
    the best variant left; NO_AMX_FLAGS do not help here: a variant's own -mamx-* come after
    them on its compile line), and each module linked into bin/ as well, where ggml looks for
    them when a tool calls ggml_backend_load_all(). Returns what build-info.json records."""
    declared = cpu_variant_features(src)
    lib = out / "lib"
    variants, left_out = {}, {}
    for so in sorted(lib.iterdir()):
        m = CPU_VARIANT.match(so.name)
        if m is None:
            continue
        feats = declared.get(m.group(1), [])
        if not amx and any(f.startswith("AMX") for f in feats):
            so.unlink()
            left_out[m.group(1)] = "uses AMX (" + " ".join(f for f in feats if f.startswith("AMX")) + "); AMX=1 keeps it"
        else:
            variants[m.group(1)] = feats
    modules = sorted(so.name for so in lib.iterdir() if BACKEND_MODULE.match(so.name))
    if not any(CPU_VARIANT.match(n) or n == "libggml-cpu.so" for n in modules):
        raise BuildError(f"the build loads its backends at run time but produced no CPU backend in {lib}")
    for name in modules:
        os.symlink(Path("..") / "lib" / name, out / "bin" / name)
    return {"backend_modules": modules, "variants": variants, "variants_left_out": left_out}


def assemble(out: Path, src: Path, tools: dict[str, str], cpu: dict | None = None) -> dict:
    """lib/ (shared libraries), bin/ (native tools), include/ (the headers bindgen reads);
    for a build that loads its backends at run time (`cpu` PORTABLE), its modules
    (arrange_backend_modules, whose record is returned; {} otherwise)."""
    cmake_dir = out / "cmake"
    cbin = cmake_dir / "bin"
    (out / "lib").mkdir()
    (out / "bin").mkdir()
    for so in shared_libraries(cmake_dir):
        if so.is_symlink():
            os.symlink(os.readlink(so), out / "lib" / so.name)
        else:
            link_or_copy(so, out / "lib" / so.name)
    for tool, target in tools.items():
        # The linker already gave each tool the run path $ORIGIN/../lib (CMakeLists.txt),
        # so a copy finds the libraries in lib/ with no post-build tool.
        shutil.copy2(cbin / target, out / "bin" / tool)
        for alias in {TOOL_ALIASES.get(tool), target} - {None, tool}:
            os.symlink(tool, out / "bin" / alias)
    for d in HEADER_DIRS:
        for h in (src / d).glob("*.h"):
            (out / "include").mkdir(exist_ok=True)
            shutil.copy2(h, out / "include" / h.name)
    if not (out / "lib" / "libllama.so").exists():
        raise BuildError(f"the build produced no libllama.so under {cmake_dir}")
    return arrange_backend_modules(out, src, bool(cpu["amx"])) if backend_dl(cpu) else {}


def default_smoke_model() -> Path | None:
    """$CLICKPACA_MODEL, else the default model where `make model` assembles it."""
    env = os.environ.get("CLICKPACA_MODEL")
    path = Path(env) if env else cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
    return path if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("flavor", choices=[*FLAVOR_OF, "compat"],
                    help="a flavor, or a name of its build (turboquant, activations: the patched flavor)")
    ap.add_argument("--preset", default=os.environ.get("PRESET", "linux-cpu"))
    ap.add_argument("--sdist-version", help="compat: the llama-cpp-python sdist version")
    ap.add_argument("--tools", action="store_true",
                    help="compat: also the native tools the tree defines (default: the library only)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--amx", action="store_true", default=os.environ.get("AMX", "0") == "1",
                    help="keep ggml's AMX kernels (AMX=1; known to die with SIGILL on the pinned source)")
    ap.add_argument("--portable", action="store_true", default=os.environ.get("PORTABLE", "0") == "1",
                    help="llama.cpp's runtime-dispatched CPU variants instead of -march=native (PORTABLE=1)")
    ap.add_argument("--cpu-isa", default=os.environ.get("CPU_ISA") or None, choices=sorted(CPU_ISA_LEVELS),
                    help="the CPU backend for this instruction set level instead of this CPU's (CPU_ISA=...): "
                         "an experiment, linked as builds/<flavor>-<level>")
    ap.add_argument("--only-tools", default=os.environ.get("ONLY_TOOLS"),
                    help="a pinned flavor: build these native tools (comma-separated; \"\": the library "
                         "alone) instead of all of them; keyed apart")
    ap.add_argument("--smoke-model", type=Path, default=None,
                    help="the GGUF the smoke test runs (default: $CLICKPACA_MODEL, else the default model in the cache)")
    args = ap.parse_args(argv)
    model = args.smoke_model or default_smoke_model()
    try:
        build(args.flavor, args.preset, args.sdist_version, args.jobs,
              cpu_options(args.amx, args.portable, args.cpu_isa), model, compat_tools=args.tools,
              tools=selected_tools(args.only_tools))
    except BuildError as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
