"""bindgen on small synthetic headers: no model and no llama.cpp build needed.

A fake "build" is assembled in tmp_path (include/llama.h = a synthetic header written
here, lib/libllama.so = its implementation compiled with the C compiler, build-info.json),
then `bindgen.generate.generate` turns it into the same artefacts a real build gets: the
out-of-line cffi ABI module, the manifest and the change report. The tests call C through
that generated module, and check values and layouts against the compiler.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import cffi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bindgen import generate as gen
from bindgen import layout
from bindgen.cparse import BindgenError, ConstEval, integer_macros, parse, preprocess
from bindgen.report import build_report, compare, render_text

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

# The synthetic header imitates llama.h's idioms: export/deprecation macros defined with
# __attribute__ under __GNUC__, extern "C", typedefs repeated identically, static const
# integers, constant expressions in enum values and array bounds, records passed by value,
# anonymous unions, bool fields and returns, callback typedefs and callback fields.
HEADER = r"""
#ifndef SYN_H
#define SYN_H

#include <stdint.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdarg.h>

#ifdef SYN_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        define SYN_API __declspec(dllexport)
#    else
#        define SYN_API __attribute__ ((visibility ("default")))
#    endif
#else
#    define SYN_API
#endif

#ifdef __GNUC__
#    define SYN_DEPRECATED(func, hint) func __attribute__((deprecated(hint)))
#elif defined(_MSC_VER)
#    define SYN_DEPRECATED(func, hint) __declspec(deprecated(hint)) func
#else
#    define SYN_DEPRECATED(func, hint) func
#endif

#define SYN_WORDS (64 / sizeof(int32_t))

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t syn_token;
typedef int32_t syn_token;              /* repeated identically, as llama.h/ggml.h do */
typedef struct syn_model syn_model;     /* opaque */
typedef struct syn_model syn_model;

static const int SYN_X = 3;
static const int SYN_NEG = -2;
static const int SYN_HEX = 0x10 + 3;
static const float SYN_NOT_AN_INT = 0.5f;

enum syn_flags {
    SYN_A = -1,
    SYN_B = 1 << 4,
    SYN_C = SYN_B | 3,
    SYN_D = sizeof(int32_t) * 2,
    SYN_E,                              /* implicit: previous + 1 */
    SYN_F = (SYN_C > SYN_B) ? ~0 : 7,
    SYN_G = SYN_D * 10 - '0',
};

typedef enum {
    SYN_MODE_OFF  = 0,
    SYN_MODE_ON   = 0x7fffffff,
} syn_mode;

struct syn_point { int32_t x; int32_t y; };

struct syn_inner {
    int8_t tag;
    double weight;
};

struct syn_outer {
    char c;
    struct syn_inner inner;
    union {
        int64_t i;
        float   f;
    };
    bool flag;
    int32_t a[64 / sizeof(int32_t)];
    int16_t b[SYN_WORDS / 2 + 3];
    uint8_t tail;
};

typedef bool (*syn_callback)(int32_t value, void * user_data);
typedef void (*syn_log_callback)(int level, const char * text, void * user_data);

typedef struct syn_params {
    int32_t         n_ctx;
    float           scale;
    syn_mode        mode;
    syn_callback    progress;
    void *          progress_user_data;
    const char *    name;
    bool            use_a;
    bool            use_b;
    uint64_t        seed;
    bool            use_c;
} syn_params;

typedef struct {                        /* anonymous struct behind a typedef, like llama_batch */
    int32_t       n;
    syn_token   * tokens;
    int8_t      * flags;
} syn_batch;

SYN_API struct syn_point syn_add(struct syn_point p, struct syn_point q);
SYN_API syn_params       syn_default_params(void);
SYN_API int64_t          syn_params_digest(syn_params p);
SYN_API bool             syn_is_even(int32_t v);
SYN_API int32_t          syn_call(syn_callback cb, void * user_data, int32_t v);
SYN_API int32_t          syn_progress(syn_params p, int32_t steps);
SYN_API double           syn_sum_outer(const struct syn_outer * restrict o);
SYN_API void             syn_fill_outer(struct syn_outer * o);
SYN_API int32_t          syn_batch_sum(syn_batch batch);
SYN_API syn_model *      syn_model_new(int32_t n);
SYN_API int32_t          syn_model_n(const syn_model * m);
SYN_API void             syn_model_free(syn_model * m);
SYN_API void             syn_vlog(const char * fmt, va_list args);
SYN_API int32_t          syn_mode_value(syn_mode m);
SYN_API int32_t          syn_declared_only(void);  /* no library defines it */

