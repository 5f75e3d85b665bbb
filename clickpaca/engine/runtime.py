"""What an `init` loads, once per process: the model, its context and batch, the grammar
engine and the worker that fills grammar masks during a decode, the state directory of
save/load; and the `ready` event that describes them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import rpc
from ..llama import backends, cachetypes, core, cpu, deterministic, features, gpu, kvcenter
from ..wire import chat, pretokenize
from . import statedir
from ..activations import steer
from ..activations.steering import Steering
from ..activations.vector import ContextVector
from ..grammar.grammars import GrammarEngine
from .mask_ahead import MaskAhead
from .readout import Readout
from ..llama.presample import Presampler
from ..llama.models import resolve_model
from ..llama.native import NativeError, load
from ..wire.protocol import InferRequest, InitRequest, PrefillRequest, ProtocolError, ready_event
from ..rpc.devices import buffer_sizes
from ..sampling.vocab import Vocab


# outputLocal: the vocabulary projection's weights (a model's own output matrix, or the
# token embeddings it shares with its input) stay local, so a decode's logits are computed
# here instead of crossing the network (1 MiB per token for a 262,144-token vocabulary).
OUTPUT_TENSORS = r"^(output|token_embd)\.weight$"


class Runtime:
    """The loaded model and everything built on it (`open`); `close` releases them in order."""

    def __init__(self, model: core.Model, ctx: core.Context, states: statedir.StateDir,
                 deterministic: bool = False, workers: rpc.RpcDevices | None = None,
                 loss: rpc.WorkerLoss | None = None, readout: Readout | None = None) -> None:
        self.model, self.ctx = model, ctx
        self.states = states
        self.steering: Steering | None = None  # the activations build's vector slots (_start)
        self.readout = readout if readout is not None else Readout(model.nat, False)
        self.readout.bind(ctx)
        self.deterministic = deterministic
        self.workers, self.loss = workers, loss

    def _start(self, req: InitRequest) -> None:
        model, ctx = self.model, self.ctx
        self.batch = core.Batch(model.nat, ctx.n_batch)
        try:  # before the warm-up: its decode then reserves the graph with the vector in it
            self.cvec = ContextVector.open(ctx, req)
        except steer.SteerError as e:
            raise ProtocolError(str(e), request="init") from None
        self.steering = Steering.open(ctx, req.vectorSlots)  # the K slots are made by the first vector
        self.center = open_center(ctx, req.kvCenter)  # before the warm-up too (llama/kvcenter.py)
        self._warm_up()
        self.vocab = pretokenize.Vocab(model)  # tokenizing in linear time (pretokenize.py)
        self.grammars = GrammarEngine.start(model)
        self.step_vocab = Vocab(model)  # for sampler steps that read token text (DRY), built on first use
        self.masks = MaskAhead(np.zeros((ctx.n_seq_max, (model.n_vocab + 31) // 32), dtype=np.int32))
        self.ready_event: dict[str, Any] = ready_event(
            nVocab=model.n_vocab,
            build=model.nat.name,
            buildCommit=model.nat.info.get("commit"),
            buildNumber=model.nat.info.get("build_number"),
            nCtx=ctx.n_ctx,
            nCtxPerSeq=ctx.n_ctx_seq,
            nCtxShared=bool(req.kvUnified),
            nBatch=ctx.n_batch,
            nUbatch=ctx.n_ubatch,
            nSeqMax=ctx.n_seq_max,
            nThreads=ctx.n_threads,
            cacheTypeK=ctx.type_k,
            cacheTypeV=ctx.type_v,
            kvBytes=ctx.kv_bytes,
            kvUnified=bool(req.kvUnified),
            swaFull=bool(req.swaFull),
            flashAttn=req.flashAttn,
            deterministic=self.deterministic,
            preselect=ctx.presampler is not None,
            preselectFrom=("init" if req.preselect is not None
                           else "default: " + backends.preselect_default(model.nat.info).evidence),
            kernels=kernels(model, ctx),
            cpu=cpu_report(model),
            stateDir=str(self.states.root),
            cacheTypes=sorted(core.cache_types(model.nat)),
            model={"path": str(model.path), "description": model.description,
                   "sizeBytes": model.size_bytes, "nLayer": model.n_layer,
                   "nCtxTrain": model.n_ctx_train, "addBos": model.add_bos},
            nGpuLayers=req.nGpuLayers,
            outputLocal=bool(req.outputLocal),
            capture=self.readout.mode,
            controlVector=self.cvec.ready() if self.cvec is not None else None,
            kvCenter=self.center.ready(req.kvCenter) if self.center is not None else None,
            devices=rpc.device_rows(model.nat, self.workers, model.load_log + ctx.init_log,
                                    output_layer=model.n_layer if req.outputLocal else None),
        )
        if self.workers is not None:
            self.ready_event.update(rpcServers=[w.text for w in self.workers.workers],
                                    rpcTimeout=self.workers.timeout,
                                    tensorSplit=list(req.tensorSplit) if req.tensorSplit else None)

    @classmethod
    def open(cls, req: InitRequest, state_dir: str | None = None, allow_any_path: bool = False,
             on_worker_lost: Callable[[str], None] | None = None) -> "Runtime":
        """Load what a validated `init` request asks for; ProtocolError naming the field.
        `state_dir` is the server's default (--state-dir) when the request has no stateDir.
        With rpcServers, the workers are checked and connected first, and a worker lost
        later calls `on_worker_lost` with a message naming it (rpc/loss.py)."""
        types = (req.cacheTypeK, req.cacheTypeV)
        build = req.build or (kvcenter.build_for_centered(*types) if req.kvCenter is not None
                              else cachetypes.build_for(*types))
        det = req.deterministic  # the edge (wire/protocol/requests.py) set its flashAttn and kvUnified
        flash_attn = attention_for(types, req.flashAttn)
        states = open_state_dir(req.stateDir or state_dir, allow_any_path)
        if det:
            deterministic.apply_process_settings()
        try:
            path = resolve_model(req.modelPath)
            nat = load(build)
        except core.ModelError as e:
            raise ProtocolError(f"modelPath: {e}", request="init") from None
        except NativeError as e:
            raise ProtocolError(f"build: {e}", request="init") from None
        try:  # what the request needs that this build lacks, by name, before loading anything
            features.check_init(nat, req)
            gpu.check_init(nat, req)  # what a GPU build refuses (turbo types, deterministic)
        except (features.FeatureMissing, gpu.GpuRefused) as e:
            raise ProtocolError(str(e), request="init") from None
        workers, loss = open_workers(nat, req, types, on_worker_lost) if req.rpcServers else (None, None)
        try:
            model = core.Model(path, n_gpu_layers=req.nGpuLayers, nat=nat, repack=not det,
                               devices=workers.dev_array if workers is not None else None,
                               tensor_split=req.tensorSplit,
                               cpu_tensors=OUTPUT_TENSORS if req.outputLocal else None)
        except core.ModelError as e:
            close_workers(workers, loss)
            raise ProtocolError(f"modelPath: {e}", request="init") from None
        readout = Readout(nat, req.capture)  # the eval callback: at creation or live (readout.py)
        # the decode pre-selects each sampled row's values (llama/presample/, sampling/fastpath.py)
        # left out: the backend's row, where the build can (a default never refuses an init)
        preselect = req.preselect if req.preselect is not None else (
            backends.preselect_default(nat.info).on and features.available(nat, "backend-sampling"))
        presampler = Presampler(nat, model.n_vocab, req.nSeqMax) if preselect else None
        try:
            ctx = core.Context(model, n_ctx=req.nCtx, n_batch=req.nBatch,
                               n_ubatch=(deterministic.ubatch(types, req.nUbatch or req.nBatch) if det else None) or req.nUbatch,
                               n_seq_max=req.nSeqMax, type_k=types[0], type_v=types[1],
                               n_threads=req.nThreads, flash_attn=flash_attn,
                               kv_unified=req.kvUnified, swa_full=req.swaFull,
                               eval_callback=readout.at_creation, presampler=presampler)
        except core.ContextError as e:
            model.close()
            close_workers(workers, loss)
            raise ProtocolError(str(e), request="init") from None
        rt = cls(model, ctx, states, det, workers, loss, readout)
        try:
            rt._start(req)
        except BaseException:
            rt.close()
            raise
        return rt

    def _warm_up(self) -> None:
        """One throw-away decode, so the first request's timings exclude graph setup."""
        self.batch.clear()
        self.batch.add([self.model.bos], 0, 0, output_last=True)
        self.ctx.decode(self.batch)
        self.ctx.seq_rm(0, -1, -1)
        self.batch.clear()

    def prompt_text(self, req: InferRequest | PrefillRequest) -> str:
        """The request's prompt, or its messages formatted with a chat template."""
        if req.messages is None:
            return req.prompt
        try:
            return chat.format_messages(self.model, req.chatTemplate, req.messages,
                                        req.addGenerationPrompt)
        except chat.ChatError as e:
            raise ProtocolError(str(e), req.seq_id, req.type) from None

    def tokenize_prompt(self, text: str, continuing: bool, seq_id: int = -1, kind: str | None = None
                        ) -> np.ndarray:
        """Special tokens in the text are parsed; BOS is added once at the start only.
        A text whose special tokens alone overflow the context is refused before the
        rest of the work (ProtocolError naming the prompt)."""
        model = self.model
        n_ctx = self.ctx.n_ctx_seq
        try:
            toks = self.vocab.tokenize(text, add_special=not continuing, parse_special=True, at_most=n_ctx)
        except pretokenize.TooMany as e:
            raise ProtocolError(f"prompt: {e} do not fit the context ({n_ctx} tokens per sequence)",
                                seq_id, kind) from None
        if not continuing and model.add_bos and len(toks) >= 2 \
                and toks[0] == model.bos and toks[1] == model.bos:
            toks = toks[1:]  # the text began with <bos> already
        return toks

    def score_tokens(self, text: str) -> np.ndarray:
        """A score text's tokens: special tokens are text there (BOS in front)."""
        return self.vocab.tokenize(text, add_special=True, parse_special=False)

    def piece(self, token: int) -> str:
        return self.model.token_to_piece(token, special=True).decode("utf-8", "replace")

    def close(self) -> None:
        """After every sequence has ended: the mask worker, the grammar engine's tokenizer
        build (it reads the model's vocabulary), the context, the model. Also what a
        failed `open` had started."""
        if getattr(self, "masks", None) is not None:
            self.masks.close()
        if getattr(self, "grammars", None) is not None:
            try:
                self.grammars.wait(None)
            except Exception:  # noqa: BLE001 - a failed build is irrelevant at exit
                pass
        self.ctx.close()
        self.model.close()
        close_workers(self.workers, self.loss)


