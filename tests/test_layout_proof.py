"""The layout proof catches declarations that disagree with what the C compiler lays out.

Each case compiles the probe against header v1 (what the library was built from) while
cffi's layouts come from v2 (what stale or wrong bindings would say).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import cffi
import pytest

from bindgen import generate as gen
from bindgen import layout
from bindgen.cparse import parse, preprocess
from bindgen.manifest import record_layout

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")


def cffi_records(tmp: Path, header_text: str, names: list[str]) -> dict:
    """Layouts as cffi computes them from a header (through bindgen's own parser)."""
    d = tmp / "cffi_side"
    d.mkdir(exist_ok=True)
    (d / "h.h").write_text(header_text)
    decls = parse(preprocess(d / "h.h", [d]))
    ffi = cffi.FFI()
    ffi.cdef(decls.cdef)
    return {n: record_layout(ffi, n) for n in names}


def c_header(tmp: Path, header_text: str) -> Path:
    """The header the C compiler sees."""
    d = tmp / "c_side"
    d.mkdir(exist_ok=True)
    (d / "h.h").write_text(header_text)
    return d


V1 = "#include <stdint.h>\nstruct s { int32_t a; int32_t b; };\n"
V2_SWAPPED = "#include <stdint.h>\nstruct s { int32_t b; int32_t a; };\n"


def test_swapped_fields_of_equal_size_are_caught(tmp_path):
    recs = cffi_records(tmp_path, V2_SWAPPED, ["struct s"])
    assert recs["struct s"]["size"] == 8  # a size check alone would pass
    with pytest.raises(layout.LayoutError) as ei:
        layout.prove(recs, ["h.h"], [c_header(tmp_path, V1)])
    msg = str(ei.value)
    assert "struct s.a: offset 0 in C but 4 in cffi" in msg
    assert "struct s.b: offset 4 in C but 0 in cffi" in msg
    assert "sizeof" not in msg


def test_a_field_replaced_by_another_of_the_same_size(tmp_path):
    v1 = "#include <stdint.h>\nstruct p { int32_t n; float x; int64_t z; };\n"
    v2 = "#include <stdint.h>\nstruct p { float x; int32_t n; int64_t z; };\n"
    recs = cffi_records(tmp_path, v2, ["struct p"])
    problems = layout.compare(recs, layout.compiler_layout(["h.h"], [c_header(tmp_path, v1)], recs))
    assert problems == ["struct p.x: offset 4 in C but 0 in cffi",
                        "struct p.n: offset 0 in C but 4 in cffi"]


def test_size_only_change_is_reported(tmp_path):
    v1 = "#include <stdint.h>\nstruct t { int32_t a; int32_t b[2]; };\n"
    v2 = "#include <stdint.h>\nstruct t { int32_t a; int32_t b[3]; };\n"
    recs = cffi_records(tmp_path, v2, ["struct t"])
    with pytest.raises(layout.LayoutError) as ei:
        layout.prove(recs, ["h.h"], [c_header(tmp_path, v1)])
    msg = str(ei.value)
    assert "struct t: sizeof is 12 in C but 16 in cffi" in msg
    assert "offset" not in msg  # every field is where cffi thinks it is


def test_a_field_the_compiler_does_not_know_fails_the_proof(tmp_path):
    v1 = "#include <stdint.h>\nstruct r { int32_t a; int32_t b; };\n"
    v2 = "#include <stdint.h>\nstruct r { int32_t a; int32_t renamed; };\n"
    recs = cffi_records(tmp_path, v2, ["struct r"])
    with pytest.raises(layout.LayoutError, match="renamed"):
        layout.prove(recs, ["h.h"], [c_header(tmp_path, v1)])


def test_correct_layouts_pass_and_count_fields(tmp_path):
    text = ("#include <stdint.h>\n#include <stdbool.h>\n"
            "struct s { int32_t a; int32_t b; };\n"
            "struct q { char c; double d; bool f; struct s inner; union { int64_t i; float g; }; };\n"
            "typedef struct { int8_t x; void * p; uint16_t arr[5]; } anon_t;\n"
            "struct bits { uint32_t lo : 3; uint32_t hi : 29; int8_t after; };\n")
    names = ["struct s", "struct q", "anon_t", "struct bits"]
    recs = cffi_records(tmp_path, text, names)
    n = layout.prove(recs, ["h.h"], [c_header(tmp_path, text)])
    assert n == sum(len(r["fields"]) for r in recs.values())
    # bit-fields have no offsetof: the probe skips them, the size still counts
    assert [f for f in recs["struct bits"]["fields"] if "bits" in f]
    assert "offsetof(struct bits, lo)" not in layout.probe_source(["h.h"], recs)


def test_record_missing_from_the_probe_output_is_reported():
    recs = {"struct gone": {"size": 4, "fields": [{"name": "a", "type": "int", "offset": 0}]}}
    assert layout.compare(recs, {}) == ["struct gone: the compiler probe did not report it"]


def test_probe_that_does_not_compile_is_a_layout_error(tmp_path):
    recs = {"struct nowhere": {"size": 4, "fields": []}}
    with pytest.raises(layout.LayoutError, match="does not compile"):
        layout.prove(recs, ["h.h"], [c_header(tmp_path, V1)])


@pytest.mark.parametrize("decl", [
    "#pragma pack(push, 1)\nstruct w { char c; int32_t v; };\n#pragma pack(pop)\n",
    "struct w { char c; int32_t v; } __attribute__((packed));\n",
    "struct w { char c; int32_t v __attribute__((aligned(16))); };\n",
])
def test_generate_refuses_layouts_the_preprocessing_loses(tmp_path, monkeypatch, capsys, decl):
    """Packing and alignment attributes vanish on the way to cffi; the proof notices.

    bindgen drops pragmas and __attribute__ (cffi cannot take them), so a header using them
    would get bindings with natural alignment. generate() must refuse to write them.
    """
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    build = tmp_path / "packed"
    (build / "include").mkdir(parents=True)
    (build / "lib").mkdir()
    (build / "include" / "llama.h").write_text("#include <stdint.h>\n" + decl + "int32_t w_v(struct w x);\n")
    (build / "impl.c").write_text('#include "llama.h"\nint32_t w_v(struct w x) { return x.v; }\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-I", str(build / "include"), "-o",
                    str(build / "lib" / "libllama.so"), str(build / "impl.c")], check=True)
    (build / "build-info.json").write_text(json.dumps({"flavor": "packed", "commit": "x", "build_number": 1}))
    assert gen.main([str(build)]) == 1
    err = capsys.readouterr().err
    assert "cffi's layout differs from the compiler's" in err
    assert "struct w.v: offset" in err
    assert not (build / "bindings").exists()
