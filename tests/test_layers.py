"""The package's layers: a module imports only from its own layer or a layer below it,
no modules import each other in a circle, no private name crosses from one module to
another, and the package root stays small.

Read from the source (ast), every import statement: at module level, inside functions,
under `if TYPE_CHECKING:` and `if __name__ == "__main__":`. Those last two name their
target as much as any other (so they count for the layers), but they never run when the
module is imported, so they close no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "clickpaca"

#: Bottom first. A module's layer is the longest entry that is its name or a package
#: above it; the root's own modules (cli.py, __main__.py, __init__.py) are the top.
LAYERS = [
    ("base", "clickpaca.base"),                # imports nothing of clickpaca
    ("llama", "clickpaca.llama"),              # llama.cpp access
    ("rpc", "clickpaca.rpc"),                  # RPC workers
    ("activations", "clickpaca.activations"),  # capture, control vectors, steering
    ("sampling", "clickpaca.sampling"),        # the sampler chain, user steps
    ("grammar", "clickpaca.grammar"),
    ("wire", "clickpaca.wire"),                # protocol, endings, chat, ..., client
    ("engine", "clickpaca.engine"),
    ("serve", "clickpaca.serve"),              # stdio and socket servers
    ("results", "clickpaca.results"),          # the store; what every measurement writes
    ("measure", "clickpaca.measure"),          # bench/, retrieval/ and what they share
    ("workbench", "clickpaca.workbench"),      # experiments over the client, demo
    ("top", "clickpaca"),                      # cli.py, __main__.py, the public names
]
ROOT_MODULES = {"clickpaca", "clickpaca.cli", "clickpaca.__main__"}
MAX_ROOT_ENTRIES = 15

def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def _not_on_import(node: ast.If) -> bool:
    """`if TYPE_CHECKING:` (for the reader and the type checker) or `if __name__ ==
    "__main__":` (run as a script): the imports below it never run when it is imported."""
    t = node.test
    if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
            (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
        return True
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported clickpaca module, line, not run on import) for every import statement."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def target(dotted: str) -> str:
        while dotted not in known and "." in dotted:
            dotted = dotted.rpartition(".")[0]
        return dotted

    def walk(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _not_on_import(child):
                for c in child.body:
                    walk_one(c, True)
                for c in child.orelse:
                    walk_one(c, type_only)
                continue
            walk_one(child, type_only)

    def walk_one(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "clickpaca":
                    found.append((target(a.name), node.lineno, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "clickpaca":
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    found.append((sub if sub in known else target(mod), node.lineno, type_only))
        walk(node, type_only)

    walk(tree, False)
    return found


def layer_of(name: str) -> int:
    if name in ROOT_MODULES:
        return len(LAYERS) - 1
    best = None
    for i, (_, prefix) in enumerate(LAYERS[:-1]):
        if name == prefix or name.startswith(prefix + "."):
            best = i
    if best is None:
        raise AssertionError(f"{name} is in no layer: move it into one, or add its package to LAYERS")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def test_walker_sees_imports_inside_functions_and_type_checking(graph, tmp_path):
    # the tests below can fail only if these are seen
    assert "clickpaca.measure.bench.cli" in {t for t, _, _ in graph["clickpaca.cli"]}  # inside a function
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\n"
                 "from . import core\n"
                 "if TYPE_CHECKING:\n    from ..wire.protocol import Request\n"
                 "def f():\n    import clickpaca.engine.engine\n    from ..measure import kl\n")
    found = imports("clickpaca.llama.x", f, set(graph))
    assert found == [("clickpaca.llama.core", 2, False), ("clickpaca.wire.protocol", 4, True),
                     ("clickpaca.engine.engine", 6, False), ("clickpaca.measure.kl", 7, False)]


def test_every_module_has_a_layer(graph):
    homeless = []
    for m in graph:
        try:
            layer_of(m)
        except AssertionError as e:
            homeless.append(str(e))
    assert not homeless, "\n".join(homeless)


def test_no_import_from_a_higher_layer(graph):
    upward = []
    for m, targets in graph.items():
        for t, line, _ in targets:
            if layer_of(t) > layer_of(m):
                upward.append(f"{m}:{line} imports {t} ({LAYERS[layer_of(m)][0]} -> {LAYERS[layer_of(t)][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_retrieval_takes_nothing_from_bench(graph):
    bad = [f"{m}:{line} imports {t}" for m, targets in graph.items() if m.startswith("clickpaca.measure.retrieval")
           for t, line, _ in targets if t.startswith("clickpaca.measure.bench")]
    assert not bad, "\n".join(bad)


def test_no_import_cycles(graph):
    """Tarjan over the imports that run on import (inside functions included)."""
    edges = {m: sorted({t for t, _, type_only in ts if not type_only and t != m and t in graph})
             for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_root_is_small():
    def counts(p: Path) -> bool:
        if p.name == "__pycache__":
            return False
        return p.is_file() or any(q.suffix == ".py" for q in p.rglob("*.py"))

    entries = sorted(p.name for p in PKG.iterdir() if counts(p))
    assert len(entries) <= MAX_ROOT_ENTRIES, f"clickpaca/ holds {len(entries)} entries: {entries}"
    stray = sorted(module_name(p) for p in PKG.glob("*.py") if module_name(p) not in ROOT_MODULES)
    assert not stray, f"modules at the root outside every layer: {stray}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_defined(tree: ast.AST) -> set[str]:
    """The private names a module's own code makes: functions, classes, assignments
    (module names, and attributes: ``self._x = ...``), arguments, and the strings of
    ``__slots__``, ``setattr`` and ``__dict__["_x"] = ...``."""
    own: set[str] = set()
    for n in ast.walk(tree):
        names: list[str] = []
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [n.name]
        elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names = [n.id]
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names = [n.attr]
        elif isinstance(n, ast.arg):
            names = [n.arg]
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.slice, ast.Constant) \
                and isinstance(n.slice.value, str):
            names = [n.slice.value]  # self.__dict__["_key"] = ...
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            names = [c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        elif isinstance(n, ast.Call) and ast.unparse(n.func) in ("setattr", "object.__setattr__") \
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            names = [n.args[1].value]
        own.update(x for x in names if _private(x))
    return own


def private_crossings(name: str, path: Path, theirs: set[str]) -> list[str]:
    """Where module ``name`` uses a private name of another clickpaca module:
    ``from x import _y`` (absolute or relative), ``x._y`` (and ``getattr(x, "_y")``) for
    any x, a module or an object, when ``_y`` is a private name that another module's code
    makes (``theirs``) and this one's does not. So ``s._history`` read outside the module
    whose class sets ``self._history`` counts, while an object's private attributes used in
    its own class's module (``other._key`` in ``__eq__``) do not, nor private names that
    no clickpaca module makes (``os._exit``, a namedtuple's ``_replace``). A name that both
    modules make reads as the reader's own: the check cannot know an object's class."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = private_defined(tree)
    found: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "clickpaca"):
            found += [(n.lineno, f"imports {a.name} from {'.' * n.level}{n.module or ''}")
                      for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Import):
            found += [(n.lineno, f"imports {a.name}") for a in n.names
                      if a.name.split(".")[0] == "clickpaca" and any(_private(p) for p in a.name.split("."))]
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr in theirs and n.attr not in own:
            found.append((n.lineno, f"reads {ast.unparse(n)}"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) \
                and _private(n.args[1].value) and n.args[1].value in theirs and n.args[1].value not in own:
            found.append((n.lineno, f"reads {ast.unparse(n)}"))
    return [f"{name}:{line} {what}" for line, what in sorted(found, key=lambda f: f[0])]


def test_private_check_sees_each_form(tmp_path):
    # the test below can fail only if these are seen
    f = tmp_path / "x.py"
    f.write_text("from .chain import _steps_to_run, steps\n"
                 "from clickpaca.results.report import _save\n"
                 "from . import chain\n"
                 "def f(s, other):\n"
                 "    chain._reason('x')\n"
                 "    s._history.append(1)\n"
                 "    getattr(s, '_params')\n"
                 "    other._mine = 1\n"
                 "    return other._mine, s.__class__, s._unknown_anywhere\n")
    found = private_crossings("clickpaca.sampling.x", f, {"_reason", "_history", "_params", "_mine"})
    assert found == ["clickpaca.sampling.x:1 imports _steps_to_run from .chain",
                     "clickpaca.sampling.x:2 imports _save from clickpaca.results.report",
                     "clickpaca.sampling.x:5 reads chain._reason",
                     "clickpaca.sampling.x:6 reads s._history",
                     "clickpaca.sampling.x:7 reads getattr(s, '_params')"]


def test_no_private_name_crosses_modules():
    """A leading-underscore name is its module's: another module neither imports it nor
    reads it off a module or an object (`private_crossings`). What another module needs
    gets a public name, or the use moves to the module that owns the name."""
    made = {m: private_defined(ast.parse(p.read_text(encoding="utf-8"))) for m, p in modules().items()}
    crossings = []
    for m, p in modules().items():
        theirs = set().union(*(own for other, own in made.items() if other != m))
        crossings += private_crossings(m, p, theirs)
    assert not crossings, "private names used across modules:\n" + "\n".join(crossings)


def test_every_layer_exists():
    names = {m for m in modules()}
    missing = [prefix for _, prefix in LAYERS if prefix not in names]
    assert not missing, f"LAYERS names packages that do not exist: {missing}"
