"""Sequence state files: one sequence's KV cache and tokens, safe to keep and reload.

Layout: the 8-byte magic b"CLKPKV1\\n", a little-endian uint32 header length, a JSON
header, the tokens (int32 little-endian), then llama.cpp's own serialized sequence
state. The header names the format version, the model (size, description and a hash
of its first and last MiB), the build (flavor, commit, build number), the cache types,
the token count, the payload size and a sha256 over tokens + payload. Loading checks
every one of these before touching the context, so a file made for another model,
build or cache type, or a truncated or corrupted one, is refused and changes nothing.
Writes go to a temporary file renamed into place, so a crash never leaves half a file;
only regular files are read or replaced, and only a state file is replaced (statedir.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from . import statedir

MAGIC = b"CLKPKV1\n"
FORMAT_VERSION = 1


class StateFileError(ValueError):
    """The file cannot be loaded into this server (the message says why)."""


_HEADER_FIELDS = {"tokens": int, "payload_bytes": int, "sha256": str, "model": dict,
                  "build": dict, "cache": dict}


def model_identity(model) -> dict:
    """Size, description and a hash of the first and last MiB of the model file."""
    cached = getattr(model, "_identity", None)
    if cached:
        return cached
    size = model.path.stat().st_size
    h = hashlib.sha256()
    with open(model.path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    ident = {"size": size, "description": model.description, "n_vocab": model.n_vocab,
             "edge_sha256": h.hexdigest()}
    model._identity = ident
    return ident


def _header(ctx, n_tokens: int, payload_len: int, digest: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "model": model_identity(ctx.model),
        "build": {"flavor": ctx.nat.name, "commit": ctx.nat.info.get("commit"),
                  "build_number": ctx.nat.info.get("build_number")},
        # k_center: the key center's digest (init's kvCenter): the keys stored are k - center
        "cache": {"type_k": ctx.type_k, "type_v": ctx.type_v, "k_center": ctx.k_center},
        "streams": kv_streams(ctx),
        "tokens": n_tokens,
        "payload_bytes": payload_len,
        "sha256": digest,
    }


class Snapshot:
    """One sequence's state taken from the context, not yet hashed or framed.

    Taking it is the only part of a save that needs the context (a copy out of the KV
    cache); `chunks()` hashes and frames it and may run on another thread."""

    def __init__(self, ctx, slot: int, tokens: list[int]) -> None:
        self.payload = ctx.seq_state_get(slot)
        self.toks = np.asarray(tokens, dtype="<i4").tobytes()
        self.n_tokens = len(tokens)
        self._header = _header(ctx, len(tokens), len(self.payload), "")

    def chunks(self) -> list[bytes]:
        """The file's bytes, in chunks: magic, header length, header, tokens, payload."""
        h = hashlib.sha256(self.toks)
        h.update(self.payload)
        header = json.dumps({**self._header, "sha256": h.hexdigest()}).encode()
        return [MAGIC, struct.pack("<I", len(header)), header, self.toks, self.payload]


def encode(ctx, slot: int, tokens: list[int]) -> list[bytes]:
    """The file's bytes, in chunks (Snapshot, then its chunks, on one thread)."""
    return Snapshot(ctx, slot, tokens).chunks()


def refuse_foreign(dir_fd: int, name: str) -> None:
    """Only a clickpaca state file may be replaced by a save."""
    if not statedir.starts_with(dir_fd, name, MAGIC):
        raise StateFileError(f"{name!r} exists and is not a clickpaca state file (not replaced)")


def save(ctx, slot: int, tokens: list[int], path: str | os.PathLike) -> int:
    """Write the sequence's state atomically to a path; return the file size in bytes.

    In-process use (tests, tools): creates missing directories. The server goes
    through statedir.StateDir instead (names, no directories made).
    """
    target = Path(path)
    if target.is_dir():
        raise StateFileError(f"{target} is a directory")
    chunks = encode(ctx, slot, tokens)
    dir_fd = statedir.open_dir(target.parent, create=True)
    try:
        return statedir.write_file(dir_fd, target.name, chunks, str(target), refuse_foreign)
    finally:
        os.close(dir_fd)


def read(path: str | os.PathLike) -> tuple[dict, list[int], bytes]:
    """Parse and verify a state file without touching any context (regular files only)."""
    p = Path(path)
    dir_fd = statedir.open_dir(p.parent)
    try:
        data = statedir.read_file(dir_fd, p.name, str(p))
    finally:
        os.close(dir_fd)
    return decode(data, path)


