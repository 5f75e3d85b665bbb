"""Cache types a build offers, K/V pair notation, bits per value, which build serves which."""

from __future__ import annotations

from ..native import available_builds

#: Nominal bits per value of llama.cpp's cache types (block size and scale included).
NOMINAL_BPV = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0,
               "iq4_nl": 4.5, "q5_0": 5.5, "q5_1": 6.0}


def parse_pair(spec: str) -> tuple[str, str]:
    """'q8_0' -> ('q8_0', 'q8_0'); 'q8_0/turbo3' -> ('q8_0', 'turbo3')."""
    spec = spec.strip()
    if "/" in spec:
        k, v = spec.split("/", 1)
        return k.strip(), v.strip()
    return spec, spec


def pair_name(k: str, v: str) -> str:
    return k if k == v else f"{k}/{v}"


def build_for(k: str, v: str) -> str:
    return "turboquant" if k.startswith("turbo") or v.startswith("turbo") else "mainline"


def has_turboquant() -> bool:
    return "turboquant" in available_builds()


def bits_per_value(build: str) -> dict[str, float]:
    """Bits per value of every cache type of the build, from ggml's own type table.

    Asked in a child process: two builds' libraries must not be loaded into one process
    (their ggml symbols collide and the second build reads the first one's tables)."""
    import json
    import subprocess
    import sys

    code = ("import json; from clickpaca.native import load; "
            "from clickpaca.core import cache_types, type_bits_per_value; "
            f"n = load({build!r}); "
            "print(json.dumps({k: type_bits_per_value(n, v) for k, v in cache_types(n).items()}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - fall back to the known table
        return dict(NOMINAL_BPV)


def pair_bpv(k: str, v: str, table: dict[str, float]) -> float | None:
    if k in table and v in table:
        return (table[k] + table[v]) / 2
    return None
