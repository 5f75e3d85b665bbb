"""Registry models by name: `--model smollm2` and `clickpaca model --name smollm2`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clickpaca.llama.models import NAMED_MODELS, packaged_model, resolve_model, smollm2_path

pytestmark = pytest.mark.model


def clickpaca(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clickpaca", *args], capture_output=True, text=True)


def test_names_resolve_to_the_registry_models():
    assert resolve_model("smollm2") == smollm2_path()
    assert resolve_model("gemma3-270m") == packaged_model()
    assert set(NAMED_MODELS) == {"smollm2", "gemma3-270m"}


def test_model_command_takes_a_name_and_refuses_an_unknown_one():
    r = clickpaca("model", "--name", "smollm2")
    assert r.returncode == 0 and r.stdout.strip() == str(smollm2_path())
    r = clickpaca("model", "--name", "llama-70b")
    assert r.returncode == 2 and "'llama-70b' is not a registry model" in r.stderr and "smollm2" in r.stderr


def test_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").write_bytes(b"not gguf")
    with pytest.raises(Exception, match="smollm2"):
        resolve_model("smollm2")  # the file is taken, and is not GGUF
