"""The state file format (clickpaca.engine.kvstate): layout, verification, atomic writes.

The parse and write paths are pure Python; they are tested with a stand-in context that
provides only what `kvstate` reads (the model file for its identity, the build, the
cache types and a payload). The tests marked `model` use a real llama.cpp context: a
state saved from one sequence and loaded into another continues bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from clickpaca.engine import kvstate
from clickpaca.engine.kvstate import MAGIC, StateFileError

TOKENS = [2, 651, 6207, 529, 7001, 563]
PAYLOAD = bytes(range(256)) * 40


def fake_ctx(tmp_path, payload: bytes = PAYLOAD, type_k: str = "f16", type_v: str = "f16",
             model_bytes: bytes = b"GGUF" + b"\x01" * 5000, commit: str = "abc1234",
             n_ctx_seq: int = 4096, kv_unified: bool = True, n_seq_max: int = 4,
             k_center: str | None = None):
    model_file = tmp_path / f"model-{hashlib.sha1(model_bytes).hexdigest()[:8]}.gguf"
    model_file.write_bytes(model_bytes)
    model = SimpleNamespace(path=model_file, description="fake 1K F16", n_vocab=1000)
    nat = SimpleNamespace(name="mainline", info={"commit": commit, "build_number": 7000})

    def seq_state_get(slot):
        return payload

    return SimpleNamespace(model=model, nat=nat, type_k=type_k, type_v=type_v, k_center=k_center,
                           n_ctx_seq=n_ctx_seq, seq_state_get=seq_state_get,
                           kv_unified=kv_unified, n_seq_max=n_seq_max)


@pytest.fixture
def saved(tmp_path):
    ctx = fake_ctx(tmp_path)
    path = tmp_path / "s.kv"
    kvstate.save(ctx, 0, TOKENS, path)
    return ctx, path


def split(data: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack("<I", data[8:12])
    return json.loads(data[12:12 + hlen]), data[12 + hlen:]


def build(header, body: bytes, fix_checksum: bool = False) -> bytes:
    if fix_checksum:
        header["sha256"] = hashlib.sha256(body).hexdigest()
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


# ------------------------------------------------------------------ round trip


def test_layout_and_round_trip(saved):
    ctx, path = saved
    data = path.read_bytes()
    assert data[:8] == MAGIC
    header, body = split(data)
    assert header["format_version"] == kvstate.FORMAT_VERSION
    assert header["tokens"] == len(TOKENS) and header["payload_bytes"] == len(PAYLOAD)
    assert header["cache"] == {"type_k": "f16", "type_v": "f16", "k_center": None}
    assert header["streams"] == 1
    assert header["build"] == {"flavor": "mainline", "commit": "abc1234", "build_number": 7000}
    assert header["model"] == kvstate.model_identity(ctx.model)
    assert body == np.asarray(TOKENS, "<i4").tobytes() + PAYLOAD
    assert header["sha256"] == hashlib.sha256(body).hexdigest()
    h, toks, payload = kvstate.read(path)
    assert (h, toks, payload) == (header, TOKENS, PAYLOAD)
    assert all(type(t) is int for t in toks)
    kvstate.check_compatible(ctx, h)  # the writer accepts its own file


def test_save_returns_the_file_size_and_leaves_only_the_file(saved, tmp_path):
    ctx, path = saved
    size = kvstate.save(ctx, 0, TOKENS, path)  # overwrite in place
    assert size == path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".kv") == ["s.kv"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_identity_tells_models_apart(tmp_path):
    a = fake_ctx(tmp_path, model_bytes=b"GGUF" + b"\x01" * 5000)
    b = fake_ctx(tmp_path, model_bytes=b"GGUF" + b"\x02" * 5000)  # same size, other bytes
    ia, ib = kvstate.model_identity(a.model), kvstate.model_identity(b.model)
    assert ia["size"] == ib["size"] and ia["edge_sha256"] != ib["edge_sha256"]
    assert kvstate.model_identity(a.model) is ia  # cached on the model


# ------------------------------------------------------------------ refusals (read)


def refuse(path, match: str | None) -> StateFileError:
    with pytest.raises(StateFileError, match=match) as e:
        kvstate.read(path)
    return e.value


@pytest.mark.parametrize("content", [b"", b"CLK", MAGIC, MAGIC + b"\x00\x00",
                                     b"GGUF" + b"\x00" * 100, b"\x00" * 4096,
                                     os.urandom(1 << 16), b"CLKPKV2\n" + b"\x00" * 64,
                                     "{\"tokens\": 3}\n".encode()])
def test_not_a_state_file(tmp_path, content):
    path = tmp_path / "x.kv"
    path.write_bytes(content)
    refuse(path, "not a clickpaca state file|truncated")


def test_truncated_anywhere(saved):
    _, path = saved
    data = path.read_bytes()
    (hlen,) = struct.unpack("<I", data[8:12])
    body_start = 12 + hlen
    cuts = {0, 7, 8, 11, 12, 13, body_start - 1, body_start, body_start + 3,
            body_start + 4 * len(TOKENS), len(data) - 1}
    for cut in sorted(cuts):
        path.write_bytes(data[:cut])
        refuse(path, "not a clickpaca|truncated|corrupted")


def test_header_length_beyond_the_file(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[:8] + struct.pack("<I", 0xFFFFFFFF) + data[12:])
    refuse(path, "truncated")


def test_trailing_bytes(saved):
    _, path = saved
    path.write_bytes(path.read_bytes() + b"\x00")
    refuse(path, "trailing")


@pytest.mark.parametrize("where", ["token", "payload-first", "payload-middle", "payload-last"])
def test_one_flipped_byte_in_the_body(saved, where):
    _, path = saved
    data = bytearray(path.read_bytes())
    header, body = split(bytes(data))
    start = len(data) - len(body)
    at = {"token": start + 1, "payload-first": start + 4 * len(TOKENS),
          "payload-middle": start + 4 * len(TOKENS) + len(PAYLOAD) // 2,
          "payload-last": len(data) - 1}[where]
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    refuse(path, "checksum")


def test_changed_checksum_field(saved):
    _, path = saved
    header, body = split(path.read_bytes())
    header["sha256"] = "0" * 64
    path.write_bytes(build(header, body))
    refuse(path, "checksum")


@pytest.mark.parametrize("version", [0, 2, 99, "1", None, 1.5])
def test_wrong_format_version(saved, version):
    _, path = saved
    header, body = split(path.read_bytes())
    header["format_version"] = version
    path.write_bytes(build(header, body))
    refuse(path, "format version")


def test_missing_format_version(saved):
    _, path = saved
    header, body = split(path.read_bytes())
    del header["format_version"]
    path.write_bytes(build(header, body))
    refuse(path, "format version")


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"", b"[]", b"3", b'"text"', b"null"])
def test_header_not_a_json_object(saved, raw):
    _, path = saved
    _, body = split(path.read_bytes())
    path.write_bytes(build(raw, body))
    refuse(path, None)


@pytest.mark.parametrize("edit", [
    lambda h: h.pop("tokens"),
    lambda h: h.pop("payload_bytes"),
    lambda h: h.pop("sha256"),
    lambda h: h.pop("model"),
    lambda h: h.pop("build"),
    lambda h: h.pop("cache"),
    lambda h: h.update(tokens="six"),
    lambda h: h.update(tokens=None),
    lambda h: h.update(tokens=6.5),
    lambda h: h.update(payload_bytes=[1]),
    lambda h: h.update(sha256=5),
    lambda h: h.update(model="gemma"),
    lambda h: h.update(build=None),
    lambda h: h.update(cache={"type_k": "f16"}),
], ids=["no-tokens", "no-payload_bytes", "no-sha256", "no-model", "no-build", "no-cache",
        "tokens-str", "tokens-null", "tokens-float", "payload-list", "sha-int", "model-str",
        "build-null", "cache-partial"])
def test_malformed_header_fields_raise_state_file_error(saved, tmp_path, edit):
    """Whatever is wrong with the header, the caller gets StateFileError, not a KeyError."""
    ctx, path = saved
    header, body = split(path.read_bytes())
    edit(header)
    path.write_bytes(build(header, body))
    with pytest.raises(StateFileError):
        h, _, _ = kvstate.read(path)
        kvstate.check_compatible(ctx, h)


def test_negative_counts_are_refused(saved):
    """tokens -1 with payload_bytes grown to match the body: still not a state."""
    _, path = saved
    header, body = split(path.read_bytes())
    header["tokens"], header["payload_bytes"] = -1, len(body) + 4
    path.write_bytes(build(header, body, fix_checksum=True))
    refuse(path, None)


def test_zero_tokens_are_refused(tmp_path):
    """A state of no tokens cannot be continued (there is no last token to re-feed)."""
    ctx = fake_ctx(tmp_path)
    path = tmp_path / "empty.kv"
    kvstate.save(ctx, 0, [], path)
    refuse(path, "no tokens")


# ------------------------------------------------------------------ refusals (compatibility)


def test_incompatible_contexts(saved, tmp_path):
    ctx, path = saved
    header, _, _ = kvstate.read(path)
    cases = [
        (fake_ctx(tmp_path, model_bytes=b"GGUF" + b"\x09" * 5000), "another model"),
        (fake_ctx(tmp_path, commit="fffffff"), "made by build"),
        (fake_ctx(tmp_path, type_k="q8_0"), "f16/f16 KV cache; this server uses q8_0/f16"),
        (fake_ctx(tmp_path, type_v="q4_0"), "uses f16/q4_0"),
        (fake_ctx(tmp_path, n_ctx_seq=len(TOKENS)), "more than the context"),
        (fake_ctx(tmp_path, kv_unified=False, n_seq_max=8), "1 stream\\(s\\); this server's has 8"),
        (fake_ctx(tmp_path, k_center="ab" * 32), "under no key center; this server runs with the key center abababababab"),
    ]
    for other, match in cases:
        with pytest.raises(StateFileError, match=match):
            kvstate.check_compatible(other, header)
    kvstate.check_compatible(fake_ctx(tmp_path, n_ctx_seq=len(TOKENS) + 1), header)
    centered = dict(header, cache=dict(header["cache"], k_center="cd" * 32))
    with pytest.raises(StateFileError, match="under the key center cdcdcdcdcdcd; this server runs with no key center"):
        kvstate.check_compatible(fake_ctx(tmp_path), centered)
    kvstate.check_compatible(fake_ctx(tmp_path, k_center="cd" * 32), centered)
    del header["cache"]["k_center"]  # a file from before centering: uncentered
    kvstate.check_compatible(fake_ctx(tmp_path), header)
    del header["streams"]  # a file from before streams were recorded: llama.cpp is the judge
    kvstate.check_compatible(fake_ctx(tmp_path, kv_unified=False, n_seq_max=8), header)


# ------------------------------------------------------------------ atomic writes


def _dir_listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("fail_at", ["fsync", "replace", "interrupt"])
def test_a_failed_write_leaves_no_temp_file_and_the_old_file_intact(saved, tmp_path, monkeypatch,
                                                                     fail_at):
    ctx, path = saved
    before = path.read_bytes()
    if fail_at == "fsync":
        def boom(fd):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(kvstate.os, "fsync", boom)
        exc = OSError
    elif fail_at == "replace":
        def boom(a, b, **dir_fds):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(kvstate.os, "replace", boom)
        exc = OSError
    else:
        def boom(fd):
            raise KeyboardInterrupt
        monkeypatch.setattr(kvstate.os, "fsync", boom)
        exc = KeyboardInterrupt
    other = fake_ctx(tmp_path, payload=b"\x00" * 99)
    listing = _dir_listing(tmp_path)
    with pytest.raises(exc):
        kvstate.save(other, 0, [1, 2, 3], path)
    assert _dir_listing(tmp_path) == listing  # no temp file left behind
    assert path.read_bytes() == before


def test_a_failing_state_read_creates_nothing(tmp_path):
    ctx = fake_ctx(tmp_path)

    def broken(slot):
        raise RuntimeError("llama.cpp failed")
    ctx.seq_state_get = broken
    listing = _dir_listing(tmp_path)
    with pytest.raises(RuntimeError):
        kvstate.save(ctx, 0, TOKENS, tmp_path / "new.kv")
    assert _dir_listing(tmp_path) == listing


def test_save_onto_a_directory_is_refused(tmp_path):
    ctx = fake_ctx(tmp_path)
    (tmp_path / "d").mkdir()
    with pytest.raises(StateFileError, match="directory"):
        kvstate.save(ctx, 0, TOKENS, tmp_path / "d")
    assert _dir_listing(tmp_path / "d") == []


def test_save_creates_missing_directories(tmp_path):
    ctx = fake_ctx(tmp_path)
    target = tmp_path / "a" / "b" / "s.kv"
    kvstate.save(ctx, 0, TOKENS, target)
    assert kvstate.read(target)[1] == TOKENS
    assert _dir_listing(target.parent) == ["s.kv"]


# ------------------------------------------------------------------ a real context


@pytest.fixture(scope="module")
def real_ctx(model):
    from clickpaca.llama.core import Context

    ctx = Context(model, n_ctx=1024, n_batch=64, n_seq_max=2, n_threads=2)
    yield ctx
    ctx.close()


def _decode(ctx, model, tokens, pos0: int, seq: int) -> np.ndarray:
    from clickpaca.llama.core import Batch

    b = Batch(model.nat, 64)
    out = None
    for i in range(0, len(tokens), 64):
        b.clear()
        b.add(tokens[i:i + 64], pos0 + i, seq, output_last=True)
        assert ctx.decode(b) == 0
        out = ctx.logits()[-1].copy()
    return out


@pytest.mark.model
def test_real_state_round_trip_continues_bit_for_bit(real_ctx, model, tmp_path):
    ctx = real_ctx
    ctx.clear()
    toks = model.tokenize("The quick brown fox jumps over the lazy dog. " * 6).tolist()
    _decode(ctx, model, toks, 0, 0)
    path = tmp_path / "real.kv"
    size = kvstate.save(ctx, 0, toks, path)
    header, got, payload = kvstate.read(path)
    assert got == toks and size == path.stat().st_size
    assert header["model"]["description"] == model.description
    assert header["cache"] == {"type_k": "f16", "type_v": "f16", "k_center": None}
    assert header["streams"] == 1
    assert kvstate.load(ctx, 1, path) == toks
    assert ctx.seq_pos_max(1) == len(toks) - 1 and ctx.seq_pos_min(1) == 0
    nxt = model.tokenize(" And then", add_special=False).tolist()
    a = _decode(ctx, model, nxt, len(toks), 0)
    b = _decode(ctx, model, nxt, len(toks), 1)
    assert np.array_equal(a, b)
    ctx.clear()


@pytest.mark.model
def test_real_load_refusals_leave_the_sequence_empty(real_ctx, model, tmp_path):
    ctx = real_ctx
    ctx.clear()
    toks = model.tokenize("Once upon a time there was a state file.").tolist()
    _decode(ctx, model, toks, 0, 0)
    path = tmp_path / "real.kv"
    kvstate.save(ctx, 0, toks, path)
    header, body = split(path.read_bytes())
    # a payload llama.cpp cannot read, with a valid checksum: refused by llama.cpp itself
    body = body[:4 * len(toks)] + b"\xff" * 8 + body[4 * len(toks) + 8:]
    (tmp_path / "forged.kv").write_bytes(build(header, body, fix_checksum=True))
    with pytest.raises(StateFileError):
        kvstate.load(ctx, 1, tmp_path / "forged.kv")
    assert ctx.seq_pos_max(1) == -1
    # a header claiming more tokens than the payload restores
    header, body = split(path.read_bytes())
    body2 = np.asarray(toks + [toks[-1]], "<i4").tobytes() + body[4 * len(toks):]
    header["tokens"] += 1
    (tmp_path / "short.kv").write_bytes(build(header, body2, fix_checksum=True))
    with pytest.raises(StateFileError, match="restored"):
        kvstate.load(ctx, 1, tmp_path / "short.kv")
    assert ctx.seq_pos_max(1) == -1
    assert ctx.seq_pos_max(0) == len(toks) - 1  # the source never moved
    ctx.clear()
