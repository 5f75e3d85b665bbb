"""KV cache types: one row per type, and every rule about them, read from the rows.

`cacheTypeK` / `cacheTypeV` take a row's name. What each consumer asks is here: which
names a build offers (core.cache_types), which build a pair needs (build_for), which have
CPU kernels only (a GPU build refuses them, gpu.py), whether
flash attention computes a type as itself (f32: llama.cpp casts it to f16), whether a V
of it needs flash attention (a quantized V does), what deterministic mode sets for it
(deterministic.py), the bits per value and block size (checked against ggml's own type
table by tests/test_cachetypes.py), where it is listed, and the tolerance tests allow it.
Adding a type or a family is its rows here plus its kernels (native/turboquant/ for the
turbo family). docs/CAPABILITIES.md's table of the types is `docs_table()`.

Imports nothing from clickpaca: it sits below core.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CacheType", "UnknownCacheType", "ROWS", "MAINLINE", "DEFAULT", "EXACT", "STUDY_CACHE",
           "NEAR_TIE_LOSSLESS", "NEAR_TIE_LOSSY", "get", "find", "names", "builds", "build_for", "attention",
           "flash_attn_casts", "attention_note", "v_needs_flash_attn", "display_sorted", "docs_table"]

#: The build every type not marked otherwise is in (every other build has its types too).
MAINLINE = "mainline"
#: Tests: two greedy runs whose batches differ may part only where the tokens are this many
#: nats apart; lossy types (4 bits and below) amplify the CPU kernels' placement-dependent
#: rounding (measured: q8_0/turbo3 runs parted at ~1 nat).
NEAR_TIE_LOSSLESS = 0.5
NEAR_TIE_LOSSY = 2.0


@dataclass(frozen=True)
class CacheType:
    """One KV cache type. `name` is ggml's type name, the wire value."""

    name: str
    #: ggml's enum member (ggml.h), whose ggml_type_name is `name`
    ggml: str
    #: bits per value, the block's scales included (8 x ggml_type_size / ggml_blck_size)
    bits: float
    #: values per block (ggml_blck_size)
    block: int
    #: the build that has it (a MAINLINE type is in every build)
    build: str = MAINLINE
    #: its kernels exist for ggml's CPU backend alone: a GPU build refuses it (gpu.py)
    cpu_only: bool = False
    #: block-quantized; llama.cpp computes a quantized V only with flash attention
    quantized: bool = True
    #: llama.cpp's flash attention reads this type as that one (f32 as f16): flash attention
    #: on would not compute it as itself, so "auto" turns it off and "on" is refused
    flash_attn_casts_to: str | None = None
    #: deterministic mode's flashAttn for this type: "off" (attention without flash
    #: attention), "on" (flash attention kept row by row by det_ubatch), None: refused
    det_flash_attn: str | None = None
    #: deterministic mode: micro-batches of at most this many tokens (None: nBatch's),
    #: below deterministic.FA_TILE_ROWS so flash attention never takes its tiled path
    det_ubatch: int | None = None
    #: tests' tolerance: greedy runs part only at near ties of NEAR_TIE_LOSSLESS (else _LOSSY)
    lossless: bool = False
    #: `bench kv`'s default list also measures this type as V under this K
    bench_k: str | None = None
    #: in the studies' default --cache (ppl, kv-retrieval, bench state, the demo)
    study: bool = False
    #: place in listings (set from the order of ROWS)
    order: int = -1

    @property
    def v_needs_flash_attn(self) -> bool:
        """llama.cpp refuses a quantized V cache without flash attention."""
        return self.quantized

    @property
    def near_tie(self) -> float:
        return NEAR_TIE_LOSSLESS if self.lossless else NEAR_TIE_LOSSY


_UNQUANTIZED = dict(block=1, quantized=False, det_flash_attn="off", lossless=True)
#: TurboQuant-mse (clickpaca/llama/turboquant.py, native/turboquant/): 128 values per block and
#: an fp16 scale; deterministic mode keeps its flash attention row by row (docs/DETERMINISM.md)
_TURBO = dict(block=128, build="turboquant", cpu_only=True, det_flash_attn="on", det_ubatch=32, bench_k="q8_0")

#: Every type, in display order (bits per value, largest first; then the builds' own types).
ROWS: tuple[CacheType, ...] = tuple(dataclasses.replace(r, order=i) for i, r in enumerate((
    CacheType("f32", "GGML_TYPE_F32", 32.0, **_UNQUANTIZED, flash_attn_casts_to="f16"),
    CacheType("f16", "GGML_TYPE_F16", 16.0, **_UNQUANTIZED, study=True),
    CacheType("bf16", "GGML_TYPE_BF16", 16.0, **_UNQUANTIZED),
    CacheType("q8_0", "GGML_TYPE_Q8_0", 8.5, 32, lossless=True, study=True),
    CacheType("q5_1", "GGML_TYPE_Q5_1", 6.0, 32),
    CacheType("q5_0", "GGML_TYPE_Q5_0", 5.5, 32),
    CacheType("q4_1", "GGML_TYPE_Q4_1", 5.0, 32),
    CacheType("q4_0", "GGML_TYPE_Q4_0", 4.5, 32, study=True),
    CacheType("iq4_nl", "GGML_TYPE_IQ4_NL", 4.5, 32),
    CacheType("turbo4", "GGML_TYPE_TURBO4", 4.125, **_TURBO),
    CacheType("turbo3", "GGML_TYPE_TURBO3", 3.125, **_TURBO),
    CacheType("turbo2", "GGML_TYPE_TURBO2", 2.125, **_TURBO),
)))
_BY_NAME = {r.name: r for r in ROWS}