SYN_DEPRECATED(SYN_API int32_t syn_old(int32_t v), "use syn_add instead");
SYN_DEPRECATED(SYN_API syn_model * syn_old_model(int32_t n),
        "use syn_model_new instead");

static inline int32_t syn_twice(int32_t v) { return 2 * v; }

#ifdef __cplusplus
}
#endif

#endif
"""

IMPL = r"""
#define SYN_SHARED
#include "llama.h"
#include <stdlib.h>

struct syn_model { int32_t n; };

struct syn_point syn_add(struct syn_point p, struct syn_point q) {
    struct syn_point r = { p.x + q.x, p.y + q.y };
    return r;
}
syn_params syn_default_params(void) {
    syn_params p = { 512, 1.5f, SYN_MODE_ON, NULL, NULL, "syn", true, false, 0xDEADBEEFCAFEull, true };
    return p;
}
int64_t syn_params_digest(syn_params p) {
    return (int64_t)p.n_ctx * 1000000 + (int64_t)(p.scale * 1000) * 100
         + (p.use_a ? 1 : 0) * 4 + (p.use_b ? 1 : 0) * 2 + (p.use_c ? 1 : 0)
         + (p.mode == SYN_MODE_ON ? 10 : 0) + (int64_t)(p.seed % 7) * 20;
}
bool syn_is_even(int32_t v) { return v % 2 == 0; }
int32_t syn_call(syn_callback cb, void * user_data, int32_t v) {
    int32_t n = 0;
    for (int32_t i = 0; i < v; i++) { if (cb(i, user_data)) n++; }
    return n;
}
int32_t syn_progress(syn_params p, int32_t steps) {
    int32_t n = 0;
    for (int32_t i = 0; i < steps; i++) {
        if (p.progress && !p.progress(i, p.progress_user_data)) break;
        n++;
    }
    return n;
}
double syn_sum_outer(const struct syn_outer * restrict o) {
    double s = o->c + o->inner.tag + o->inner.weight + (double)o->f + (o->flag ? 1000 : 0) + o->tail;
    for (int k = 0; k < 16; k++) s += o->a[k] * (k + 1);
    for (int k = 0; k < (int)(SYN_WORDS / 2 + 3); k++) s += o->b[k];
    return s;
}
void syn_fill_outer(struct syn_outer * o) {
    o->c = 'c'; o->inner.tag = -5; o->inner.weight = 0.25; o->i = -42; o->flag = true;
    for (int k = 0; k < 16; k++) o->a[k] = 100 + k;
    for (int k = 0; k < (int)(SYN_WORDS / 2 + 3); k++) o->b[k] = -k;
    o->tail = 200;
}
int32_t syn_batch_sum(syn_batch batch) {
    int32_t s = 0;
    for (int32_t k = 0; k < batch.n; k++) if (batch.flags[k]) s += batch.tokens[k];
    return s;
}
syn_model * syn_model_new(int32_t n) { syn_model * m = malloc(sizeof *m); m->n = n; return m; }
int32_t syn_model_n(const syn_model * m) { return m->n; }
void syn_model_free(syn_model * m) { free(m); }
void syn_vlog(const char * fmt, va_list args) { (void)fmt; (void)args; }
int32_t syn_mode_value(syn_mode m) { return (int32_t)m; }
int32_t syn_old(int32_t v) { return v + 1; }
syn_model * syn_old_model(int32_t n) { return syn_model_new(n); }
"""


# ---------------------------------------------------------------- helpers


def make_build(root: Path, header: str = HEADER, impl: str | None = IMPL, flavor: str = "synthetic",
               commit: str = "abc123", build_number: int = 7) -> Path:
    """A directory shaped like builds/<name>: include/llama.h, lib/libllama.so, build-info.json."""
    build = root / flavor
    (build / "include").mkdir(parents=True)
    (build / "lib").mkdir()
    (build / "include" / "llama.h").write_text(header)
    (build / "build-info.json").write_text(json.dumps(
        {"flavor": flavor, "commit": commit, "build_number": build_number}))
    if impl is None:  # a header the C compiler refuses: no library
        return build
    (build / "impl.c").write_text(impl)
    proc = subprocess.run(["gcc", "-std=c11", "-O1", "-shared", "-fPIC", "-Wall",
                           "-Wno-deprecated-declarations", "-I", str(build / "include"),
                           "-o", str(build / "lib" / "libllama.so"), str(build / "impl.c")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return build


def import_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def c_values(include: Path, exprs: list[str], header: str = "llama.h") -> list[int]:
    """What the C compiler says each integer expression is, after including the header."""
    src = include.parent / "values.c"
    exe = include.parent / "values"
    body = "\n".join(f'    printf("%lld\\n", (long long)({e}));' for e in exprs)
    src.write_text(f'#include <stdio.h>\n#include "{header}"\nint main(void) {{\n{body}\n    return 0;\n}}\n')
    subprocess.run(["gcc", "-std=c11", "-w", "-I", str(include), "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """Generate the synthetic build's bindings once; yield (build, manifest, ffi, lib, module)."""
    root = tmp_path_factory.mktemp("synth")
    build = make_build(root)
    mp = pytest.MonkeyPatch()
    mp.setenv("CLICKPACA_CACHE", str(root / "cache"))
    try:
        manifest = gen.generate(build, quiet=True)
    finally:
        mp.undo()
    module = import_module(build / "bindings" / "_llama_cffi.py", "_synthetic_llama_cffi")
    lib = module.ffi.dlopen(str(build / "lib" / "libllama.so"))
    return build, manifest, module.ffi, lib, module


