"""clickpaca cvec (activations/cvec.py): pairs, directions, the GGUF file, and the file
loaded by llama.cpp's own llama-completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clickpaca.activations import cvec

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "examples" / "cvec" / "sentiment.jsonl"


def test_read_pairs_names_the_bad_line(tmp_path):
    assert len(cvec.read_pairs(PAIRS)) == 20
    f = tmp_path / "p.jsonl"
    f.write_text('{"positive": "a", "negative": "b"}\n\n{"positive": "a"}\n')
    with pytest.raises(cvec.PairsError, match=r"p.jsonl:3: needs non-empty strings"):
        cvec.read_pairs(f)
    f.write_text("not json\n")
    with pytest.raises(cvec.PairsError, match=r"p.jsonl:1: not JSON"):
        cvec.read_pairs(f)
    f.write_text("\n")
    with pytest.raises(cvec.PairsError, match="no prompt pairs"):
        cvec.read_pairs(f)


def test_derive_mean_and_pca_agree_on_one_clean_direction():
    rng = np.random.default_rng(1)
    axis = rng.normal(size=16)
    neg = {3: rng.normal(size=(12, 16))}
    scale = rng.uniform(1.0, 3.0, size=(12, 1))
    pos = {3: neg[3] + scale * axis}
    mean = cvec.derive(pos, neg, "mean")[3]
    pca = cvec.derive(pos, neg, "pca")[3]
    assert np.allclose(mean, scale.mean() * axis, rtol=1e-5)
    assert np.allclose(pca, mean, rtol=1e-4)  # differences on one axis: the same direction
    with pytest.raises(ValueError, match="method"):
        cvec.derive(pos, neg, "median")


def test_gguf_round_trip_has_llama_cpps_names(tmp_path):
    import gguf

    dirs = {1: np.arange(8, dtype=np.float32), 5: -np.ones(8, np.float32)}
    p = cvec.write_gguf(tmp_path / "v.gguf", dirs, "gemma3")
    back = cvec.read_gguf(p)
    assert set(back) == {1, 5} and all(np.array_equal(back[k], dirs[k]) for k in dirs)
    r = gguf.GGUFReader(str(p))
    fields = {k: r.fields[k] for k in ("general.architecture", "controlvector.model_hint",
                                       "controlvector.layer_count")}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(fields["controlvector.model_hint"].parts[-1]).decode() == "gemma3"
    assert int(fields["controlvector.layer_count"].parts[-1][0]) == 2
    assert [t.tensor_type for t in r.tensors] == [gguf.GGMLQuantizationType.F32] * 2
    with pytest.raises(ValueError, match="layer 0"):
        cvec.write_gguf(tmp_path / "w.gguf", {0: dirs[1]}, "gemma3")


def test_parse_layers():
    assert cvec.parse_layers(None, 18) == list(range(1, 18))
    assert cvec.parse_layers("4-9", 18) == [4, 5, 6, 7, 8, 9]
    assert cvec.parse_layers("6", 18) == [6]
    for bad in ("0-3", "5-18", "9-4", "x"):
        with pytest.raises(ValueError, match="--layers"):
            cvec.parse_layers(bad, 18)


def _completion(model_path, *extra):
    exe = ROOT / "builds" / "mainline" / "bin" / "llama-completion"
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    r = subprocess.run([str(exe), "-m", str(model_path), "-p", "The movie was", "-n", "12", "--temp", "0",
                        "-t", "2", "-no-cnv", "--no-warmup", *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.model
def test_cvec_writes_a_file_llama_completion_loads(tmp_path, model_path):
    """The command on the real model; llama.cpp's own tool loads the file: at scale 0 its
    greedy output equals the unsteered run, at a large scale it changes."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(line + "\n" for line in PAIRS.read_text().splitlines()[:6]))
    out = tmp_path / "sent.gguf"
    r = subprocess.run([sys.executable, "-m", "clickpaca.cli", "cvec", str(pairs), "-o", str(out),
                        "--layers", "4-9", "--model", str(model_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "6 pairs, layers 4-9, mean" in r.stdout
    dirs = cvec.read_gguf(out)
    assert sorted(dirs) == [4, 5, 6, 7, 8, 9] and all(np.linalg.norm(d) > 0 for d in dirs.values())
    plain = _completion(model_path)
    rng = ["--control-vector-layer-range", "4", "9"]
    zero = _completion(model_path, "--control-vector-scaled", f"{out}:0", *rng)
    big = _completion(model_path, "--control-vector-scaled", f"{out}:4", *rng)
    assert plain.startswith("The movie was") and len(plain) > len("The movie was") + 10
    assert zero == plain
    assert big != plain


def test_bad_pairs_file_is_a_clear_error(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"positive": "x"}) + "\n")
    r = subprocess.run([sys.executable, "-m", "clickpaca.cli", "cvec", str(f), "-o", str(tmp_path / "o.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad.jsonl:1: needs non-empty strings" in r.stderr