#: The default K and V (init's), the base every study compares against.
DEFAULT = "f16"
#: The exact reference of the studies (--ref f32): attention as stored, flash attention off.
EXACT = "f32"
#: The studies' default --cache.
STUDY_CACHE = ",".join(r.name for r in ROWS if r.study)


class UnknownCacheType(ValueError):
    """A name that is no row's. The message names the field and the valid choices."""

    def __init__(self, field: str, name: object, choices: tuple[str, ...]):
        super().__init__(f"{field}: unknown cache type {name!r}; valid: {', '.join(choices)}")
        self.field = field
        self.name = name


def find(name: str) -> CacheType | None:
    return _BY_NAME.get(name)


def get(name: str, field: str = "cache type") -> CacheType:
    """The row of `name`; UnknownCacheType naming `field` and every valid name."""
    row = _BY_NAME.get(name) if isinstance(name, str) else None
    if row is None:
        raise UnknownCacheType(field, name, names())
    return row


def names(build: str | None = None, **where: object) -> tuple[str, ...]:
    """Row names in display order: those of `build` (None: all), with fields equal to `where`."""
    return tuple(r.name for r in ROWS if (build is None or r.build == build)
                 and all(getattr(r, f) == v for f, v in where.items()))


def builds() -> tuple[str, ...]:
    """The builds with types of their own, MAINLINE first."""
    return tuple(dict.fromkeys([MAINLINE] + [r.build for r in ROWS]))


def build_for(*types: str) -> str:
    """The build that has all of these types: MAINLINE unless one is another build's. A name
    that is no row's counts as MAINLINE's: loading it is refused there, naming the field and
    what the build offers (core.Context)."""
    own = {r.build for t in types if (r := find(t)) is not None} - {MAINLINE}
    if len(own) > 1:
        raise ValueError(f"cache types {', '.join(types)} are in different builds ({', '.join(sorted(own))})")
    return own.pop() if own else MAINLINE


def flash_attn_casts(types: tuple[str, ...]) -> tuple[int, CacheType] | None:
    """(index, row) of the first type flash attention would not compute as itself."""
    for i, t in enumerate(types):
        row = find(t)
        if row is not None and row.flash_attn_casts_to is not None:
            return i, row
    return None


def attention(k: str, v: str) -> str:
    """The flashAttn a study asks for: on, except where it would not compute a type as itself."""
    return "off" if flash_attn_casts((k, v)) else "on"


def attention_note() -> str:
    """What attention() asks for, in words, for a study's notes."""
    cast = ", ".join(f"{r.name}, which it would compute as {r.flash_attn_casts_to}"
                     for r in ROWS if r.flash_attn_casts_to)
    return f"flash attention on (off for {cast})" if cast else "flash attention on"


def v_needs_flash_attn(v: str, field: str = "cache type") -> bool:
    """Whether llama.cpp computes a V of this type only with flash attention (a noise floor of
    such a type leaves out its "flash attention off" row)."""
    return get(v, field).v_needs_flash_attn


def display_sorted(types: list[str] | tuple[str, ...]) -> list[str]:
    """Types in display order; names that are no row's last, by name."""
    return sorted(types, key=lambda t: (_BY_NAME[t].order if t in _BY_NAME else len(ROWS), t))


def docs_table() -> str:
    """The docs/CAPABILITIES.md table of the cache types, one line per row (checked by
    tests/test_cachetypes.py against the file)."""
    lines = ["| type | bits/value | block | build | quantized | V needs flash attention | deterministic mode |",
             "|---|---|---|---|---|---|---|"]
    for r in ROWS:
        if r.det_flash_attn is None:
            det = "refused"
        else:
            det = f"flash attention {r.det_flash_attn}"
            if r.det_ubatch:
                det += f", micro-batches of {r.det_ubatch}"
            if r.det_flash_attn == "on":
                det += " (K and V both such types)"
        notes = f" (flash attention computes it as {r.flash_attn_casts_to}: off by default)" \
            if r.flash_attn_casts_to else ""
        lines.append(f"| `{r.name}`{notes} | {r.bits:g} | {r.block} | {r.build} | "
                     f"{'yes' if r.quantized else 'no'} | {'yes' if r.v_needs_flash_attn else 'no'} | {det} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- K/V pairs


def parse_pair(spec: str) -> tuple[str, str]:
    """'q8_0' -> ('q8_0', 'q8_0'); 'q8_0/turbo3' -> ('q8_0', 'turbo3')."""
    spec = spec.strip()
    if "/" in spec:
        k, v = spec.split("/", 1)
        return k.strip(), v.strip()
    return spec, spec


def pair_name(k: str, v: str) -> str:
    return k if k == v else f"{k}/{v}"