# ---------------------------------------------------------------- the artefacts


def test_generate_writes_module_manifest_and_report(synth):
    build, manifest, ffi, lib, module = synth
    out = build / "bindings"
    assert sorted(p.name for p in out.iterdir()) == ["_llama_cffi.py", "changes.json", "changes.txt",
                                                    "manifest.json"]
    assert out.stat().st_mode & 0o755 == 0o755  # readable by others (mkdtemp alone gives 0700)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert "(no previous manifest)" in (out / "changes.txt").read_text()
    # out-of-line ABI mode: no C compiler at import time, the module is plain Python
    src = (out / "_llama_cffi.py").read_text()
    assert "_cffi_backend.FFI(" in src and "set_source" not in src


def test_stamp_identifies_the_build(synth):
    build, manifest, ffi, lib, module = synth
    stamp = json.loads(module.STAMP)
    assert stamp == manifest["stamp"]
    assert stamp["flavor"] == "synthetic" and stamp["commit"] == "abc123" and stamp["build_number"] == 7
    assert stamp["llama_h_sha256"] == hashlib.sha256((build / "include" / "llama.h").read_bytes()).hexdigest()
    assert stamp["libllama_sha256"] == hashlib.sha256((build / "lib" / "libllama.so").read_bytes()).hexdigest()
    assert stamp["bindgen_version"] == gen.BINDGEN_VERSION


def test_manifest_lists_everything(synth):
    build, manifest, ffi, lib, module = synth
    assert set(manifest["functions"]) == {
        "syn_add", "syn_default_params", "syn_params_digest", "syn_is_even", "syn_call",
        "syn_progress", "syn_sum_outer", "syn_fill_outer", "syn_batch_sum", "syn_model_new",
        "syn_model_n", "syn_model_free", "syn_mode_value", "syn_old", "syn_old_model"}
    assert set(manifest["records"]) == {"struct syn_point", "struct syn_inner", "struct syn_outer",
                                        "struct syn_params", "syn_batch"}
    assert set(manifest["callbacks"]) == {"syn_callback", "syn_log_callback"}
    assert manifest["skipped"]["syn_vlog"] == "takes a va_list"
    assert manifest["skipped"]["syn_twice"] == "inline function body"
    assert "not an integer" in manifest["skipped"]["SYN_NOT_AN_INT"]
    assert manifest["skipped"]["syn_declared_only"] == "declared in the header but exported by no library"
    with pytest.raises((AttributeError, ffi.error)):
        lib.syn_declared_only
    for name in manifest["functions"]:
        assert hasattr(lib, name), name


# ---------------------------------------------------------------- calls


def test_struct_by_value_argument_and_return(synth):
    build, manifest, ffi, lib, module = synth
    p = ffi.new("struct syn_point *", {"x": 3, "y": -4})
    q = ffi.new("struct syn_point *", {"x": 10, "y": 20})
    r = lib.syn_add(p[0], q[0])
    assert ffi.typeof(r) is ffi.typeof("struct syn_point")
    assert (r.x, r.y) == (13, 16)


