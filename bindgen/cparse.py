"""C header -> plain declarations that cffi accepts.

The C preprocessor expands the header (with stand-in libc headers from stubs/, so the
result is plain C that pycparser reads), pycparser parses it, and this module rewrites
the few things cffi's ABI mode refuses: repeated identical typedefs, constant
expressions in array bounds and enum values (evaluated here to plain integers),
initialised `static const` values (turned into `#define` integer constants), `restrict`
qualifiers, inline function bodies and functions taking a `va_list`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
from pathlib import Path

from pycparser import c_ast, c_generator, c_parser

STUBS = Path(__file__).resolve().parent / "stubs"

# Sizes of the base types on the platforms we build for (LP64: Linux and macOS x86-64/arm64).
BASE_SIZES = {
    "char": 1, "signed char": 1, "unsigned char": 1, "_Bool": 1, "bool": 1,
    "short": 2, "unsigned short": 2, "short int": 2, "unsigned short int": 2,
    "int": 4, "unsigned int": 4, "unsigned": 4, "float": 4,
    "long": 8, "unsigned long": 8, "long int": 8, "unsigned long int": 8,
    "long long": 8, "unsigned long long": 8, "double": 8,
    "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4,
    "int64_t": 8, "uint64_t": 8, "size_t": 8, "ptrdiff_t": 8, "intptr_t": 8, "uintptr_t": 8,
}


class BindgenError(RuntimeError):
    """The header contains something bindgen cannot turn into a cffi declaration."""


@dataclasses.dataclass
class Declarations:
    """The result of parsing: cdef text plus what the manifest needs."""

    cdef: str
    functions: dict[str, str]  # name -> C prototype
    enums: dict[str, dict[str, int]]  # enum name ('' for anonymous) -> enumerator -> value
    records: list[str]  # "struct X" / "union X" / typedef names of complete records
    constants: dict[str, int]
    callbacks: dict[str, str]  # typedef name -> C declaration of a function pointer type
    skipped: dict[str, str]  # name -> why it was left out
    # name -> prototype without parameter names: tells a real signature change from a
    # renamed parameter, and finds a renamed function by its unchanged signature
    signatures: dict[str, str] = dataclasses.field(default_factory=dict)


def preprocess(header: Path, include_dirs: list[Path], cc: str | None = None) -> str:
    """Run the C preprocessor with the stand-in libc headers and no compiler extensions."""
    cc = cc or os.environ.get("CC", "gcc")
    cmd = [cc, "-E", "-std=c11", "-nostdinc", "-I", str(STUBS)]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    cmd += ["-U__GNUC__", "-U__clang__", "-D__attribute__(x)=", "-D__declspec(x)=",
            "-D__restrict=", "-D__inline=", "-D__asm__(x)=", str(header)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BindgenError(f"preprocessing {header} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


_DEPRECATED = re.compile(
    r"DEPRECATED\(\s*(?:[A-Z_]+_API\s+)?[^;]*?\b(\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*,\s*\"([^\"]*)\"\s*\)")


def deprecations(header_text: str) -> dict[str, str]:
    """Function -> the hint of its DEPRECATED(...) declaration ("use llama_model_free
    instead"): the preprocessor drops the attribute, so it is read from the header text.
    The change report names a renamed function's other name from these hints."""
    return {m.group(1): m.group(2) for m in _DEPRECATED.finditer(header_text)}


def _is_stub(node: c_ast.Node) -> bool:
    coord = getattr(node, "coord", None)
    return bool(coord and coord.file and str(STUBS) in str(Path(coord.file).resolve()))


class ConstEval:
    """Evaluates integer constant expressions: literals, enum names, sizeof of base types."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}

    def __call__(self, node: c_ast.Node) -> int:
        if isinstance(node, c_ast.Constant):
            return self._literal(node)
        if isinstance(node, c_ast.ID):
            if node.name not in self.names:
                raise BindgenError(f"unknown constant {node.name!r} at {node.coord}")
            return self.names[node.name]
        if isinstance(node, c_ast.Cast):
            return self(node.expr)
        if isinstance(node, c_ast.UnaryOp):
            if node.op == "sizeof":
                return self._sizeof(node.expr)
            v = self(node.expr)
            return {"-": -v, "+": v, "~": ~v, "!": int(not v)}[node.op]
        if isinstance(node, c_ast.BinaryOp):
            a, b = self(node.left), self(node.right)
            if node.op in ("/", "%") and b == 0:
                raise BindgenError(f"division by zero at {node.coord}")
            ops = {
                "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
                "/": lambda: _c_div(a, b), "%": lambda: a - b * _c_div(a, b), "<<": lambda: a << b,
                ">>": lambda: a >> b, "|": lambda: a | b, "&": lambda: a & b, "^": lambda: a ^ b,
                "&&": lambda: int(bool(a and b)), "||": lambda: int(bool(a or b)),
                "<": lambda: int(a < b), ">": lambda: int(a > b), "<=": lambda: int(a <= b),
                ">=": lambda: int(a >= b), "==": lambda: int(a == b), "!=": lambda: int(a != b),
            }
            return ops[node.op]()
        if isinstance(node, c_ast.TernaryOp):
            return self(node.iftrue) if self(node.cond) else self(node.iffalse)
        raise BindgenError(f"cannot evaluate {type(node).__name__} at {node.coord}")

    @staticmethod
    def _literal(node: c_ast.Constant) -> int:
        text = node.value
        if node.type == "char":
            body = text[1:-1]
            return ord(body.encode().decode("unicode_escape"))
        if node.type not in ("int", "unsigned int", "long int", "unsigned long int",
                             "long long int", "unsigned long long int"):
            raise BindgenError(f"non-integer constant {text} at {node.coord}")
        text = text.rstrip("uUlL")
        if text.lower().startswith("0x"):
            return int(text, 16)
        if text.lower().startswith("0b"):
            return int(text, 2)
        if len(text) > 1 and text.startswith("0"):
            return int(text, 8)
        return int(text)

    @staticmethod
    def _sizeof(node: c_ast.Node) -> int:
        if isinstance(node, c_ast.Typename):
            t = node.type
            if isinstance(t, c_ast.PtrDecl):
                return 8
            if isinstance(t, c_ast.TypeDecl) and isinstance(t.type, c_ast.IdentifierType):
                name = " ".join(t.type.names)
                if name in BASE_SIZES:
                    return BASE_SIZES[name]
        raise BindgenError(f"cannot evaluate sizeof at {node.coord}")


def _c_div(a: int, b: int) -> int:
    """C integer division: truncates toward zero (Python's // floors), exact for big values."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


class _Rewriter(c_ast.NodeVisitor):
    """Replaces constant expressions in array bounds and drops `restrict`."""

    def __init__(self, ev: ConstEval) -> None:
        self.ev = ev

    def visit_ArrayDecl(self, node: c_ast.ArrayDecl) -> None:
        if node.dim is not None and not isinstance(node.dim, c_ast.Constant):
            node.dim = c_ast.Constant("int", str(self.ev(node.dim)))
        node.dim_quals = [q for q in node.dim_quals if q != "restrict"]
        self.generic_visit(node)

    def visit_TypeDecl(self, node: c_ast.TypeDecl) -> None:
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_PtrDecl(self, node: c_ast.PtrDecl) -> None:
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_Enum(self, node: c_ast.Enum) -> None:
        if node.values is None:
            return
        nxt = 0
        for e in node.values.enumerators:
            value = self.ev(e.value) if e.value is not None else nxt
            e.value = c_ast.Constant("int", str(value))
            self.ev.names[e.name] = value
            nxt = value + 1


def _mentions_va_list(node: c_ast.Node) -> bool:
    found = False

    class V(c_ast.NodeVisitor):
        def visit_IdentifierType(self, n: c_ast.IdentifierType) -> None:
            nonlocal found
            if "va_list" in n.names:
                found = True

    V().visit(node)
    return found


def _record_of(node: c_ast.Node) -> c_ast.Node | None:
    """The struct/union a declaration defines (with a body), if any."""
    t = node.type if isinstance(node, (c_ast.Decl, c_ast.Typedef)) else None
    while isinstance(t, c_ast.TypeDecl):
        t = t.type
    if isinstance(t, (c_ast.Struct, c_ast.Union)) and t.decls is not None:
        return t
    return None


def parse(text: str, filename: str = "<header>") -> Declarations:
    """Parse preprocessed text; return cffi-ready declarations and what they contain."""
    ast = c_parser.CParser().parse(text, filename)
    gen = c_generator.CGenerator()
    ev = ConstEval()
    rewriter = _Rewriter(ev)
    out: list[str] = []
    typedefs: dict[str, str] = {}
    functions: dict[str, str] = {}
    enums: dict[str, dict[str, int]] = {}
    records: list[str] = []
    constants: dict[str, int] = {}
    callbacks: dict[str, str] = {}
    skipped: dict[str, str] = {}
    signatures: dict[str, str] = {}

    for node in ast.ext:
        stub = _is_stub(node)
        if isinstance(node, c_ast.FuncDef):
            skipped[node.decl.name] = "inline function body"
            continue
        if isinstance(node, c_ast.Pragma):
            continue
        rewriter.visit(node)
        if stub:
            continue  # cffi knows the libc types the stand-ins declare
        if isinstance(node, c_ast.Typedef):
            text_ = gen.visit(node)
            if node.name in typedefs:
                if typedefs[node.name] != text_:
                    raise BindgenError(f"typedef {node.name} declared twice, differently")
                continue
            typedefs[node.name] = text_
            rec = _record_of(node)
            if rec is not None and not rec.name:
                records.append(node.name)
            if isinstance(node.type, c_ast.PtrDecl) and isinstance(node.type.type, c_ast.FuncDecl):
                callbacks[node.name] = text_
            _collect_enum(node.type, enums)
            if rec is not None and rec.name:
                records.append(f"{'struct' if isinstance(rec, c_ast.Struct) else 'union'} {rec.name}")
            out.append(text_ + ";")
            continue
        if isinstance(node, c_ast.Decl):
            if isinstance(node.type, c_ast.FuncDecl):
                if _mentions_va_list(node):
                    skipped[node.name] = "takes a va_list"
                    continue
                node.storage = [s for s in node.storage if s != "extern"]
                node.funcspec = [s for s in node.funcspec if s != "inline"]
                proto = gen.visit(node)
                functions[node.name] = proto
                signatures[node.name] = _signature(gen, node)
                out.append(proto + ";")
                continue
            if "static" in node.storage:
                if node.init is not None:
                    try:
                        constants[node.name] = ev(node.init)
                        ev.names[node.name] = constants[node.name]
                        out.append(f"#define {node.name} {constants[node.name]}")
                    except BindgenError as e:
                        skipped[node.name] = f"static constant that is not an integer ({e})"
                else:
                    skipped[node.name] = "static declaration"
                continue
            rec = _record_of(node)
            if rec is not None and rec.name:
                records.append(f"{'struct' if isinstance(rec, c_ast.Struct) else 'union'} {rec.name}")
            _collect_enum(node.type, enums)
            out.append(gen.visit(node) + ";")
            continue
        raise BindgenError(f"unexpected top-level {type(node).__name__} at {node.coord}")

    return Declarations("\n".join(out) + "\n", functions, enums, records, constants,
                        callbacks, skipped, signatures)


def _signature(gen: c_generator.CGenerator, decl: c_ast.Decl) -> str:
    """`ret (params)` of a function declaration, parameter names removed."""
    d = copy.deepcopy(decl)
    fdecl = d.type

    class Unname(c_ast.NodeVisitor):
        def visit_Decl(self, n: c_ast.Decl) -> None:
            n.name = None
            self.generic_visit(n)

        def visit_TypeDecl(self, n: c_ast.TypeDecl) -> None:
            n.declname = None
            self.generic_visit(n)

    if fdecl.args is not None:
        Unname().visit(fdecl.args)
    d.name = "_"
    t = fdecl.type
    while not isinstance(t, c_ast.TypeDecl) and hasattr(t, "type"):
        t = t.type
    if isinstance(t, c_ast.TypeDecl):
        t.declname = "_"
    return " ".join(gen.visit(d).split())


def _collect_enum(t: c_ast.Node, enums: dict[str, dict[str, int]]) -> None:
    while isinstance(t, c_ast.TypeDecl):
        t = t.type
    if isinstance(t, c_ast.Enum) and t.values is not None:
        # An anonymous enum is named by its first enumerator, which (unlike a counter)
        # stays the same when other enums are added before it in a later version.
        name = t.name or f"<anonymous enum {t.values.enumerators[0].name}>"
        enums[name] = {e.name: int(e.value.value) for e in t.values.enumerators}


# `#define NAME 42` (decimal, hex, octal, with u/l suffixes, optionally negative): the
# object-like macros whose whole body is one integer literal.
_INT_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+(-?[ \t]*(?:0[xX][0-9a-fA-F]+|\d+)[uUlL]*)"
                        r"[ \t]*(?://[^\n]*|/\*[^\n]*?\*/)?[ \t]*$", re.MULTILINE)


def integer_macros(header_text: str) -> dict[str, int]:
    """Name -> value of the header's integer macros. The preprocessor expands and then
    drops macros, so a value a header states only as a #define (ggml-rpc.h's protocol
    version) is read from the text; anything but a plain integer literal is left out."""
    out = {}
    for m in _INT_MACRO.finditer(header_text):
        body = m.group(2).replace(" ", "").replace("\t", "")
        neg = body.startswith("-")
        value = ConstEval._literal(c_ast.Constant("int", body.lstrip("-")))
        out[m.group(1)] = -value if neg else value
    return out


def add_macro_constants(decls: Declarations, macros: dict[str, int]) -> None:
    """Add integer macros as constants of the bindings (`#define NAME value` in the cdef,
    which cffi's ABI mode turns into lib.NAME), unless a declaration already has the name."""
    lines = []
    for name, value in macros.items():
        if name in decls.constants or name in decls.functions:
            continue
        decls.constants[name] = value
        lines.append(f"#define {name} {value}")
    if lines:
        decls.cdef += "\n".join(lines) + "\n"
