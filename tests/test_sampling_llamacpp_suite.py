"""llama.cpp's tests/test-sampling.cpp expectations, run on our steps.

The file is read at test time from the build's source tree (build-info.json
``source_dir``; its text is not copied here): every ``test_<step>(probs, ..., expected,
params);`` call in its main() becomes a case. As that file does, the candidates are
tokens 0..n-1 with logit log(prob); after the step, the probabilities of the
candidates (softmax, 0 for a token the step removed while llama.cpp keeps it at -inf)
must match the expected ones within 1e-5, compared as sorted values (llama.cpp's
array order after a step is not part of the semantics). Where that file applies no
dist sampler after the step (XTC, typical), the expected values are the probabilities
before the step, of the tokens that survive it. ``test_sampler_queue`` cases
run llama.cpp's own C samplers (min_keep 1, as there) and our steps in the same order
on the same vocabulary and compare the survivors.

One expectation differs on purpose: min-p above 1 (``test_min_p(..., 1.05f)``) keeps the
top token in llama.cpp; the protocol refuses minP > 1 (docs/PROTOCOL.md).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from pathlib import Path

import numpy as np
import pytest

from clickpaca.llama import native
from clickpaca.sampling import SamplerParamError, SamplerParams
from clickpaca.sampling import dry as D
from clickpaca.sampling import steps as S
from clickpaca.sampling.oracle import CSampler

from conftest import TEST_BUILD


def source_file() -> Path:
    info = json.loads((native.build_dir(TEST_BUILD) / "build-info.json").read_text())
    return Path(info["source_dir"]) / "tests" / "test-sampling.cpp"


_OPS = {ast.Div: operator.truediv, ast.Mult: operator.mul, ast.Add: operator.add, ast.Sub: operator.sub}


def _value(node):
    """A C++ argument as Python: numbers, arithmetic, strings, braced lists."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [_value(x) for x in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"unexpected argument {ast.dump(node)}")


def cases() -> list[tuple[int, str, list]]:
    """(line, name, arguments) of every test_<name>(...) call in main()."""
    text = source_file().read_text(encoding="utf-8")
    body = text[text.index("int main("):]
    out = []
    offset = text[: text.index("int main(")].count("\n")
    for no, line in enumerate(body.splitlines(), offset + 1):
        m = re.match(r"\s*test_(\w+)\((.*)\);", line)
        if not m or m.group(1) in ("perf", "dist_singleton_rng"):
            continue
        args = re.sub(r"(\d)f\b", r"\1", m.group(2)).replace("{", "[").replace("}", "]")
        out.append((no, m.group(1), _value(ast.parse(f"[{args}]", mode="eval").body)))
    return out


CASES = cases()
BY_NAME = {n for _, n, _ in CASES}


def test_the_suite_is_found_and_every_kind_is_covered():
    assert len(CASES) >= 60, len(CASES)
    covered = {"temp", "temp_ext", "top_k", "top_p", "min_p", "xtc", "typical", "penalties", "dry",
               "top_n_sigma", "sampler_queue"}
    assert BY_NAME == covered, BY_NAME ^ covered  # a new kind of case must get a port below


def probs_after(n: int, ids: np.ndarray, logits: np.ndarray) -> list[float]:
    lg = np.asarray(logits, np.float64)
    e = np.exp(lg - lg.max()) if ids.size else lg
    return sorted((e / e.sum()).tolist()) if ids.size else []