def test_large_struct_returned_and_passed_by_value(synth):
    """Like llama_model_default_params(): a struct with bools, enums, pointers, a callback."""
    build, manifest, ffi, lib, module = synth
    p = lib.syn_default_params()
    assert (p.n_ctx, p.scale, p.mode) == (512, 1.5, lib.SYN_MODE_ON)
    assert ffi.string(p.name) == b"syn"
    assert p.progress == ffi.NULL
    assert (p.use_a, p.use_b, p.use_c) == (True, False, True)
    assert p.seed == 0xDEADBEEFCAFE
    expected = 512 * 1000000 + 1500 * 100 + 4 + 0 + 1 + 10 + (0xDEADBEEFCAFE % 7) * 20
    assert lib.syn_params_digest(p) == expected
    p.use_a, p.use_b, p.use_c, p.n_ctx = False, True, False, 1
    assert lib.syn_params_digest(p) == 1000000 + 1500 * 100 + 2 + 10 + (0xDEADBEEFCAFE % 7) * 20


def test_bool_returns_are_python_bools(synth):
    build, manifest, ffi, lib, module = synth
    assert lib.syn_is_even(4) is True
    assert lib.syn_is_even(-3) is False
    assert manifest["functions"]["syn_is_even"].startswith("_Bool syn_is_even")


def test_callback_typedef_called_from_c(synth):
    build, manifest, ffi, lib, module = synth
    seen = []

    def on_value(value, user_data):
        seen.append((value, ffi.from_handle(user_data)))
        return value % 3 == 0

    handle = ffi.new_handle("ctx")
    cb = ffi.callback("syn_callback", on_value)
    assert lib.syn_call(cb, handle, 7) == 3  # 0, 3, 6
    assert seen == [(i, "ctx") for i in range(7)]


def test_callback_in_a_struct_field(synth):
    """Like llama_model_params.progress_callback: a callback stored in a by-value struct."""
    build, manifest, ffi, lib, module = synth
    calls = []

    @ffi.callback("syn_callback")
    def stop_at_five(value, user_data):
        calls.append(value)
        return value < 5

    p = lib.syn_default_params()
    p.progress = stop_at_five
    assert lib.syn_progress(p, 100) == 5
    assert calls == [0, 1, 2, 3, 4, 5]


def test_nested_struct_anonymous_union_arrays_and_bool_field(synth):
    build, manifest, ffi, lib, module = synth
    o = ffi.new("struct syn_outer *")
    lib.syn_fill_outer(o)  # C writes, Python reads
    assert (o.c, o.inner.tag, o.inner.weight, o.i, o.flag, o.tail) == (b"c", -5, 0.25, -42, True, 200)
    assert list(o.a) == [100 + k for k in range(16)]
    assert list(o.b) == [-k for k in range(11)]
    # Python writes, C reads (the union member f aliases i)
    o2 = ffi.new("struct syn_outer *")
    o2.c, o2.inner.tag, o2.inner.weight, o2.f, o2.flag, o2.tail = b"\x01", 2, 0.5, 4.0, True, 7
    for k in range(16):
        o2.a[k] = k
    o2.b[10] = 9
    expected = 1 + 2 + 0.5 + 4.0 + 1000 + 7 + sum(k * (k + 1) for k in range(16)) + 9
    assert lib.syn_sum_outer(o2) == expected


def test_array_bounds_from_constant_expressions(synth):
    build, manifest, ffi, lib, module = synth
    fields = {f["name"]: f for f in manifest["records"]["struct syn_outer"]["fields"]}
    assert fields["a"]["type"] == "int32_t[16]"
    assert fields["b"]["type"] == "int16_t[11]"
    assert ffi.sizeof(ffi.typeof(o := ffi.new("struct syn_outer *")).item.fields[5][1].type) == 64
    assert len(o.a) == 16 and len(o.b) == 11
    decls = parse(preprocess(build / "include" / "llama.h", [build / "include"]))
    assert "int32_t a[16];" in decls.cdef and "int16_t b[11];" in decls.cdef


def test_anonymous_union_members_share_an_offset(synth):
    build, manifest, ffi, lib, module = synth
    fields = {f["name"]: f for f in manifest["records"]["struct syn_outer"]["fields"]}
    assert fields["i"]["offset"] == fields["f"]["offset"]
    assert fields["inner"]["type"] == "struct syn_inner"


def test_typedef_of_anonymous_struct_by_value(synth):
    """Like llama_batch: an anonymous struct behind a typedef, passed by value."""
    build, manifest, ffi, lib, module = synth
    tokens = ffi.new("syn_token[]", [5, 6, 7, 8])
    flags = ffi.new("int8_t[]", [1, 0, 1, 0])
    b = ffi.new("syn_batch *", {"n": 4, "tokens": tokens, "flags": flags})
    assert lib.syn_batch_sum(b[0]) == 12


