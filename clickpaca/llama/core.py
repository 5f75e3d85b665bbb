"""The thin, Pythonic layer over the generated bindings for the common path: Model (load,
vocabulary, tokenize), Context (decode, logits, sequence memory, sequence state), Batch
(numpy views of a llama_batch).

The engine's decode loop, the server and the benchmarks reach llama.cpp through these
classes. It is not the only door: modules with a narrower need call the bindings
(``model.nat.lib`` / ``.ffi``) themselves where these classes offer nothing for it:
the chat template (chat.py), token attributes for grammars and pretokenized prompts
(grammar/grammars/, pretokenize.py), the optional APIs' checks (features.py), the sliding
window (engine/handlers.py), activations and control vectors (activations/,
engine/readout.py), op dumps (opdump.py), RPC devices (rpc/), and llama.cpp's C
samplers for tests and benchmarks (sampling/oracle.py, measure/bench/sampler_steps.py).

Lifetime rule for logits: `Context.logits()` returns a zero-copy numpy view of
llama.cpp's output buffer. It is valid until the next `decode` on that context (or its
close); copy what must outlive that.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from . import cachetypes, features
from .native import Native, load, log_sink

GGUF_MAGIC = b"GGUF"


class ModelError(ValueError):
    """The model file is missing, not GGUF, or llama.cpp refused it."""


class ContextError(RuntimeError):
    """llama.cpp could not create a context with the given parameters."""


def check_gguf(path: str | os.PathLike) -> Path:
    """Fail with a clear message before C sees a file that cannot be a model."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF model file (magic {magic!r}, expected b'GGUF'): {p}")
    return p


