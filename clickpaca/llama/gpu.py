"""A GPU build: which GPUs it sees, and which `init` choices it refuses by name.

Why a module of its own: two choices are proven on the CPU only and would silently mean
something else on a GPU, so a GPU build (CMakePresets.json's linux-cuda, linux-rocm,
macos-metal, as build-info.json records the preset) refuses them in one line naming the
field (docs/GPU.md):
- the turbo cache types: their kernels (native/turboquant/) exist for ggml's CPU backend
  alone. Running them with the KV on the CPU of a GPU build has not been measured.
- deterministic mode: its guarantees (docs/DETERMINISM.md) pin CPU kernels and batch
  shapes; nothing here has shown that CUDA's kernels hold them.
The rest of the engine is backend-agnostic (ggml's device API for the GPU list; capture
copies rows out of device memory, activations/capture.py).
"""

from __future__ import annotations

import re
from typing import Any

from . import cachetypes

#: CMakePresets.json's presets that compile a GPU backend.
GPU_PRESETS = ("linux-cuda", "linux-rocm", "macos-metal")


class GpuRefused(ValueError):
    """An init choice this GPU build does not offer; the message names the field."""


def gpu_build(info: dict) -> bool:
    """Whether a build (its build-info.json) was compiled with a GPU backend."""
    return info.get("preset") in GPU_PRESETS or bool(info.get("cuda"))


def cpu_only_types(types: tuple[str, ...]) -> list[str]:
    """The cache types among `types` whose kernels exist for the CPU alone (the rows say)."""
    return [t for t in dict.fromkeys(types) if (row := cachetypes.find(t)) is not None and row.cpu_only]


def refusal(gpu: bool, preset: str | None, types: tuple[str, str], deterministic: bool) -> GpuRefused | None:
    """What a GPU build refuses of an init request (pure: the build's kind, the cache
    types, deterministic mode); None on a CPU build or when nothing is refused."""
    if not gpu:
        return None
    for field, t in zip(("cacheTypeK", "cacheTypeV"), types):
        if cpu_only_types((t,)):
            return GpuRefused(f"{field}: {t} has CPU kernels only (native/turboquant); this is a GPU "
                              f"build ({preset}): use a CPU build for it (docs/GPU.md)")
    if deterministic:
        return GpuRefused(f"deterministic: not proven on a GPU build ({preset}); its guarantees hold "
                          "on the CPU builds (docs/DETERMINISM.md, docs/GPU.md)")
    return None


def check_init(nat: Any, req: Any) -> None:
    """GpuRefused naming the field when this build cannot serve the request as asked."""
    problem = refusal(gpu_build(nat.info), nat.info.get("preset"),
                      (req.cacheTypeK, req.cacheTypeV), bool(req.deterministic))
    if problem is not None:
        raise problem


def local_gpus(nat: Any) -> list:
    """This process's GPUs (ggml's device registry: GPU and integrated GPU devices), RPC
    workers' devices left out (they are listed with their endpoint): [] on a CPU build."""
    ffi, lib = nat.ffi, nat.lib
    kinds = {int(getattr(lib, k)) for k in ("GGML_BACKEND_DEVICE_TYPE_GPU", "GGML_BACKEND_DEVICE_TYPE_IGPU")
             if hasattr(lib, k)}  # IGPU: newer trees only
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if int(lib.ggml_backend_dev_type(dev)) not in kinds:
            continue
        reg = lib.ggml_backend_dev_backend_reg(dev)
        if reg != ffi.NULL and ffi.string(lib.ggml_backend_reg_name(reg)).startswith(b"RPC"):  # "RPC", "RPC[host:port]"
            continue
        out.append(dev)
    return out


_SMI_GPU = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
_SMI_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9a-fA-F-]+)\)")


def visible_devices(smi_list: str, cuda_visible: str | None) -> tuple[list[dict], bool]:
    """The devices a CUDA process sees, from `nvidia-smi -L` and CUDA_VISIBLE_DEVICES (which
    SLURM and container runtimes set): each {"name", "uuid", "mig"}, and whether the count
    is exact. CUDA's rule: the list is read up to its first entry that names no device (an
    index of a GPU, or a GPU-/MIG- UUID or its prefix); unset, every GPU, or the MIG devices
    of a GPU in MIG mode. A MIG device counts, but how many of them one process enumerates
    has changed between CUDA releases, so with MIG the count is an upper bound (not exact)."""
    gpus: list[dict] = []
    for line in smi_list.splitlines():
        if m := _SMI_GPU.match(line):
            gpus.append({"name": m.group(2), "uuid": m.group(3), "mig": False, "migs": []})
        elif (m := _SMI_MIG.match(line)) and gpus:
            gpus[-1]["migs"].append({"name": f"{gpus[-1]['name']} MIG {m.group(1)}", "uuid": m.group(3),
                                     "mig": True})
    every = [d for g in gpus for d in (g["migs"] or [g])]
    if cuda_visible is None:
        chosen = every
    else:
        chosen = []
        for entry in (e.strip() for e in cuda_visible.split(",")):
            if entry.isdigit():
                hit = gpus[int(entry)] if int(entry) < len(gpus) else None
                hit = None if hit is None else (hit["migs"] or [hit])[0] if hit["migs"] else hit
            else:
                hits = [d for d in every if entry and d["uuid"].startswith(entry)]
                hit = hits[0] if len(hits) == 1 else None
            if hit is None:
                break  # CUDA stops reading at the first entry that names no device
            if hit not in chosen:
                chosen.append(hit)
    out = [{"name": d["name"], "uuid": d["uuid"], "mig": d["mig"]} for d in chosen]
    return out, not any(d["mig"] for d in out)
