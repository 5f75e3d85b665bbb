"""What clickpaca's own code uses of the llama.cpp API, read from the code itself.

The change report leads with these names, so the list must follow the code, not a hand
list that goes stale. The scan reads every module of the package with `ast`:

* `lib.NAME` (any expression ending in `.lib` or named `lib`): functions, enum values and
  constants; `ffi.addressof(lib, "NAME")` likewise;
* the C type strings given to `ffi.new / cast / from_buffer / callback / typeof / sizeof /
  offsetof` (e.g. "llama_batch *"): records and callback types;
* every other attribute name, read or written, except on `self` / `cls`: candidate field
  names, kept only where they name a field of a record the code uses (`p.n_ctx = ...` on
  the struct llama_context_default_params returns);
* `hasattr(x, "NAME")` and the `if` / conditional expression around it: code there runs
  only where NAME exists (or does not), which the report shows as handled;
* the feature checks (clickpaca/llama/features.py): `features.available / require / lacking`
  with a feature's name, and `features.check_init` (every feature that refuses an option):
  the report counts a name of such a feature as handled where the feature is absent.

Each use keeps its place as `file:line` relative to the package (e.g. core.py:303).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "clickpaca"
FFI_TYPE_CALLS = {"new", "cast", "from_buffer", "callback", "typeof", "sizeof", "offsetof",
                  "new_handle"}
FEATURE_CHECKS = {"available", "require", "lacking", "check_init"}
API_NAME = re.compile(r"^(llama|ggml|gguf|LLAMA|GGML|GGUF)_[A-Za-z0-9_]+$")
C_WORDS = {"const", "volatile", "unsigned", "signed", "struct", "union", "enum"}


@dataclass
class Usage:
    """name -> places ("core.py:303"), per kind of use."""

    symbols: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    types: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    attrs: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # names the code probes with hasattr(x, "NAME") before use: it copes with their absence
    guards: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # places inside an `if`/conditional expression that tests hasattr(...): code that runs
    # only on the versions that have (or lack) something
    guarded: set[str] = field(default_factory=set)
    # features.py rows the code checks by name ("check_init": every refusing row) -> places
    features: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def _ends_in(node: ast.AST, name: str) -> bool:
    """`name` itself or any `x.name` (lib, self.nat.lib, model.nat.ffi ...)."""
    return (isinstance(node, ast.Name) and node.id == name) or \
        (isinstance(node, ast.Attribute) and node.attr == name)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def c_type_name(text: str) -> str | None:
    """The named type in a cffi type string: "llama_seq_id *[]" -> "llama_seq_id",
    "struct llama_batch *" -> "struct llama_batch", "char[64]" -> "char"."""
    base = re.sub(r"\[[^\]]*\]|\*|\(.*", " ", text)
    words = [w for w in base.split() if w not in ("const", "volatile")]
    if not words:
        return None
    if words[0] in ("struct", "union", "enum") and len(words) > 1:
        return f"{words[0]} {words[1]}"
    return " ".join(words)


def scan_source(text: str, where: str, usage: Usage) -> None:
    """Add the uses found in one module's source (`where` is its name in the report)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "hasattr"
                for n in ast.walk(node.test)):
            usage.guarded.update(f"{where}:{line}" for line in range(node.lineno, node.end_lineno + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            place = f"{where}:{node.lineno}"
            if _ends_in(node.value, "lib"):
                if API_NAME.match(node.attr):
                    usage.symbols[node.attr].append(place)
            elif not _is_self(node.value):
                usage.attrs[node.attr].append(place)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "hasattr" and len(node.args) == 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            usage.guards[node.args[1].value].append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and _ends_in(node.func.value, "features") and node.func.attr in FEATURE_CHECKS:
            place = f"{where}:{node.lineno}"
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if node.func.attr == "check_init":
                usage.features["check_init"].append(place)
            elif strings:
                usage.features[strings[0]].append(place)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and _ends_in(node.func.value, "ffi"):
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            place = f"{where}:{node.lineno}"
            if node.func.attr == "addressof" and strings and API_NAME.match(strings[0]):
                usage.symbols[strings[0]].append(place)
            elif node.func.attr in FFI_TYPE_CALLS and strings:
                name = c_type_name(strings[0])
                if name:
                    usage.types[name].append(place)


def scan(package: Path = PACKAGE) -> Usage:
    """Every use in the package's modules, in file and line order."""
    usage = Usage()
    for path in sorted(package.rglob("*.py")):
        scan_source(path.read_text(), str(path.relative_to(package)), usage)
    for kind in (usage.symbols, usage.types, usage.attrs, usage.guards, usage.features):
        for places in kind.values():
            places.sort(key=_place_order)
    return usage


def _place_order(place: str) -> tuple[str, int]:
    where, _, line = place.rpartition(":")
    return where, int(line)