class _Owned:
    """A llama.cpp object we own through ``ptr``: `close` frees it once (with the library
    function named by ``_free``), and garbage collection closes it at the latest."""

    _free: str

    def close(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr != self.nat.ffi.NULL:
            getattr(self.nat.lib, self._free)(self.ptr)
        self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class Model(_Owned):
    """A loaded model and its vocabulary."""

    _free = "llama_model_free"

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 99,
                 build: str = "mainline", nat: Native | None = None, repack: bool = True,
                 devices: Any = None, tensor_split: list[float] | None = None,
                 cpu_tensors: str | None = None) -> None:
        """`repack` False keeps the weights in their file layout (use_extra_bufts off): the
        repacked CPU kernels take a GEMM path for blocks of rows and a GEMV path for the
        rest, so a token's result would depend on how many share its decode.
        `devices`: a NULL-terminated ggml_backend_dev_t array to offload to instead of
        every device the registry has (e.g. RPC workers'); `tensor_split`: the share of
        the offloaded layers per device (llama.cpp normalises it); `cpu_tensors`: a
        regular expression of tensor names whose weights stay in local CPU memory
        wherever their layer goes (llama.cpp's tensor buffer overrides)."""
        self.path = check_gguf(path)
        self.nat = nat or load(build)
        sink = log_sink(self.nat)
        ffi, lib = self.nat.ffi, self.nat.lib
        features.require(self.nat, "vocab-api")  # FeatureMissing naming what it lacks
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if features.available(self.nat, "repack-off"):
            params.use_extra_bufts = repack
        elif not repack:
            features.require(self.nat, "repack-off")
        self.repack = repack  # without the field: llama.cpp repacks wherever it can
        if devices is not None:
            features.require(self.nat, "rpc")
            params.devices = devices
        if tensor_split is not None:
            n = int(lib.llama_max_devices())
            if len(tensor_split) > n:
                raise ModelError(f"tensorSplit: {len(tensor_split)} values, this build takes at most {n}")
            split = ffi.new("float[]", list(tensor_split) + [0.0] * (n - len(tensor_split)))
            params.tensor_split = split  # read during the load only
        if cpu_tensors is not None:
            features.require(self.nat, "output-local")
            overrides = ffi.new("struct llama_model_tensor_buft_override[2]")  # NULL-terminated
            pattern = ffi.new("char[]", cpu_tensors.encode())
            overrides[0].pattern = pattern
            overrides[0].buft = lib.ggml_backend_cpu_buffer_type()
            params.tensor_buft_overrides = overrides  # read during the load only
        # The load's log says where each layer and buffer went (rpc/devices.py reads it).
        sink.captured.clear()
        sink.capture = True
        try:
            self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        finally:
            sink.capture = False
        self.load_log = list(sink.captured)
        sink.captured.clear()
        if self.ptr == ffi.NULL:
            errors = [line.strip() for line in self.load_log if "error" in line.lower()][-3:]
            raise ModelError(f"llama.cpp could not load {self.path}"
                             + (f": {' / '.join(errors)}" if errors else " (see the log on stderr)"))
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.ptr)
        self.n_layer = lib.llama_model_n_layer(self.ptr)
        self.n_embd = lib.llama_model_n_embd(self.ptr)
        self.bos = lib.llama_vocab_bos(self.vocab)
        self.eos = lib.llama_vocab_eos(self.vocab)
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self.vocab))
        buf = ffi.new("char[256]")
        lib.llama_model_desc(self.ptr, buf, 256)
        self.description = ffi.string(buf).decode("utf-8", "replace")
        self.size_bytes = int(lib.llama_model_size(self.ptr))
        self.file_size = self.path.stat().st_size
        self._eog: np.ndarray | None = None
        self._pieces: dict[int, bytes] = {}

    @property
    def piece_cache(self) -> dict[int, bytes]:
        """The pieces `token_to_piece` has cached (with special=True), by token: what the
        server's cache accounting sizes (engine/accounting.py)."""
        return self._pieces

    def is_eog(self, token: int) -> bool:
        return bool(self.nat.lib.llama_vocab_is_eog(self.vocab, token))

    @property
    def eog_tokens(self) -> np.ndarray:
        """Every end-of-generation token id (computed once by asking llama.cpp per token)."""
        if self._eog is None:
            is_eog = self.nat.lib.llama_vocab_is_eog
            self._eog = np.array([t for t in range(self.n_vocab) if is_eog(self.vocab, t)],
                                 dtype=np.int32)
        return self._eog

    # -------------------------------------------------------------- tokens

    def tokenize(self, text: str | bytes, add_special: bool = True,
                 parse_special: bool = True) -> np.ndarray:
        """Token ids (int32). add_special adds BOS when the model wants one."""
        ffi, lib = self.nat.ffi, self.nat.lib
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 8
        out = np.empty(cap, dtype=np.int32)
        n = lib.llama_tokenize(self.vocab, data, len(data), ffi.from_buffer("llama_token[]", out),
                               cap, add_special, parse_special)
        if n < 0:
            cap = -n
            out = np.empty(cap, dtype=np.int32)
            n = lib.llama_tokenize(self.vocab, data, len(data),
                                   ffi.from_buffer("llama_token[]", out), cap, add_special, parse_special)
            if n < 0:
                raise ValueError("tokenization failed")
        return out[:n].copy()

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token (special tokens rendered as their text when special)."""
        if special and token in self._pieces:
            return self._pieces[token]
        ffi, lib = self.nat.ffi, self.nat.lib
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary [0, {self.n_vocab})")
        buf = ffi.new("char[64]")
        n = lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new(f"char[{-n}]")
            n = lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        piece = ffi.buffer(buf, n)[:]
        if special:
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens, special: bool = False) -> str:
        ffi, lib = self.nat.ffi, self.nat.lib
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        cap = max(16, len(toks) * 8)
        for _ in range(2):
            buf = ffi.new(f"char[{cap}]")
            n = lib.llama_detokenize(self.vocab, ffi.from_buffer("llama_token[]", toks), len(toks),
                                     buf, cap, False, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            cap = -n
        raise ValueError("detokenization failed")



# ------------------------------------------------------------------ cache types

def cache_types(nat: Native) -> dict[str, int]:
    """Cache type name -> ggml_type value: the types of the table (cachetypes.py) this
    build has, read from the build's own enum."""
    lib, ffi = nat.lib, nat.ffi
    out = {}
    for t in range(int(lib.GGML_TYPE_COUNT)):
        ptr = lib.ggml_type_name(t)
        if ptr == ffi.NULL:
            continue
        name = ffi.string(ptr).decode()
        if cachetypes.find(name) is not None:
            out[name] = t
    return out


