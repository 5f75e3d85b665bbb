"""The KV cache-type table (clickpaca/llama/cachetypes.py): every row consistent, the lookups,
the errors, the rules read from it, the docs table, and the rows against each build's own
ggml type table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clickpaca.llama import cachetypes, deterministic
from clickpaca.llama.cachetypes import DEFAULT, EXACT, MAINLINE, ROWS, UnknownCacheType


def test_every_row_is_consistent():
    names = [r.name for r in ROWS]
    assert len(set(names)) == len(names)
    assert [r.order for r in ROWS] == list(range(len(ROWS)))
    for r in ROWS:
        assert r.ggml == "GGML_TYPE_" + r.name.upper(), r
        assert (r.bits * r.block) % 8 == 0, r  # whole bytes per block
        assert r.quantized == (r.block > 1), r
        assert r.v_needs_flash_attn == r.quantized
        assert r.build in cachetypes.builds()
        assert r.det_flash_attn in (None, "off", "on"), r
        if r.det_flash_attn == "off":  # attention without flash attention: a V it can compute
            assert not r.v_needs_flash_attn, r
        assert (r.det_ubatch is not None) == (r.det_flash_attn == "on"), r
        if r.det_ubatch is not None:  # below flash attention's tiled path
            assert 3 <= r.det_ubatch < deterministic.FA_TILE_ROWS, r
        if r.flash_attn_casts_to is not None:
            assert cachetypes.get(r.flash_attn_casts_to).bits < r.bits, r
        if r.bench_k is not None:
            assert cachetypes.get(r.bench_k).build == MAINLINE, r
        if r.lossless:
            assert r.bits >= 8, r
        assert r.near_tie == (cachetypes.NEAR_TIE_LOSSLESS if r.lossless else cachetypes.NEAR_TIE_LOSSY)
    # display order: bits per value, largest first, within each build
    for b in cachetypes.builds():
        bits = [r.bits for r in ROWS if r.build == b]
        assert bits == sorted(bits, reverse=True), b
    assert cachetypes.builds()[0] == MAINLINE
    for name in (DEFAULT, EXACT, *cachetypes.STUDY_CACHE.split(",")):
        assert cachetypes.get(name).build == MAINLINE
    assert not cachetypes.get(DEFAULT).quantized and not cachetypes.get(EXACT).quantized
    assert cachetypes.get(EXACT).flash_attn_casts_to == DEFAULT


def test_the_numpy_reference_has_the_turbo_rows():
    from clickpaca.llama import turboquant

    rows = [r for r in ROWS if r.build == "turboquant"]
    assert sorted(turboquant.TYPES) == sorted(r.name for r in rows)
    for r in rows:
        tt = turboquant.TYPES[r.name]
        assert r.block == turboquant.QK and tt.bits_per_value == r.bits and tt.bits == int(r.name[-1])


def test_lookups():
    assert cachetypes.get("q5_1").bits == 6.0 and cachetypes.find("q5_1") is cachetypes.get("q5_1")
    assert cachetypes.find("q5-1") is None
    assert cachetypes.names()[:3] == ("f32", "f16", "bf16")
    assert cachetypes.names(MAINLINE) == ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
    assert cachetypes.names("turboquant") == ("turbo4", "turbo3", "turbo2")
    assert cachetypes.names(det_flash_attn="off") == ("f32", "f16", "bf16")
    assert cachetypes.names(MAINLINE, quantized=False, lossless=True) == ("f32", "f16", "bf16")
    assert cachetypes.display_sorted(["zz", "iq4_nl", "turbo2", "f16", "aa"]) == ["f16", "iq4_nl", "turbo2", "aa", "zz"]
    assert cachetypes.STUDY_CACHE == "f16,q8_0,q4_0"


def test_build_for_a_pair():
    assert cachetypes.build_for("f16", "f16") == MAINLINE
    assert cachetypes.build_for("iq4_nl", "q5_1") == MAINLINE
    assert cachetypes.build_for("q8_0", "turbo3") == "turboquant"
    assert cachetypes.build_for("turbo2") == "turboquant"
    assert cachetypes.build_for() == MAINLINE
    # an unknown name is left to the build to refuse (core.Context names the field)
    assert cachetypes.build_for("nope", "f16") == MAINLINE
    assert cachetypes.build_for("nope", "turbo4") == "turboquant"


def test_flash_attention_rules():
    assert cachetypes.attention("f16", "q4_0") == "on"
    assert cachetypes.attention("f32", "f16") == "off" and cachetypes.attention("q8_0", "f32") == "off"
    assert cachetypes.flash_attn_casts(("f16", "f32")) == (1, cachetypes.get("f32"))
    assert cachetypes.flash_attn_casts(("f16", "q8_0")) is None
    assert cachetypes.attention_note() == "flash attention on (off for f32, which it would compute as f16)"
    assert cachetypes.v_needs_flash_attn("iq4_nl") and cachetypes.v_needs_flash_attn("turbo3")
    assert not cachetypes.v_needs_flash_attn("bf16")


@pytest.mark.parametrize("name", ["q5-1", "", "TURBO3", None, 16])
def test_an_unknown_name_names_the_field_and_the_choices(name):
    with pytest.raises(UnknownCacheType) as ei:
        cachetypes.get(name, "cacheTypeV")
    msg = str(ei.value)
    assert msg.startswith(f"cacheTypeV: unknown cache type {name!r}; valid: "), msg
    assert msg.endswith(", ".join(r.name for r in ROWS)), msg
    assert ei.value.field == "cacheTypeV" and ei.value.name == name
    with pytest.raises(ValueError, match=r"^--noise-of: unknown cache type"):
        cachetypes.v_needs_flash_attn(name, "--noise-of")


def test_deterministic_mode_reads_the_rows():
    assert deterministic.required(("f16", "bf16"))["flashAttn"] == "off"
    assert deterministic.required(("turbo3", "turbo4")) == {"flashAttn": "on", "kvUnified": False}
    assert deterministic.required(("turbo3", "f16"))["flashAttn"] == "off"
    assert deterministic.ubatch(("turbo3", "turbo4"), 512) == cachetypes.get("turbo3").det_ubatch
    assert deterministic.ubatch(("turbo3", "turbo4"), 8) == 8
    assert deterministic.ubatch(("f16", "q8_0"), 512) is None
    assert deterministic.type_problem(("f32", "bf16")) is None
    assert deterministic.type_problem(("turbo2", "turbo4")) is None
    i, why = deterministic.type_problem(("f16", "q5_1"))
    assert i == 1 and "f32, f16, bf16" in why and "turbo4, turbo3, turbo2 for both K and V" in why
    i, why = deterministic.type_problem(("iq4_nl", "f16"))
    assert i == 0 and "without flash attention" in why
    i, why = deterministic.type_problem(("turbo3", "q8_0"))
    assert i == 1 and "both K and V or for neither" in why
    i, _ = deterministic.type_problem(("f16", "turbo3"))
    assert i == 0
    i, _ = deterministic.type_problem(("nope", "f16"))
    assert i == 0


def test_the_noise_planners_leave_out_flash_attention_off_for_a_quantized_v():
    from clickpaca.measure.bench.ppl import plan_variants
    from clickpaca.measure.retrieval.command import NOISE, floor_base, noise_setups

    for v in cachetypes.names():
        of = floor_base([("f16", v)], ("f16", v))
        kept = [n.flash_attn for n in noise_setups(of)]
        assert ("off" in kept) == (not cachetypes.get(v).quantized), v
        assert len(kept) == len(NOISE) - cachetypes.get(v).quantized
        variants, _, noise_at = plan_variants([("f16", v)], "f16", True, ("f16", v))
        offs = [variants[i].flash_attn for i in noise_at[1:]]
        assert ("off" in offs) == (not cachetypes.get(v).quantized), v
    with pytest.raises(ValueError, match="^--noise-of: unknown cache type 'q5-1'"):
        plan_variants([("q5-1", "q5-1")], "f16", True, ("q5-1", "q5-1"))


def test_docs_table_is_generated_from_the_rows():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "CAPABILITIES.md").read_text(encoding="utf-8")
    block = doc.split("<!-- cache-types:start -->\n", 1)[1].split("\n<!-- cache-types:end -->", 1)[0]
    assert block == cachetypes.docs_table()
    for r in ROWS:
        assert f"| `{r.name}`" in block


_READ_BUILD = """
import json, sys
from clickpaca.llama.native import load
from clickpaca.llama.core import cache_types
n = load(sys.argv[1])
lib, ffi = n.lib, n.ffi
named = {ffi.string(lib.ggml_type_name(t)).decode(): t for t in range(int(lib.GGML_TYPE_COUNT))
         if lib.ggml_type_name(t) != ffi.NULL}