def test_opaque_type_and_deprecated_functions(synth):
    build, manifest, ffi, lib, module = synth
    m = lib.syn_model_new(11)
    assert lib.syn_model_n(m) == 11
    lib.syn_model_free(m)
    m = lib.syn_old_model(12)  # a DEPRECATED(...) declaration spanning two lines
    assert lib.syn_model_n(m) == 12
    lib.syn_model_free(m)
    assert lib.syn_old(41) == 42
    assert manifest["functions"]["syn_old"] == "int32_t syn_old(int32_t v)"
    assert "struct syn_model" not in manifest["records"]  # opaque: no layout to record


# ---------------------------------------------------------------- values and layouts vs the compiler


ENUM_EXPECTED = {"SYN_A": -1, "SYN_B": 16, "SYN_C": 19, "SYN_D": 8, "SYN_E": 9, "SYN_F": -1,
                 "SYN_G": 80 - ord("0")}


def test_enum_values_match_expectations_and_the_compiler(synth):
    build, manifest, ffi, lib, module = synth
    assert manifest["enums"]["syn_flags"] == ENUM_EXPECTED
    for name, value in ENUM_EXPECTED.items():
        assert getattr(lib, name) == value
    names = list(ENUM_EXPECTED) + ["SYN_MODE_OFF", "SYN_MODE_ON"]
    assert c_values(build / "include", names) == [getattr(lib, n) for n in names]
    anon = [v for k, v in manifest["enums"].items() if k.startswith("<anonymous")]
    assert anon == [{"SYN_MODE_OFF": 0, "SYN_MODE_ON": 0x7FFFFFFF}]
    assert lib.syn_mode_value(lib.SYN_MODE_ON) == 0x7FFFFFFF


def test_static_const_integers_become_constants(synth):
    build, manifest, ffi, lib, module = synth
    assert manifest["constants"] == {"SYN_X": 3, "SYN_NEG": -2, "SYN_HEX": 19}
    assert (lib.SYN_X, lib.SYN_NEG, lib.SYN_HEX) == (3, -2, 19)
    assert c_values(build / "include", ["SYN_X", "SYN_NEG", "SYN_HEX"]) == [3, -2, 19]


def test_every_record_layout_matches_the_compiler(synth):
    """The layout proof ran inside generate(); check its result independently too."""
    build, manifest, ffi, lib, module = synth
    c = layout.compiler_layout(["llama.h"], [build / "include"], manifest["records"])
    for name, rec in manifest["records"].items():
        assert c[name]["size"] == rec["size"] == ffi.sizeof(name), name
        for f in rec["fields"]:
            assert c[name]["fields"][f["name"]] == f["offset"], (name, f["name"])
            assert ffi.offsetof(name, f["name"]) == f["offset"]
    sizes = c_values(build / "include", [f"sizeof({n})" for n in manifest["records"]])
    assert sizes == [rec["size"] for rec in manifest["records"].values()]
    bools = c_values(build / "include", ["offsetof(struct syn_params, use_a)",
                                         "offsetof(struct syn_params, use_b)",
                                         "offsetof(struct syn_params, use_c)",
                                         "sizeof(((struct syn_params *)0)->use_b)"])
    fields = {f["name"]: f for f in manifest["records"]["struct syn_params"]["fields"]}
    assert bools == [fields["use_a"]["offset"], fields["use_b"]["offset"], fields["use_c"]["offset"], 1]


def test_cdef_is_plain(synth):
    """What cffi receives has no attributes, no restrict, no expressions left to evaluate."""
    build, manifest, ffi, lib, module = synth
    decls = parse(preprocess(build / "include" / "llama.h", [build / "include"]))
    for bad in ("__attribute__", "deprecated", "restrict", "visibility", "sizeof", "<<", "va_list"):
        assert bad not in decls.cdef, bad
    assert decls.cdef.count("typedef int32_t syn_token;") == 1
    assert decls.cdef.count("typedef struct syn_model syn_model;") == 1
    assert "#define SYN_X 3" in decls.cdef


# ---------------------------------------------------------------- errors and reports


def test_two_different_typedefs_of_one_name_are_an_error(tmp_path):
    (tmp_path / "bad.h").write_text("#include <stdint.h>\ntypedef int32_t tok;\ntypedef int64_t tok;\n")
    with pytest.raises(BindgenError, match="typedef tok declared twice, differently"):
        parse(preprocess(tmp_path / "bad.h", [tmp_path]))


