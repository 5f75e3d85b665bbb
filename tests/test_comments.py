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