def type_bits_per_value(nat: Native, ggml_type: int) -> float:
    lib = nat.lib
    return 8.0 * lib.ggml_type_size(ggml_type) / lib.ggml_blck_size(ggml_type)


# ------------------------------------------------------------------ batch


class Batch:
    """A llama_batch whose arrays are numpy arrays we own (one sequence id per token).

    Filling goes through numpy slices, so a tick's batch costs microseconds.
    """

    def __init__(self, nat: Native, capacity: int) -> None:
        self.nat = nat
        ffi = nat.ffi
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self._seq_ptrs = ffi.new("llama_seq_id *[]", capacity)
        seq_base = ffi.from_buffer("llama_seq_id[]", self.seq)
        for i in range(capacity):
            self._seq_ptrs[i] = seq_base + i
        self._keep = seq_base
        self.struct = ffi.new("llama_batch *")
        self.struct.token = ffi.from_buffer("llama_token[]", self.token)
        self.struct.embd = ffi.NULL
        self.struct.pos = ffi.from_buffer("llama_pos[]", self.pos)
        self.struct.n_seq_id = ffi.from_buffer("int32_t[]", self.n_seq_id)
        self.struct.seq_id = self._seq_ptrs
        self.struct.logits = ffi.from_buffer("int8_t[]", self.logits)
        self._arrays = (self.struct.token, self.struct.pos, self.struct.n_seq_id, self.struct.logits)
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def add(self, tokens, pos0: int, seq: int, output_last: bool = True,
            output_all: bool = False) -> int:
        """Append tokens of one sequence at positions pos0.. ; return the first row index."""
        k = len(tokens)
        if k > self.free:
            raise ValueError(f"batch full: {k} tokens do not fit in {self.free} free slots")
        i = self.n
        self.token[i:i + k] = tokens
        self.pos[i:i + k] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self.seq[i:i + k] = seq
        self.logits[i:i + k] = 1 if output_all else 0
        if output_last and k:
            self.logits[i + k - 1] = 1
        self.n += k
        return i

    def value(self) -> Any:
        self.struct.n_tokens = self.n
        return self.struct[0]


# ------------------------------------------------------------------ context

# (b6170 and before name the class llama_kv_cache_unified in this log line)
_KV_SIZE_RE = re.compile(r"llama_kv_cache(?:_unified)?: size = +([0-9.]+) MiB")
# How llama.cpp resolved flashAttn "auto" (b11312: "resolve_fused_ops: Flash Attention
# enabled" / "... not supported, set to disabled"; older: "flash_attn = auto -> enabled").
_FA_AUTO_RE = re.compile(r"Flash Attention (enabled|not supported)|flash_attn = auto -> (enabled|disabled)")


def resolved_flash_attn(requested: str, log_lines: list[str]) -> bool | None:
    """Whether flash attention is in force: the request when explicit, else what the
    context's creation log says about "auto" (None: the log did not say)."""
    if requested in ("on", "off"):
        return requested == "on"
    for line in log_lines:
        m = _FA_AUTO_RE.search(line)
        if m:
            return (m.group(1) or m.group(2)) == "enabled"
    return None