def test_different_typedefs_fail_generate_without_writing_bindings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    header = HEADER.replace("typedef int32_t syn_token;              /*",
                            "typedef int64_t syn_token;              /*")
    build = make_build(tmp_path, header=header, impl=None)  # C refuses it too; bindgen must say so
    assert gen.main([str(build)]) == 1
    assert "syn_token declared twice, differently" in capsys.readouterr().err
    assert not (build / "bindings").exists()


def test_unknown_constant_is_an_error(tmp_path):
    (tmp_path / "bad.h").write_text("struct s { int a[N_UNKNOWN]; };\n")
    with pytest.raises(BindgenError, match="N_UNKNOWN"):
        parse(preprocess(tmp_path / "bad.h", [tmp_path]))


def _v2(tmp_path: Path, commit: str = "def456", build_number: int = 8) -> Path:
    """The synthetic build one version later: a field and an enum value added, a function
    removed and one added."""
    header = (HEADER
              .replace("    syn_mode        mode;\n", "    syn_mode        mode;\n    void *          n_new;\n")
              .replace("    SYN_E,", "    SYN_E,\n    SYN_NEWVAL = 99,")
              .replace("SYN_API bool             syn_is_even(int32_t v);\n", "")
              .replace("SYN_API int32_t          syn_mode_value(syn_mode m);",
                       "SYN_API int32_t          syn_mode_value(syn_mode m);\n"
                       "SYN_API int32_t          syn_added(void);"))
    impl = (IMPL.replace("bool syn_is_even(int32_t v) { return v % 2 == 0; }\n", "")
            .replace('SYN_MODE_ON, NULL, NULL, "syn"', 'SYN_MODE_ON, NULL, NULL, NULL, "syn"')
            + "int32_t syn_added(void) { return 1; }\n")
    return make_build(tmp_path / f"v-{commit}", header=header, impl=impl, commit=commit,
                      build_number=build_number)


def test_change_report_against_a_previous_manifest(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    old = make_build(tmp_path / "v1")
    assert gen.main([str(old)]) == 0
    new = _v2(tmp_path)
    # second generation of the same flavor: reported against the first (kept in the cache)
    assert gen.main([str(new), "--full"]) == 0
    report = (new / "bindings" / "changes.txt").read_text()
    assert report.startswith("Change report: b7 (synthetic abc123) -> b8 (synthetic def456)")
    printed = capsys.readouterr().out
    assert "synthetic commit" not in printed
    full = printed[printed.index("Change report:"):]
    # syn_* is not the llama API: summarised in one line, listed with --full
    assert "ggml/gguf internals: 1 added, 1 removed, 0 renamed, 2 changed, 7 fields moved" in report
    assert "nothing affected" in report.splitlines()[1]
    assert "syn_added" not in report
    assert "+ functions (1): syn_added" in full
    assert "- functions (1): syn_is_even" in full
    assert "+n_new (void *)" in full and "seed @48->56" in full and "size 64 -> 72" in full
    data = json.loads((new / "bindings" / "changes.json").read_text())
    assert data["from"]["commit"] == "abc123" and data["to"]["commit"] == "def456"
    assert data["api"]["internals"]["enums"]["changed"][0]["added"] == {"SYN_NEWVAL": 99}
    # regenerating either version never turns a report into "no previous manifest" or
    # into a report against itself: history is per (flavor, commit), the report old -> new
    assert gen.main([str(old)]) == 0
    assert (old / "bindings" / "changes.txt").read_text() == report
    assert gen.main([str(new)]) == 0
    assert (new / "bindings" / "changes.txt").read_text() == report
    # --against an explicit manifest, or a build directory
    assert gen.main([str(new), "--against", str(new / "bindings" / "manifest.json")]) == 0
    assert "0 added, 0 removed" in (new / "bindings" / "changes.txt").read_text()


def test_report_runs_from_the_older_version_whichever_is_the_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    old = make_build(tmp_path / "v1")
    new = _v2(tmp_path)
    assert gen.main([str(new)]) == 0
    # the old build reported against the newer one: still old -> new
    assert gen.main([str(old), "--against", str(new)]) == 0
    report = (old / "bindings" / "changes.txt").read_text()
    assert report.startswith("Change report: b7 (synthetic abc123) -> b8 (synthetic def456)")
    assert json.loads((old / "bindings" / "changes.json").read_text())["from"]["build_number"] == 7


def test_report_is_deterministic_across_processes():
    """Added/removed fields come out sorted, not in set order (which PYTHONHASHSEED changes)."""
    import sys
    code = ("import json; from bindgen.report import compare\n"
            "f = lambda names: {'size': 8, 'fields': [{'name': n, 'type': 'int', 'offset': 0} for n in names]}\n"
            "a = {'records': {'struct llama_s': f(['keep', 'gone1', 'gone2', 'gone3', 'gone4'])}}\n"
            "b = {'records': {'struct llama_s': f(['keep', 'new1', 'new2', 'new3', 'new4'])}}\n"
            "print(json.dumps(compare(a, b)))")
    root = Path(__file__).resolve().parent.parent
    outs = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}).stdout
            for seed in range(6)}
    assert len(outs) == 1
    rec = json.loads(outs.pop())["llama"]["records"]["changed"][0]
    assert [x["name"] for x in rec["fields_added"]] == [f"new{i}" for i in range(1, 5)]
    assert [x["name"] for x in rec["fields_removed"]] == [f"gone{i}" for i in range(1, 5)]