def open_workers(nat, req: InitRequest, types: tuple[str, str], on_lost: Callable[[str], None] | None
                 ) -> tuple[rpc.RpcDevices, rpc.WorkerLoss]:
    """Check and connect the init's rpcServers (rpc/): ProtocolError naming the field.
    The abort callback goes in first, so a worker lost while loading is a loss too."""
    known = core.cache_types(nat)
    kv = {f: (t, known[t]) for f, t in (("cacheTypeK", types[0]), ("cacheTypeV", types[1])) if t in known}
    try:
        rpc.protocol_version(nat)
    except rpc.RpcUnavailable as e:
        raise ProtocolError(f"rpcServers: {e}", request="init") from None
    loss = rpc.WorkerLoss(nat, on_lost)
    try:
        workers = rpc.connect_workers(nat, req.rpcServers, req.rpcTimeout, kv)
    except rpc.WorkerCheckError as e:
        loss.close()
        raise ProtocolError(str(e) if e.field != "rpcServers" else f"rpcServers: {e}", request="init") from None
    loss.devices = workers
    split = req.tensorSplit
    if split is not None and len(split) != workers.n_devices:
        close_workers(workers, loss)
        raise ProtocolError(f"tensorSplit: {len(split)} values for {workers.n_devices} RPC devices "
                            "(one share per device of the workers, in rpcServers order)", request="init")
    return workers, loss


