"""The files that docstrings and comments point to exist (issue #25 found several that
did not: a docs/turboquant-findings.md, a tests/test_state_dir.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AREA = sorted(p for p in [*(ROOT / "clickpaca").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                          *(ROOT / "native").rglob("*.py")]
              if p.name != "test_comments.py")  # (this file names the missing ones)
REF = re.compile(r"\b((?:docs|tests)/[\w./-]+\.(?:md|py))\b")


@pytest.mark.parametrize("path", AREA, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_or_tests_path_named_in_a_comment_exists(path):
    missing = sorted({m for m in REF.findall(path.read_text(encoding="utf-8")) if not (ROOT / m).exists()})
    assert not missing, missing


PACKAGES = sorted(p.parent for p in (ROOT / "clickpaca").rglob("__init__.py") if p.parent != ROOT / "clickpaca")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_package_map_names_every_module_it_holds(package):
    """A subpackage's docstring is its map (issue #38: engine's left out readout.py):
    every module in the folder is named there, as `name` or `name.py`."""
    import ast

    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    words = set(re.findall(r"\w+", doc))
    unnamed = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py" and p.stem not in words)
    assert not unnamed, f"{package.name}/__init__.py's map leaves out {unnamed}"