def decode(data: bytes, path) -> tuple[dict, list[int], bytes]:
    """Parse and verify a state file's bytes; `path` only labels the messages."""
    if len(data) < 12 or data[:8] != MAGIC:
        raise StateFileError(f"{path} is not a clickpaca state file (bad magic)")
    (hlen,) = struct.unpack("<I", data[8:12])
    if 12 + hlen > len(data):
        raise StateFileError(f"{path} is truncated (header)")
    try:
        header = json.loads(data[12:12 + hlen])
    except ValueError:
        raise StateFileError(f"{path} has a corrupted header") from None
    if not isinstance(header, dict):
        raise StateFileError(f"{path} has a corrupted header (not a JSON object)")
    if header.get("format_version") != FORMAT_VERSION:
        raise StateFileError(f"{path} has format version {header.get('format_version')}, "
                             f"this server reads {FORMAT_VERSION}")
    for key, typ in _HEADER_FIELDS.items():
        if type(header.get(key)) is not typ:
            raise StateFileError(f"{path} has a corrupted header ({key!r} missing or not {typ.__name__})")
    if not ({"flavor", "commit", "build_number"} <= header["build"].keys()
            and {"type_k", "type_v"} <= header["cache"].keys()):
        raise StateFileError(f"{path} has a corrupted header (build or cache incomplete)")
    body = data[12 + hlen:]
    n_tok, n_pay = header["tokens"], header["payload_bytes"]
    if n_tok < 1 or n_pay < 0:
        raise StateFileError(f"{path} holds no tokens" if n_tok == 0 else
                             f"{path} has a corrupted header (negative counts)")
    if len(body) != 4 * n_tok + n_pay:
        raise StateFileError(f"{path} is truncated or has trailing bytes "
                             f"({len(body)} body bytes, header says {4 * n_tok + n_pay})")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:  # hashlib releases the GIL
        raise StateFileError(f"{path} is corrupted (checksum mismatch)")
    tokens = np.frombuffer(body[:4 * n_tok], dtype="<i4").astype(int).tolist()
    return header, tokens, body[4 * n_tok:]


def kv_streams(ctx) -> int:
    """KV streams of the context: 1 for one buffer of all sequences, else one per sequence.
    llama.cpp restores a sequence's state only into a cache of as many streams."""
    return 1 if ctx.kv_unified else ctx.n_seq_max


def check_compatible(ctx, header: dict) -> None:
    ident = model_identity(ctx.model)
    if header["model"] != ident:
        raise StateFileError(f"the file was made for another model ({header['model'].get('description')}, "
                             f"{header['model'].get('size')} bytes); loaded: {ident['description']}, "
                             f"{ident['size']} bytes")
    b = header["build"]
    if (b["flavor"], b["commit"], b["build_number"]) != (ctx.nat.name, ctx.nat.info.get("commit"),
                                                         ctx.nat.info.get("build_number")):
        raise StateFileError(f"the file was made by build {b['flavor']} {b['commit']} "
                             f"({b['build_number']}); this server runs {ctx.nat.name} "
                             f"{ctx.nat.info.get('commit')} ({ctx.nat.info.get('build_number')})")
    c = header["cache"]
    if (c["type_k"], c["type_v"]) != (ctx.type_k, ctx.type_v):
        raise StateFileError(f"the file holds a {c['type_k']}/{c['type_v']} KV cache; this server "
                             f"uses {ctx.type_k}/{ctx.type_v}")
    if c.get("k_center") != ctx.k_center:  # (files from before centering: None, uncentered)
        def shown(d: str | None) -> str:
            return f"the key center {d[:12]}" if d else "no key center"
        raise StateFileError(f"the file's keys were stored under {shown(c.get('k_center'))}; this "
                             f"server runs with {shown(ctx.k_center)} (init's kvCenter): its keys "
                             "would be read against the wrong mean")
    if header["tokens"] >= ctx.n_ctx_seq:
        raise StateFileError(f"the file holds {header['tokens']} tokens, more than the context "
                             f"per sequence ({ctx.n_ctx_seq})")
    streams = header.get("streams")  # (files before it was recorded: llama.cpp checks)
    if streams is not None and streams != kv_streams(ctx):
        raise StateFileError(f"the file was saved from a KV cache of {streams} stream(s); this server's "
                             f"has {kv_streams(ctx)} (1 with kvUnified true, else nSeqMax): llama.cpp "
                             "restores a state only into as many streams")


def load(ctx, slot: int, path: str | os.PathLike) -> list[int]:
    """Restore a file into an empty sequence slot; return its tokens."""
    header, tokens, payload = read(path)
    return restore(ctx, slot, header, tokens, payload, path)


def restore(ctx, slot: int, header: dict, tokens: list[int], payload: bytes, path) -> list[int]:
    """Check a decoded file against the context (tokens included), then restore it."""
    check_compatible(ctx, header)
    n_vocab = ctx.model.n_vocab
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise StateFileError(f"{path} holds token {bad}, outside the vocabulary [0, {n_vocab})")
    n = ctx.seq_state_set(slot, payload)
    if n == 0:
        ctx.seq_rm(slot, -1, -1)
        raise StateFileError(f"llama.cpp refused the state in {path} (no room in the KV cache?)")
    if ctx.seq_pos_max(slot) != len(tokens) - 1:
        ctx.seq_rm(slot, -1, -1)
        raise StateFileError(f"{path}: restored {ctx.seq_pos_max(slot) + 1} positions, "
                             f"the header says {len(tokens)}")
    return tokens