def run_case(name: str, args: list):
    probs = args[0]
    n = len(probs)
    ids = np.arange(n, dtype=np.int32)
    lg = np.log(np.asarray(probs, np.float32)).astype(np.float64)
    if name == "temp":
        out = S.temperature(ids, lg, args[2])
    elif name == "temp_ext":
        out = S.dynatemp(ids, lg, args[2], args[3], args[4])
    elif name == "top_k":
        out = S.top_k(ids, lg, args[2])
    elif name == "top_p":
        out = S.top_p(ids, lg, args[2])
    elif name == "min_p":
        out = S.min_p(ids, lg, args[2])
    elif name == "xtc":
        out = S.xtc(ids, lg, args[2], args[3], 0.0 if args[2] > 0 and args[3] <= 0.5 else None)
    elif name == "typical":
        out = S.typical_p(ids, lg, args[2])
    elif name == "penalties":
        last = args[1]
        tok, cnt = np.unique(np.asarray(last, np.int32), return_counts=True)
        out = S.penalties(ids, lg, tok.astype(np.int32), cnt.astype(np.float64), args[3], args[4], args[5])
    elif name == "dry":
        last, mult, base, allowed, last_n, brk = args[1], *args[3:8]
        heads: dict = {}
        for b in brk:
            heads.setdefault(b[0], []).append(tuple(b[1:]))
        pen_ids, pen = D.dry_penalties(list(last), mult, base, allowed, last_n,
                                       {k: tuple(v) for k, v in heads.items()})
        out = D.apply(ids, lg, pen_ids, pen)
    elif name == "top_n_sigma":
        out = S.top_n_sigma(ids, lg, args[2])
    else:
        raise AssertionError(name)
    return out


EXPECTED = [(no, name, args) for no, name, args in CASES if name != "sampler_queue"]


@pytest.mark.parametrize("no, name, args", EXPECTED, ids=[f"{n}-line{no}" for no, n, _ in EXPECTED])
def test_expectation(no, name, args):
    expected = sorted(args[2] if name in ("penalties", "dry") else args[1])
    if name == "min_p" and args[2] > 1:
        with pytest.raises(SamplerParamError, match=r"^minP: must be in \[0, 1\]"):
            SamplerParams(min_p=args[2])
        return  # the deliberate difference (module docstring)
    ids, lg = run_case(name, args)
    if name in ("xtc", "typical"):  # no dist sampler after these there: p as before the step
        full = np.asarray(args[0], np.float64)
        got = sorted((full[ids] / full.sum()).tolist())
    else:
        got = probs_after(len(args[0]), ids, lg)
    got = [0.0] * (len(expected) - len(got)) + got  # llama.cpp keeps removed tokens at p = 0
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(got, expected):
        assert abs(g - e) < 1e-5, (no, got, expected)


QUEUE = [(no, args) for no, name, args in CASES if name == "sampler_queue"]


@pytest.fixture(scope="module")
def nat():
    return native.load(TEST_BUILD)


@pytest.mark.parametrize("no, args", QUEUE, ids=[f"{a[1]}-line{no}" for no, a in QUEUE])
def test_sampler_queue(nat, no, args):
    n_vocab, order, top_k, top_p, min_p = args
    ids = np.arange(n_vocab, dtype=np.int32)
    with np.errstate(divide="ignore"):
        lg32 = np.log(ids.astype(np.float32))  # as the C++ tester: logit log(id), token 0 at -inf
    c_ids, c_lg = ids, lg32
    o_ids, o_lg = ids, lg32.astype(np.float64)
    for s in order:
        init = {"k": ("top_k", top_k), "p": ("top_p", top_p, 1), "m": ("min_p", min_p, 1)}[s]
        with CSampler(nat, *init) as cs:
            r = cs.apply(c_ids, c_lg)
        c_ids, c_lg = r.ids, r.logits
        o_ids, o_lg = {"k": lambda: S.top_k(o_ids, o_lg, top_k),
                       "p": lambda: S.top_p(o_ids, o_lg, top_p),
                       "m": lambda: S.min_p(o_ids, o_lg, min_p)}[s]()
        if o_ids.size == 0:  # min_keep 1 in llama.cpp: our steps keep at least one token too
            raise AssertionError(f"line {no}: {s} emptied the set")
        assert sorted(o_ids.tolist()) == sorted(c_ids.tolist()), (no, s, o_ids.size, c_ids.size)
        assert math.isfinite(float(o_lg.max()))