def test_report_of_identical_manifests():
    m = {"stamp": {"flavor": "a", "commit": "x", "build_number": 1},
         "functions": {"f": "int f(void)"}, "records": {}, "enums": {}}
    rep = build_report(m, m)
    assert rep["ours"] == []
    assert all(v == [] for area in rep["api"].values() for kind in area.values() for v in kind.values())
    assert "0 added, 0 removed, 0 renamed, 0 changed" in render_text(rep)


# ---------------------------------------------------------------- constant expressions


def _c_int(v: int) -> bool:
    return -(2 ** 31) < v < 2 ** 31


@st.composite
def int_expr(draw, depth=3):
    """A C integer constant expression with no undefined behaviour in 32-bit int."""
    if depth == 0 or draw(st.booleans()):
        v = draw(st.integers(-50, 50))
        return (f"({v})" if v < 0 else str(v)), v
    kind = draw(st.sampled_from(["bin", "un", "tern", "shift", "div"]))
    a, va = draw(int_expr(depth=depth - 1))
    if kind == "un":
        op = draw(st.sampled_from(["-", "~", "!", "+"]))
        v = {"-": -va, "~": ~va, "!": int(not va), "+": va}[op]
        return f"({op}{a})", v
    b, vb = draw(int_expr(depth=depth - 1))
    if kind == "bin":
        op = draw(st.sampled_from(["+", "-", "*", "|", "&", "^", "<", ">", "<=", ">=", "==", "!=",
                                   "&&", "||"]))
        v = {"+": va + vb, "-": va - vb, "*": va * vb, "|": va | vb, "&": va & vb, "^": va ^ vb,
             "<": va < vb, ">": va > vb, "<=": va <= vb, ">=": va >= vb, "==": va == vb,
             "!=": va != vb, "&&": bool(va) and bool(vb), "||": bool(va) or bool(vb)}[op]
        v = int(v)
        if not _c_int(v):
            return a, va
        return f"({a} {op} {b})", v
    if kind == "tern":
        c, vc = draw(int_expr(depth=depth - 1))
        return f"({c} ? {a} : {b})", (va if vc else vb)
    if kind == "shift":
        n = draw(st.integers(0, 8))
        op = draw(st.sampled_from(["<<", ">>"]))
        if op == "<<" and (va < 0 or not _c_int(va << n)):
            return a, va
        return f"({a} {op} {n})", (va << n if op == "<<" else va >> n)
    # C division and remainder truncate toward zero
    if vb == 0:
        return a, va
    op = draw(st.sampled_from(["/", "%"]))
    q = abs(va) // abs(vb) * (1 if (va < 0) == (vb < 0) else -1)
    return f"({a} {op} {b})", (q if op == "/" else va - vb * q)


# (a list here replaces the profile's, so too_slow is named again: timing is no failure)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(int_expr(), min_size=1, max_size=12))
def test_constant_expressions_evaluate_like_c(tmp_path_factory, exprs):
    """Enum values written as expressions come out as the C compiler computes them."""
    d = tmp_path_factory.mktemp("expr")
    body = ",\n".join(f"    E{i} = {e}" for i, (e, _) in enumerate(exprs))
    (d / "e.h").write_text(f"enum e {{\n{body}\n}};\n")
    decls = parse(preprocess(d / "e.h", [d]))
    ours = [decls.enums["e"][f"E{i}"] for i in range(len(exprs))]
    assert ours == [v for _, v in exprs]
    assert c_values(d, [f"E{i}" for i in range(len(exprs))], "e.h") == ours


