"""Bits per value as a build reports them, which builds are here: what `bench kv` and
`ppl` measure beside the table.

What each type is (bits, build, flash attention) and the K/V pair notation are
clickpaca/llama/cachetypes.py's.
"""

from __future__ import annotations

from ...llama import cachetypes
from ...llama.native import available_builds


def other_builds() -> list[str]:
    """The builds here, other than mainline, that have cache types of their own."""
    here = available_builds()
    return [b for b in cachetypes.builds() if b != cachetypes.MAINLINE and b in here]


def bits_per_value(build: str) -> dict[str, float]:
    """Bits per value of every cache type of the build, from ggml's own type table.

    Asked in a child process: two builds' libraries must not be loaded into one process
    (their ggml symbols collide and the second build reads the first one's tables)."""
    import json
    import subprocess
    import sys

    code = ("import json; from clickpaca.llama.native import load; "
            "from clickpaca.llama.core import cache_types, type_bits_per_value; "
            f"n = load({build!r}); "
            "print(json.dumps({k: type_bits_per_value(n, v) for k, v in cache_types(n).items()}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - fall back to the table's nominal figures
        return {r.name: r.bits for r in cachetypes.ROWS if r.build in (cachetypes.MAINLINE, build)}


def pair_bpv(k: str, v: str, table: dict[str, float]) -> float | None:
    if k in table and v in table:
        return (table[k] + table[v]) / 2
    return None