def close_workers(workers: rpc.RpcDevices | None, loss: rpc.WorkerLoss | None) -> None:
    """After the model and context are freed: the held connections, then the callback."""
    if workers is not None:
        workers.close()
    if loss is not None:
        loss.close()


def attention_for(types: tuple[str, str], flash_attn: str) -> str:
    """The flashAttn to ask llama.cpp for. Its flash attention reads some types as another
    (f32 as f16: cachetypes.py), so such a cache with it on would be reported as itself and
    computed as the other: "on" is refused, "auto" becomes "off"."""
    cast = cachetypes.flash_attn_casts(types)
    if cast is not None:
        i, row = cast
        if flash_attn == "on":
            field = ("cacheTypeK", "cacheTypeV")[i]
            raise ProtocolError(f"flashAttn: 'on' computes attention in {row.flash_attn_casts_to} (llama.cpp "
                                f"casts a {row.name} K/V cache to {row.flash_attn_casts_to} for it), so {field} "
                                f"{row.name} would not be {row.name}; use flashAttn 'off' or 'auto' (which "
                                f"turns it off for {row.name})", request="init")
        return "off"
    return flash_attn


def kernels(model: core.Model, ctx: core.Context) -> dict[str, Any]:
    """The kernel paths in force, for `ready`: each changes results with batch shape or
    cell placement (docs/DETERMINISM.md)."""
    return {"flashAttn": ctx.flash_attn, "repack": model.repack,
            "extraBufferTypes": extra_buffer_types(model.load_log),
            "kvLayout": "unified" if ctx.kv_unified else "per-sequence",
            "tiledMatmul": deterministic.tiled_matmul()}


