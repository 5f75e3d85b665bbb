"""Manifest history per (flavor, commit): no version's report overwrites another's."""

from __future__ import annotations

import os

from bindgen import history


def m(flavor: str, commit: str) -> dict:
    return {"stamp": {"flavor": flavor, "commit": commit, "build_number": 1}}


def test_each_version_keeps_its_manifest_and_the_baseline_is_another_version(tmp_path, monkeypatch):
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path))
    assert history.baseline("mainline", "a") is None
    pa = history.save(m("mainline", "a"))
    assert history.baseline("mainline", "a") is None  # never itself
    pb = history.save(m("mainline", "b"))
    os.utime(pa, (1000, 1000))
    os.utime(pb, (2000, 2000))
    assert history.baseline("mainline", "b") == pa and history.baseline("mainline", "a") == pb
    history.save(m("mainline", "a"))  # regenerating a replaces only a's file (and is newest)
    assert sorted(p.name for p in (tmp_path / "manifests" / "mainline").iterdir()) == ["a.json", "b.json"]
    # compat versions are compared with the newest mainline, never with each other
    history.save(m("compat", "x"))
    history.save(m("compat", "y"))
    assert history.baseline("compat", "y") == pa
    # flavors are separate
    assert history.baseline("turboquant", "a") is None


def test_odd_names_stay_inside_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("CLICKPACA_CACHE", str(tmp_path))
    p = history.save(m("../x", "a/b"))
    assert p.resolve().is_relative_to((tmp_path / "manifests").resolve())
    assert os.path.basename(p) == "a_b.json"
