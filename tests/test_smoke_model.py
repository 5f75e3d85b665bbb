"""Choosing the smoke-test model: GGUF metadata, a library's architectures, the wheel's RECORD."""

from __future__ import annotations

import base64
import hashlib
import struct
import zipfile

import pytest

from bindgen import smoke_model as sm
from clickpaca.llama import models


def gguf(path, kvs: list[tuple[str, int, bytes]]) -> None:
    """A GGUF v3 header with the given (key, type, encoded value) pairs and no tensors."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()
    body = b"".join(s(k) + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body)


def test_architecture_is_read_past_other_keys(tmp_path):
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    f = tmp_path / "m.gguf"
    gguf(f, [("general.version", 4, struct.pack("<I", 3)),
             ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + s("a") + s("bc")),
             ("general.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 1, 2, 3)),
             ("general.architecture", 8, s("gemma3"))])
    assert sm.gguf_architecture(f) == "gemma3"
    gguf(f, [("general.name", 8, s("x"))])
    with pytest.raises(sm.SmokeModelError, match="no general.architecture"):
        sm.gguf_architecture(f)
    f.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(sm.SmokeModelError, match="not a GGUF"):
        sm.gguf_architecture(f)


def test_a_library_knows_an_architecture_by_its_string_constant(tmp_path):
    lib = tmp_path / "libllama.so"
    lib.write_bytes(b"\x7fELF\0llama\0gemma3n\0gemma2\0qwen3\0")
    assert sm.knows_architecture(lib, "llama") and sm.knows_architecture(lib, "gemma2")
    assert not sm.knows_architecture(lib, "gemma3")  # gemma3n is another architecture


def test_record_digest_is_decoded(tmp_path):
    data = b"model bytes"
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("pkg/m.gguf", data)
        zf.writestr("pkg-1.dist-info/RECORD", f"pkg/m.gguf,sha256={digest},{len(data)}\npkg-1.dist-info/RECORD,,\n")
    with zipfile.ZipFile(whl) as zf:
        assert models._record_digest(zf, "pkg/m.gguf") == hashlib.sha256(data).hexdigest()
        with pytest.raises(sm.SmokeModelError):
            models._record_digest(zf, "pkg/other")
