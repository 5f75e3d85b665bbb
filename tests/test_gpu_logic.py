"""clickpaca/llama/gpu.py on the CPU: what a GPU build refuses (pure: the build's record,
the cache types, deterministic mode), and the device listing of this CPU build (no GPU
rows; the CPU row only). The same behaviour on a GPU is tests/test_gpu.py (marked gpu,
run by `make gpu-check`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clickpaca.llama import cachetypes, gpu
from clickpaca.llama.native import load
from clickpaca.rpc.devices import device_rows

TURBO = cachetypes.names(build="turboquant")


def test_a_gpu_build_is_known_by_its_preset():
    assert gpu.gpu_build({"preset": "linux-cuda"}) and gpu.gpu_build({"preset": "macos-metal"})
    assert gpu.gpu_build({"preset": "linux-x", "cuda": {"arch": "90"}})
    assert not gpu.gpu_build({"preset": "linux-cpu"}) and not gpu.gpu_build({})


def test_the_turbo_types_are_the_cpu_only_ones():
    assert TURBO and set(gpu.cpu_only_types(tuple(cachetypes.names()))) == set(TURBO)
    assert gpu.cpu_only_types(("f16", "q8_0", "unknown")) == []


@pytest.mark.parametrize("k", ["f16", "q8_0", *TURBO])
@pytest.mark.parametrize("v", ["f16", "q4_0", *TURBO])
@pytest.mark.parametrize("det", [False, True])
def test_a_gpu_build_refuses_turbo_types_and_deterministic_mode_by_name(k, v, det):
    assert gpu.refusal(False, "linux-cpu", (k, v), det) is None  # a CPU build refuses nothing here
    got = gpu.refusal(True, "linux-cuda", (k, v), det)
    if k in TURBO:
        assert got is not None and str(got).startswith(f"cacheTypeK: {k} has CPU kernels only")
    elif v in TURBO:
        assert got is not None and str(got).startswith(f"cacheTypeV: {v} has CPU kernels only")
    elif det:
        assert got is not None and str(got).startswith("deterministic: not proven on a GPU build (linux-cuda)")
    else:
        assert got is None


def test_check_init_reads_the_builds_record():
    req = SimpleNamespace(cacheTypeK="f16", cacheTypeV=TURBO[0], deterministic=False)
    with pytest.raises(gpu.GpuRefused, match="cacheTypeV"):
        gpu.check_init(SimpleNamespace(info={"preset": "linux-cuda"}), req)
    gpu.check_init(SimpleNamespace(info={"preset": "linux-cpu"}), req)


@pytest.mark.model
def test_this_cpu_build_lists_no_gpu_and_one_cpu_row():
    nat = load("mainline")
    assert not gpu.gpu_build(nat.info)
    assert gpu.local_gpus(nat) == []
    rows = device_rows(nat, None, [])
    assert [r["name"] for r in rows] == ["CPU"] and rows[0]["memoryTotal"] > 0


SMI_LIST = """GPU 0: NVIDIA H200 (UUID: GPU-aaaa1111-0000-0000-0000-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-bbbb2222-0000-0000-0000-000000000000)
  MIG 3g.71gb     Device  0: (UUID: MIG-cccc3333-0000-0000-0000-000000000000)
  MIG 3g.71gb     Device  1: (UUID: MIG-dddd4444-0000-0000-0000-000000000000)
GPU 2: NVIDIA H200 (UUID: GPU-eeee5555-0000-0000-0000-000000000000)
"""


def test_visible_devices_unset_lists_every_gpu_or_its_mig_devices():
    devs, exact = gpu.visible_devices(SMI_LIST, None)
    assert [d["uuid"][:8] for d in devs] == ["GPU-aaaa", "MIG-cccc", "MIG-dddd", "GPU-eeee"] and not exact
    plain = "GPU 0: NVIDIA H200 (UUID: GPU-aaaa1111-0000-0000-0000-000000000000)\n"
    assert gpu.visible_devices(plain, None) == ([{"name": "NVIDIA H200", "uuid": plain[26:66], "mig": False}], True)


@pytest.mark.parametrize("cvd, want, exact", [
    ("2", ["GPU-eeee"], True),                      # SLURM gives one GPU by index
    ("2,0", ["GPU-eeee", "GPU-aaaa"], True),        # in the order given
    ("GPU-aaaa", ["GPU-aaaa"], True),               # a UUID prefix
    ("MIG-dddd", ["MIG-dddd"], False),              # one MIG device
    ("0,7,2", ["GPU-aaaa"], True),                  # read up to the first entry naming no device
    ("", [], True),                                 # set and empty: no device
    ("GPU-", [], True),                             # a prefix of several devices names none
])
def test_visible_devices_follow_cuda_visible_devices(cvd, want, exact):
    devs, is_exact = gpu.visible_devices(SMI_LIST, cvd)
    assert [d["uuid"][:8] for d in devs] == want and is_exact == exact
