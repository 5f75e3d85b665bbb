"""An earlier commit's tree beside this one (clickpaca/measure/bench/against.py): what is
extracted, and that a process started with `server_env` imports that tree's package, not
this checkout's, even when started from this checkout's root (as `python -m` is)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clickpaca.llama.native import builds_root
from clickpaca.measure.bench import against

ROOT = Path(__file__).resolve().parent.parent


def test_extract_gives_the_commits_files(tmp_path):
    against.extract("HEAD", tmp_path, "clickpaca/sampling")
    want = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:clickpaca/sampling/__init__.py"],
                          capture_output=True, check=True).stdout
    assert (tmp_path / "clickpaca" / "sampling" / "__init__.py").read_bytes() == want
    assert not (tmp_path / "clickpaca" / "engine").exists()


def test_a_process_with_server_env_runs_the_extracted_tree_from_this_root(tmp_path):
    root = against.extract("HEAD", tmp_path)
    env = against.server_env(root)
    assert env["CLICKPACA_BUILDS"] == str(builds_root())
    code = "import clickpaca; print(clickpaca.__file__)"
    for e in ({}, env):  # from this root, without it this checkout's package is imported
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=ROOT, env=dict(os.environ, **e)).stdout.strip()
        assert Path(out).parent.parent == (root if e else ROOT), (e, out)
