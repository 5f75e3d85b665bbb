"""What bindgen.usage finds in code: on snippets, and on clickpaca itself."""

from __future__ import annotations

from pathlib import Path

from bindgen.usage import PACKAGE, Usage, c_type_name, scan, scan_source


def test_snippet_uses_are_found_with_their_lines():
    code = '''
ffi, lib = nat.ffi, nat.lib
x = lib.llama_decode(ctx, b)
y = self.nat.lib.LLAMA_FLASH_ATTN_TYPE_AUTO
buf = ffi.new("char[64]")
b = ffi.new("struct llama_batch *")
cb = nat.ffi.callback("ggml_log_callback", f)
fp = ffi.addressof(lib, "llama_tokenize")
p.n_ctx = 5
self.n_batch = 2
z = lib.sha256
if hasattr(p, "flash_attn_type"):
    p.flash_attn_type = 1
'''
    u = Usage()
    scan_source(code, "m.py", u)
    assert dict(u.symbols) == {"llama_decode": ["m.py:3"], "LLAMA_FLASH_ATTN_TYPE_AUTO": ["m.py:4"],
                               "llama_tokenize": ["m.py:8"]}
    assert u.types["char"] == ["m.py:5"] and u.types["struct llama_batch"] == ["m.py:6"]
    assert u.types["ggml_log_callback"] == ["m.py:7"]
    assert u.attrs["n_ctx"] == ["m.py:9"] and "n_batch" not in u.attrs  # self.* is our own state
    assert u.guards["flash_attn_type"] == ["m.py:12"]
    assert {"m.py:12", "m.py:13"} <= u.guarded and "m.py:9" not in u.guarded


def test_c_type_names():
    assert c_type_name("llama_seq_id *[]") == "llama_seq_id"
    assert c_type_name("struct llama_batch *") == "struct llama_batch"
    assert c_type_name("const char[16]") == "char"
    assert c_type_name("int (*)(int)") == "int"


def test_clickpaca_itself():
    """Every `lib.llama_*` in the package is found, at its real line."""
    u = scan()
    for path in PACKAGE.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "lib.llama_n_ctx_seq(" in line:
                assert f"{path.relative_to(PACKAGE)}:{i}" in u.symbols["llama_n_ctx_seq"]
    assert len([n for n in u.symbols if n.startswith("llama_")]) >= 40
    assert "llama_batch" in u.types and "ggml_log_callback" in u.types
    assert {"token", "pos", "seq_id", "logits", "n_ctx", "type_k"} <= set(u.attrs)
    assert all(Path(PACKAGE / p.rpartition(":")[0]).exists() for p in u.symbols["llama_decode"])