def test_division_and_remainder_truncate_like_c(tmp_path):
    (tmp_path / "d.h").write_text(
        "enum d { D1 = -7 / 2, D2 = -7 % 3, D3 = 7 % -3, D4 = (1L << 62) / 3, D5 = -(1L << 62) % 5 };\n")
    decls = parse(preprocess(tmp_path / "d.h", [tmp_path]))
    expected = c_values(tmp_path, ["D1", "D2", "D3", "D4", "D5"], "d.h")
    assert expected[:3] == [-3, -1, 1]
    assert list(decls.enums["d"].values()) == expected


def test_const_eval_sizeof_and_char_literals():
    ev = ConstEval()
    from pycparser import c_parser
    ast = c_parser.CParser().parse(
        "typedef int int32_t; typedef long int64_t; typedef unsigned long size_t;\n"
        "int x[sizeof(int64_t) + sizeof(char*) + sizeof(size_t) + 'A' + '\\n'];")
    assert ev(ast.ext[-1].type.dim) == 8 + 8 + 8 + 65 + 10


def test_cffi_accepts_the_generated_cdef_twice(synth):
    """The cdef is self-contained: a fresh FFI accepts it with no extra declarations."""
    build, manifest, ffi, lib, module = synth
    decls = parse(preprocess(build / "include" / "llama.h", [build / "include"]))
    f = cffi.FFI()
    f.cdef(decls.cdef)
    assert f.sizeof("struct syn_outer") == manifest["records"]["struct syn_outer"]["size"]


# ---------------------------------------------------------------- optional headers (ggml-rpc.h)

RPC_HEADER = r"""
#pragma once
#include "llama.h"
#define SYN_RPC_MAJOR 7
#define SYN_RPC_MINOR   0x10u  // a comment after the value
#define SYN_RPC_NEG -3
#define SYN_RPC_EXPR (1 << 4)
#define SYN_RPC_GUARD
SYN_API int32_t syn_rpc_version(void);
SYN_API struct syn_point syn_rpc_where(const char * endpoint);
"""

RPC_IMPL = r"""
#include "ggml-rpc.h"
int32_t syn_rpc_version(void) { return SYN_RPC_MAJOR; }
struct syn_point syn_rpc_where(const char * endpoint) { struct syn_point p = {(int32_t)endpoint[0], 9}; return p; }
"""


def test_integer_macros_read_from_the_text():
    text = ("#define A 7\n#  define B 0x1Fu\n#define C -2 /* c */\n#define D (1 << 2)\n"
            "#define E\n#define F(x) (x)\n#define G 010\n  #define H 5UL // h\n")
    assert integer_macros(text) == {"A": 7, "B": 31, "C": -2, "G": 8, "H": 5}


def test_an_optional_header_present_is_bound_with_its_integer_macros(tmp_path, monkeypatch):
    """A build whose include/ has ggml-rpc.h: its functions and integer #defines come
    through the generated module and are callable; llama.h's own declarations stay."""
    build = make_build(tmp_path, impl=None)
    (build / "include" / "ggml-rpc.h").write_text(RPC_HEADER)
    (build / "impl.c").write_text(IMPL + RPC_IMPL)
    subprocess.run(["gcc", "-std=c11", "-O1", "-shared", "-fPIC", "-w", "-I", str(build / "include"),
                    "-o", str(build / "lib" / "libllama.so"), str(build / "impl.c")],
                   check=True, capture_output=True, text=True)
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path / "cache"))
    manifest = gen.generate(build, quiet=True)
    assert {"syn_rpc_version", "syn_rpc_where", "syn_add"} <= set(manifest["functions"])
    assert {"SYN_RPC_MAJOR": 7, "SYN_RPC_MINOR": 16, "SYN_RPC_NEG": -3}.items() <= manifest["constants"].items()
    assert "SYN_RPC_EXPR" not in manifest["constants"] and "SYN_RPC_GUARD" not in manifest["constants"]
    assert set(manifest["stamp"]["headers"]) == {"llama.h", "ggml-rpc.h"}
    module = import_module(build / "bindings" / "_llama_cffi.py", "_synthetic_rpc_cffi")
    lib = module.ffi.dlopen(str(build / "lib" / "libllama.so"))
    assert lib.syn_rpc_version() == lib.SYN_RPC_MAJOR == 7
    p = lib.syn_rpc_where(b"A:1")
    assert (p.x, p.y) == (65, 9)


def test_without_the_optional_header_only_llama_h_is_bound(synth):
    build, manifest, ffi, lib, module = synth
    assert list(manifest["stamp"]["headers"]) == ["llama.h"]
    assert not any(name.startswith("SYN_RPC") for name in manifest["constants"])