print(json.dumps({"offered": cache_types(n), "named": named,
                  "rows": {k: [8.0 * lib.ggml_type_size(v) / lib.ggml_blck_size(v), lib.ggml_blck_size(v),
                               getattr(lib, f"GGML_TYPE_{k.upper()}", None)] for k, v in cache_types(n).items()}}))
"""


@pytest.mark.parametrize("build", [pytest.param(MAINLINE, marks=pytest.mark.model),
                                   pytest.param("turboquant", marks=[pytest.mark.model, pytest.mark.turboquant])])
def test_the_rows_match_the_builds_own_type_table(build):
    """Each build offers exactly its rows (and mainline's), with ggml's bits per value, block
    size and enum member. In a child process: two builds must not share one process."""
    r = subprocess.run([sys.executable, "-c", _READ_BUILD, build], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = {row.name for row in ROWS if row.build in (MAINLINE, build)}
    assert set(got["offered"]) == want
    for name, (bits, block, enum) in got["rows"].items():
        row = cachetypes.get(name)
        assert (bits, block, enum) == (row.bits, row.block, got["offered"][name]), name
    # a build's own family (its rows' names less the digits) has no type without a row
    families = tuple({re.sub(r"\d+$", "", row.name) for row in ROWS if row.build == build != MAINLINE})
    assert families or build == MAINLINE
    assert not {n for n in got["named"] if families and n.startswith(families)} - set(cachetypes.names())


# ---------------------------------------------------------------- no rule outside the table

PKG = Path(__file__).resolve().parent.parent / "clickpaca"
#: Modules that may name a build with types of its own: they make or load builds by name
#: (the build's name, not a rule about its types).
BUILD_NAMERS = {
    "base/paths.py": "the builds the Makefile has a target for",
    "llama/cpu.py": "the make target that rebuilds a build for this CPU",
    "llama/turboquant.py": "the numpy reference of that build's kernels, built from its rows",
}


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in a module that is not a docstring."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_module_but_the_table_names_a_cache_type_or_keys_a_rule_on_its_build():
    """A type's facts (which types a rule covers, its bits per value, the default and exact
    types) are read from the rows; a literal type name elsewhere is a rule drifting out of
    the table (as the GPU build's CPU-only types once were, by build name, and kvsim's bits
    of f16/q8_0/q4_0). Names in docstrings and comments are free."""
    types = set(cachetypes.names())
    own_builds = set(cachetypes.builds()) - {MAINLINE}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "llama/cachetypes.py":
            continue
        for line, text in _literals(path):
            if text in types or (text in own_builds and rel not in BUILD_NAMERS):
                found.append(f"clickpaca/{rel}:{line}: {text!r}")
    assert not found, "read these from llama/cachetypes.py:\n" + "\n".join(found)


def test_the_simulated_real_types_are_rows_with_their_bits():
    from clickpaca.measure.kvsim import quant

    assert quant.REAL_KINDS[0] == DEFAULT
    for kind in quant.REAL_KINDS:
        row = cachetypes.get(kind)
        assert row.build == MAINLINE
        assert quant.bits_per_value(quant.parse(kind), 64) == row.bits, kind


def test_the_gpu_build_refuses_exactly_the_cpu_only_rows():
    from clickpaca.llama import gpu

    assert gpu.cpu_only_types(cachetypes.names()) == [r.name for r in ROWS if r.cpu_only]
    assert {r.build for r in ROWS if r.cpu_only} == {"turboquant"}