class Context(_Owned):
    """A llama_context: decode, logits views, per-sequence memory and state."""

    _free = "llama_free"

    def __init__(self, model: Model, n_ctx: int = 8192, n_batch: int = 512,
                 n_ubatch: int | None = None, n_seq_max: int = 64, type_k: str = cachetypes.DEFAULT,
                 type_v: str = cachetypes.DEFAULT, n_threads: int | None = None, flash_attn: str = "auto",
                 kv_unified: bool = True, swa_full: bool = True, eval_callback: Any = None,
                 presampler: Any = None, offload: bool = True) -> None:
        """`eval_callback`: a cffi callback of type ggml_backend_sched_eval_callback that sees
        every graph node's output (opdump.py); kept alive as long as the context.
        `offload` False: no op runs on a GPU, not even with the model on the host (llama.cpp
        moves a big batch's products and the KV ops there by default): for hooks that read
        rows in host memory.
        `presampler`: a presample.Presampler attached to every slot (its rows are read
        from llama.cpp's sampled-logits block then: `logits`); the context frees it."""
        self.model = model
        self.nat = nat = model.nat
        ffi, lib = nat.ffi, nat.lib
        types = cache_types(nat)
        for field, name in (("cacheTypeK", type_k), ("cacheTypeV", type_v)):
            if name not in types:
                raise ContextError(f"{field}: unknown cache type {name!r} for build "
                                   f"{nat.name!r}; this build offers {sorted(types)}")
        if flash_attn not in ("auto", "on", "off"):
            raise ContextError(f"flashAttn: must be one of ['auto', 'off', 'on'], got {flash_attn!r}")
        try:  # per-sequence memory: absent in b5308, there by b6170 (features.py)
            features.require(nat, "memory-api")
            for value, feature in ((kv_unified, "kv-streams"), (swa_full, "swa-small")):
                if not value:  # False needs the field; True is what builds without it do
                    features.require(nat, feature)
        except features.FeatureMissing as e:
            raise ContextError(str(e)) from None
        p = lib.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch or n_batch
        p.n_seq_max = n_seq_max
        threads = n_threads or os.cpu_count() or 1
        p.n_threads = threads
        p.n_threads_batch = threads
        p.type_k = types[type_k]
        p.type_v = types[type_v]
        if features.available(nat, "flash-attn-auto"):
            p.flash_attn_type = {"auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                 "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        else:  # older llama.cpp: a bool and no automatic choice; auto is its default, off
            p.flash_attn = flash_attn == "on"
        if features.available(nat, "kv-streams"):
            p.kv_unified = kv_unified
        if features.available(nat, "swa-small"):
            p.swa_full = swa_full
        p.no_perf = True
        if not offload:
            p.offload_kqv = False
            if features.available(nat, "op-offload"):
                p.op_offload = False
        if eval_callback is not None:
            p.cb_eval = eval_callback
        self._eval_callback = eval_callback
        if presampler is not None:
            presampler.attach(p)
        self.presampler = presampler
        self.k_center: str | None = None  # the key center's digest (kvcenter.apply)
        sink = log_sink(nat)
        sink.captured.clear()
        sink.capture = True
        try:
            self.ptr = lib.llama_init_from_model(model.ptr, p)
        finally:
            sink.capture = False
        self.init_log = list(sink.captured)  # buffer sizes per device (rpc/devices.py)
        if self.ptr == ffi.NULL:
            tail = "".join(sink.captured[-5:]).strip()
            raise ContextError(f"llama.cpp could not create the context: {tail or 'see the log'}")
        self.kv_bytes = sum(int(float(m.group(1)) * 1024 * 1024)
                            for line in sink.captured for m in [_KV_SIZE_RE.search(line)] if m)
        self.flash_attn = resolved_flash_attn(flash_attn, sink.captured)
        self.n_ctx = lib.llama_n_ctx(self.ptr)
        self.n_batch = lib.llama_n_batch(self.ptr)
        self.n_ubatch = int(lib.llama_n_ubatch(self.ptr))  # rows per graph pass
        self.n_seq_max = lib.llama_n_seq_max(self.ptr)
        # llama_n_ctx_seq came after b6170; before it, a unified cache gave every sequence
        # the whole context and separate streams an equal share.
        self.n_ctx_seq = (lib.llama_n_ctx_seq(self.ptr) if features.available(nat, "n-ctx-seq")
                          else self.n_ctx if kv_unified else self.n_ctx // self.n_seq_max)
        self.n_threads = threads
        self.type_k, self.type_v = type_k, type_v
        self.kv_unified = kv_unified
        self.mem = lib.llama_get_memory(self.ptr)
        self.n_vocab = model.n_vocab
        self._n_outputs = 0
        self._rows_touched = 0  # the most logits rows a decode has written since the last release
        # a host-only build's logits buffer is plain memory that can be given back; a GPU
        # build's may be pinned for transfers, and is left alone
        self._releasable = _host_only(nat)
        if presampler is not None:
            presampler.bind(self.ptr)

    def close(self) -> None:
        super().close()
        if getattr(self, "presampler", None) is not None:  # after the context that used it
            self.presampler.close()
            self.presampler = None

    # -------------------------------------------------------------- decode

    def decode(self, batch: Batch) -> int:
        """llama_decode: 0 ok, 1 no KV slot for the batch, 2 aborted, <0 error."""
        self._n_outputs = int(batch.logits[:batch.n].sum())
        self._rows_touched = max(self._rows_touched, self._n_outputs)
        if self.presampler is not None:  # a graph of the orders' shape (presample/reuse.py)
            n = batch.n
            # one output token per sequence, within a micro-batch, on one KV stream: llama.cpp
            # runs it as one micro-batch (its simple split), so whole rows can be read from
            # its graph afterwards. Per-sequence streams split by sequence sets (several
            # micro-batches, measured: the rows of the first were gone): rows are copied then.
            one = (self.kv_unified and n <= self.n_ubatch and bool(batch.logits[:n].all())
                   and bool((batch.n_seq_id[:n] == 1).all()) and np.unique(batch.seq[:n]).size == n)
            self.presampler.before_decode(one_micro_batch=one)
        return int(self.nat.lib.llama_decode(self.ptr, batch.value()))

    @property
    def n_outputs(self) -> int:
        """Logits rows of the last decode."""
        return self._n_outputs

    @property
    def rows_held(self) -> int:
        """Logits rows written since their pages last went back (release_logits): what
        of the output buffer a decode made resident and the process still holds."""
        return self._rows_touched

    def release_logits(self, keep_rows: int) -> int:
        """Give back to the OS the pages of the logits buffer past `keep_rows` rows that
        earlier decodes wrote (a score, or a capture of last-layer nodes, writes one row
        of n_vocab floats per token: 512 MiB for a 512-token batch here; llama.cpp keeps
        the buffer for the context's life). madvise(MADV_DONTNEED): a later decode that
        writes there gets fresh zeroed pages. Call it once the last decode's logits have
        been read (rows past `keep_rows` read zero after it); only on a host-only build.
        Returns the bytes given back."""
        keep = keep_rows
        if not self._releasable:
            return 0
        regions = self._sampling_regions(keep) if self.presampler is not None else None
        if regions is None:
            if self._rows_touched <= keep:
                return 0
            ptr = self.nat.lib.llama_get_logits(self.ptr)
            if ptr == self.nat.ffi.NULL:
                return 0
            base = int(self.nat.ffi.cast("uintptr_t", ptr))
            regions = [(base + keep * self.n_vocab * 4, base + self._rows_touched * self.n_vocab * 4)]
        self._rows_touched = keep
        freed = 0
        page = os.sysconf("SC_PAGE_SIZE")
        for a, b in regions:
            lo, hi = -(-a // page) * page, b // page * page  # whole pages inside
            if hi > lo and _madvise_dontneed(lo, hi - lo):
                freed += hi - lo
        return freed

    def _sampling_regions(self, keep: int) -> list[tuple[int, int]] | None:
        """With a presampler, llama.cpp's output buffer holds (b11312's output_reserve)
        the raw logits, then the sampled logits, probs, tokens and candidates, each
        [capacity, n_vocab]; it zeroes the whole buffer whenever it grows it. Rows reach
        only the sampled logits (every row) and probs (pre-selected rows' whole copies):
        the raw logits and candidates are never written again, so after a growth all of
        them go back, and the two used blocks past `keep` rows once decodes wrote there.
        The capacity is read from the distance between the first two blocks. [] when
        nothing is to be given back; None when the layout is not as expected."""
        lib, ffi = self.nat.lib, self.nat.ffi
        if not self._n_outputs:
            return []
        raw = lib.llama_get_logits(self.ptr)
        sl = lib.llama_get_sampled_logits_ith(self.ptr, -self._n_outputs)
        if raw == ffi.NULL or sl == ffi.NULL:
            return None
        raw_b, sl_b = (int(ffi.cast("uintptr_t", p)) for p in (raw, sl))
        row = self.n_vocab * 4
        if sl_b <= raw_b or (sl_b - raw_b) % row:
            return None
        cap = (sl_b - raw_b) // row
        grown = cap != getattr(self, "_out_capacity", None)
        if not grown and self._rows_touched <= keep:
            return []
        self._out_capacity = cap
        pb = sl_b + cap * row  # probs, then cap tokens, then the candidates
        cb = pb + cap * row + cap * 4
        used = [(sl_b + keep * row, sl_b + cap * row), (pb + keep * row, pb + cap * row)]
        return used + ([(raw_b, sl_b), (cb, cb + cap * row)] if grown else [])

    def logits(self) -> np.ndarray:
        """[n_outputs, n_vocab] float32 view of the last decode's logits (see module doc)."""
        ffi = self.nat.ffi
        if self.presampler is not None:  # pre-selected rows hold their packed values (presample/unpack.py)
            if not self._n_outputs:
                return np.empty((0, self.n_vocab), np.float32)
            ptr = self.nat.lib.llama_get_sampled_logits_ith(self.ptr, -self._n_outputs)
        else:
            ptr = self.nat.lib.llama_get_logits(self.ptr)
        n = self._n_outputs * self.n_vocab
        return np.frombuffer(ffi.buffer(ptr, n * 4), dtype=np.float32).reshape(self._n_outputs, self.n_vocab)

    # -------------------------------------------------------------- memory

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self.nat.lib.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.nat.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return int(self.nat.lib.llama_memory_seq_pos_max(self.mem, seq))

    def seq_pos_min(self, seq: int) -> int:
        return int(self.nat.lib.llama_memory_seq_pos_min(self.mem, seq))

    def clear(self) -> None:
        """Forget every sequence's cells (metadata only; the buffers are not wiped)."""
        self.nat.lib.llama_memory_clear(self.mem, False)

    # -------------------------------------------------------------- state

    def seq_state_get(self, seq: int) -> bytes:
        """The serialized KV state of one sequence."""
        ffi, lib = self.nat.ffi, self.nat.lib
        size = lib.llama_state_seq_get_size(self.ptr, seq)
        buf = np.empty(size, dtype=np.uint8)
        n = lib.llama_state_seq_get_data(self.ptr, ffi.from_buffer("uint8_t[]", buf), size, seq)
        return buf[:n].tobytes()

    def seq_state_set(self, seq: int, data: bytes) -> int:
        """Restore a sequence's KV state; returns bytes read (0 on failure)."""
        ffi, lib = self.nat.ffi, self.nat.lib
        return int(lib.llama_state_seq_set_data(self.ptr, ffi.from_buffer("uint8_t[]", data),
                                                len(data), seq))


def _host_only(nat: Native) -> bool:
    """No GPU device is registered (RPC workers are fine: the logits buffer stays a plain
    CPU buffer then); False where ggml's device API is missing (unknown)."""
    if not features.available(nat, "device-rows"):
        return False
    lib = nat.lib
    kinds = [getattr(lib, k) for k in ("GGML_BACKEND_DEVICE_TYPE_GPU", "GGML_BACKEND_DEVICE_TYPE_IGPU",
                                       "GGML_BACKEND_DEVICE_TYPE_ACCEL") if hasattr(lib, k)]
    return all(lib.ggml_backend_dev_by_type(k) == nat.ffi.NULL for k in kinds)


def _madvise_dontneed(addr: int, length: int) -> bool:
    """madvise(addr, length, MADV_DONTNEED) through libc; False when it fails."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), 4) == 0  # MADV_DONTNEED
