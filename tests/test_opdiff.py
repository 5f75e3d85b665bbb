"""clickpaca.llama.opdiff across processes (--dump, --against), on the real model: two dumps of
the same prompt and settings have no differing node; a dump with the weights not
repacked (another matmul kernel, the same graph) differs, and the matmul is named as
the first source. Three short decodes of 24 tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def opdiff(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "clickpaca.llama.opdiff", *args], capture_output=True, text=True,
                       env=dict(os.environ, OMP_WAIT_POLICY="passive"), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("opdiff")
    out = {}
    for name, repack in (("a", "1"), ("b", "1"), ("r", "0")):
        out[name] = str(d / f"{name}.pkl")
        said = opdiff("--cache", "f16", "--fa", "on", "--repack", repack, "--tokens", "24", "--dump", out[name])
        assert re.search(r"dump: \d+ nodes of 24 tokens, f16/f16 on ", said)
    return out


def test_two_dumps_of_the_same_decode_do_not_differ(dumps):
    said = opdiff("--against", dumps["a"], dumps["b"])
    counts = re.findall(r"nodes: (\d+) same, (\d+) sources, (\d+) differ downstream", said)
    assert len(counts) == 2  # token 0 and the last token (23)
    assert all(int(same) > 100 and src == "0" and down == "0" for same, src, down in counts)
    assert "logits of the last token: identical" in said


def test_another_matmul_kernel_differs_and_is_named_first(dumps):
    said = opdiff("--against", dumps["a"], dumps["r"])
    assert "repack 1 on" in said and "repack 0 on" in said
    last = said.split("token 23:")[1]
    first = re.search(r"source\s+#\s*\d+ \S+\s+(\S+)", last)
    assert first and first.group(1) == "MUL_MAT"
    assert "logits of the last token: differ" in said