def extra_buffer_types(load_log: list[str]) -> list[str]:
    """The CPU extra buffer types holding weights (CPU_REPACK, AMX, ...), as the model's
    load logged them: the kernels that take over matrix products from the plain CPU path.
    Empty with repack off (use_extra_bufts false), which deterministic mode sets."""
    names = {name for name, kind in buffer_sizes(load_log) if kind == "model"}
    return sorted(n for n in names if n == "AMX" or (n.startswith("CPU_") and n != "CPU_Mapped"))


def cpu_report(model: core.Model) -> dict[str, Any]:
    """For `ready`: this CPU, the instruction sets the build was compiled for, and its CPU
    choices (AMX kept, portable variants): what decides which kernels exist at all."""
    built = model.nat.info.get("cpu") or {}
    variant = model.nat.cpu_variant
    if built.get("portable"):  # no -march: the features are those of the variant ggml loaded
        features = sorted(cpu.variant_flags((built.get("variants") or {}).get(variant) or []))
    else:
        features = cpu.features(built.get("isa") or [])
    return {"name": cpu.cpu_name(), "features": features,
            "amx": bool(built.get("amx")), "portable": bool(built.get("portable")),
            "variant": variant,
            "builtOn": built.get("built_on")}


def open_center(ctx: core.Context, path: str | None) -> kvcenter.Center | None:
    """init's kvCenter read and set on the context; ProtocolError naming kvCenter."""
    if path is None:
        return None
    try:
        center = kvcenter.read(path)
        kvcenter.apply(ctx, center)
    except kvcenter.CenterError as e:
        raise ProtocolError(f"kvCenter: {e}", request="init") from None
    return center


def open_state_dir(root: str | None, allow_any_path: bool) -> statedir.StateDir:
    """The directory of save/load state files (default: statedir.default_root());
    ProtocolError naming stateDir when it cannot be used."""
    try:
        return statedir.StateDir(root or statedir.default_root(), allow_any_path)
    except (OSError, statedir.StatePathError) as e:
        raise ProtocolError(f"stateDir: cannot be used ({getattr(e, 'strerror', None) or e})",
                            request="init") from None
