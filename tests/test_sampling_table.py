"""clickpaca.sampling.table: each row agrees with its step's definition in ``steps``.

The chain trusts the rows: it skips a step the row calls off, treats a step as keeping
everything unless the row says it truncates, and gathers only the ids an elementwise
row says it touches. So each claim is checked here against the definition itself, on
random candidate sets and parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.sampling import SamplerParams, step_names
from clickpaca.sampling import registry as R
from clickpaca.sampling.registry import CONSTRAINT, ELEMENTWISE, SCALE, TRUNCATION, StepContext

V = 64
STEPS = R.steps()  # the built-in rows (sampling imports table): the tests below register others
RUN = [s for s in STEPS if s.run is not None]

params_st = st.builds(
    SamplerParams,
    temperature=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 3, 40, V]),
    top_p=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    penalty_repeat=st.sampled_from([1.0, 1.3]),
    penalty_freq=st.sampled_from([0.0, 0.5]),
    penalty_present=st.sampled_from([0.0, -0.25]),
    penalty_last_n=st.sampled_from([0, 8, -1]),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.sampled_from([-1e9, -2.0, 3.0, 1e9]), max_size=4),
    dry_multiplier=st.sampled_from([0.0, 0.8]),
    dry_allowed_length=st.sampled_from([1, 2]),
    dry_penalty_last_n=st.sampled_from([-1, 0, 16]),
    dry_sequence_breakers=st.just(()),  # breakers need a vocabulary: tests/test_sampling_oracle.py
    top_n_sigma=st.sampled_from([-1.0, 0.5, 2.0]),
    typical_p=st.sampled_from([0.2, 0.9, 1.0]),
    xtc_probability=st.sampled_from([0.0, 0.5, 1.0]),
    xtc_threshold=st.sampled_from([0.05, 0.1, 0.6]),
    dynatemp_range=st.sampled_from([0.0, 0.5]),
    mirostat=st.sampled_from([0, 1, 2]),
    mirostat_tau=st.sampled_from([1.0, 5.0]),
)


def ctx_for(seed: int, params: SamplerParams) -> StepContext:
    """What SequenceSampler passes: the penalty window, a context history, the vocab size."""
    rng = np.random.default_rng(seed + 2)
    tokens = rng.integers(0, 6, rng.integers(0, 30)).tolist()  # few distinct ids: repeats happen
    return StepContext(history(seed, params), tokens, n_vocab=V, seed=seed)


def candidates(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(V)[: rng.integers(1, V + 1)].astype(np.int32)
    logits = np.round(rng.normal(0, 3, ids.size), 1)  # rounded: ties happen
    return ids, logits


def history(seed: int, params: SamplerParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts) of a penalty window; empty when the penalties are inactive, as
    ``SequenceSampler`` passes it."""
    if not params.penalties_active:
        return np.empty(0, np.int32), np.empty(0, np.float64)
    rng = np.random.default_rng(seed + 1)
    ids, counts = np.unique(rng.integers(0, V, rng.integers(0, 12)), return_counts=True)
    return ids.astype(np.int32), counts.astype(np.float64)


def test_the_table_is_the_default_order_and_the_accepted_names():
    assert step_names() == SamplerParams().samplers == tuple(R.by_name()) == tuple(s.name for s in STEPS)
    assert STEPS[0].kind == CONSTRAINT and all(s.kind != CONSTRAINT for s in STEPS[1:])
    for spelling, name in R.aliases().items():
        assert SamplerParams(samplers=[spelling]).samplers == (name,)
    assert len({s.alias for s in STEPS if s.alias}) == sum(1 for s in STEPS if s.alias)
    for s in STEPS:
        assert (s.touches is not None) == (s.kind == ELEMENTWISE), s.name
        assert s.cut is None or s.kind in (TRUNCATION, SCALE), s.name  # a cut is optional
        assert (s.sampled is None) or s.stateful, s.name
        assert (s.run is None) == (s.kind == CONSTRAINT), s.name
    assert set(R.empty_reasons()) <= set(step_names()) | {"sample"}


@pytest.mark.parametrize("step", RUN, ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_off_means_identity(step, params, seed):
    ids, logits = candidates(seed)
    hist = history(seed, params)
    if not step.off(params, hist[0].size > 0):
        return
    out_ids, out_logits = step.run(ids, logits, params, ctx_for(seed, params))
    assert np.array_equal(out_ids, ids) and np.array_equal(out_logits, logits)


@pytest.mark.parametrize("step", RUN, ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_no_truncation_keeps_every_candidate(step, params, seed):
    ids, logits = candidates(seed)
    if step.kind == ELEMENTWISE or step.truncates(params, ids.size):
        return  # elementwise steps may ban (logit_bias): checked below
    out_ids, _ = step.run(ids, logits, params, ctx_for(seed, params))
    assert sorted(out_ids.tolist()) == sorted(ids.tolist())


@pytest.mark.parametrize("step", [s for s in STEPS if s.kind == ELEMENTWISE], ids=lambda s: s.name)
@settings(max_examples=150, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1))
def test_elementwise_changes_only_what_it_touches(step, params, seed):
    ids, logits = candidates(seed)
    hist = history(seed, params)
    touched = step.touches(params, ctx_for(seed, params))
    assert np.array_equal(touched, np.unique(touched))  # sorted, unique
    out_ids, out_logits = step.run(ids, logits, params, ctx_for(seed, params))
    before = dict(zip(ids.tolist(), logits.tolist()))
    after = dict(zip(out_ids.tolist(), out_logits.tolist()))
    untouched = set(before) - set(touched.tolist())
    forced = step.name == "logit_bias" and any(
        b >= 1e9 and t in before for t, b in params.logit_bias)
    if forced:  # a forced token drops every other candidate
        assert set(after) <= set(touched.tolist())
        return
    assert untouched <= set(after)
    assert all(after[t] == before[t] for t in untouched)


def test_docs_table_is_generated_from_the_rows():
    from pathlib import Path

    from clickpaca.sampling import registry

    doc = (Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    block = doc.split("<!-- sampler-table:start -->\n", 1)[1].split("\n<!-- sampler-table:end -->", 1)[0]
    assert block == registry.docs_table()
    for p in registry.all_params():
        assert f"| `{p.wire}` |" in block


# ------------------------------------------------------------------ shared state and keep-one
#
# ``shared_state`` decides whether a chain may be sampled on a worker thread
# (sampling/batch.py); nothing else enforces it, so every row is run here on a worker
# thread with the objects that sequences share watched: the vocabulary (a recorder in
# front of it), the history list (the engine's own: a step may read it, never change it)
# and module-level state (every function the row's callables execute, in clickpaca or in
# a test, is read for its global names, followed through modules, and a name bound to a
# mutable object — a list, a dict, a set, a non-empty writable array, an instance that is
# not a frozen dataclass or a threading.local — counts, as does any assignment to a
# global). A row that
# touches one must say so; one that says so must touch one.

import dataclasses
import dis
import enum
import sys
import threading
import types
from pathlib import Path

from clickpaca.sampling.cut import RowView
from clickpaca.sampling.vocab import Vocab

ROOT = Path(__file__).resolve().parent.parent

#: Parameters that switch each built-in step on (a new step needs its line here).
ON = {
    "grammar": {},  # run by the chain from the bitmask: only its off() is a callable
    "logit_bias": {"logit_bias": {3: 2.0, 5: -1e9}},
    "penalties": {"penalty_repeat": 1.3, "penalty_freq": 0.5},
    "dry": {"dry_multiplier": 0.8, "dry_allowed_length": 1},  # the default breakers: they need the vocabulary
    "top_n_sigma": {"top_n_sigma": 1.0},
    "top_k": {"top_k": 5},
    "typical_p": {"typical_p": 0.5},
    "min_p": {"min_p": 0.1},
    "top_p": {"top_p": 0.5},
    "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.01},
    "temperature": {"temperature": 0.5},
    "dynatemp": {"dynatemp_range": 0.5},
    "mirostat": {"mirostat": 1},
    "mirostat_v2": {"mirostat": 2},
}


class _Model:
    """A byte vocabulary: token i is the byte i (what Vocab reads from a model)."""

    n_vocab = V

    def token_to_piece(self, t: int, special: bool = True) -> bytes:
        return bytes([t + 32])

    def tokenize(self, data: bytes, add_special: bool = False, parse_special: bool = False) -> np.ndarray:
        return np.frombuffer(data, np.uint8).astype(np.int32) - 32


class _Watched:
    """The vocabulary behind a recorder of every attribute a step reads from it."""

    def __init__(self, vocab: Vocab, seen: list) -> None:
        object.__setattr__(self, "_v", vocab)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str):
        self._seen.append(f"ctx.vocab.{name}")
        return getattr(self._v, name)


class _History(list):
    """The sequence's token list, recording any change a step makes to it."""

    def __init__(self, tokens, seen: list) -> None:
        super().__init__(tokens)
        self._seen = seen


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__"):
    def _write(self, *a, _name=_name, **k):
        self._seen.append(f"ctx.history.{_name}")
        return getattr(list, _name)(self, *a, **k)
    setattr(_History, _name, _write)


def _mutable(v, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, range, np.generic, enum.Enum)):
        return False
    if isinstance(v, (types.ModuleType, type, threading.local)) or callable(v):
        return False  # threading.local: each thread sees its own (cut's scratch buffers)
    if isinstance(v, (tuple, frozenset)):
        return depth < 4 and any(_mutable(x, depth + 1) for x in v)
    if isinstance(v, np.ndarray):
        return v.size > 0 and v.flags.writeable
    if dataclasses.is_dataclass(v) and v.__dataclass_params__.frozen:
        return any(_mutable(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v))
    return True


def _global_state(code: types.CodeType, g: dict) -> list[str]:
    """The module-level mutable objects (and global assignments) in one function's code."""
    out = []
    ins = list(dis.get_instructions(code))
    for i, x in enumerate(ins):
        if x.opname == "STORE_GLOBAL":
            out.append(f"assigns global {x.argval}")
        if x.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
            continue
        name = x.argval
        if name not in g:
            continue  # a builtin
        v, where = g[name], name
        j = i + 1
        while isinstance(v, types.ModuleType) and j < len(ins) and ins[j].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            v, where = getattr(v, ins[j].argval, None), f"{where}.{ins[j].argval}"
            j += 1
        if _mutable(v):
            out.append(f"{Path(code.co_filename).name}:{code.co_name} reads {where} ({type(v).__name__})")
    return list(dict.fromkeys(out))


def shared_touches(step, params: SamplerParams, seed: int = 0) -> list[str]:
    """Run every callable of the row as the chain would, on a worker thread; what shared
    state it touched (empty: none)."""
    seen: list[str] = []
    codes: dict = {}
    vocab = _Watched(Vocab(_Model()), seen)
    history = _History(np.random.default_rng(seed).integers(0, 12, 40).tolist(), seen)
    hist = (np.array([1, 4, 7], np.int32), np.array([2.0, 1.0, 3.0]))
    rng = np.random.default_rng(seed)
    row = rng.normal(0, 3, V).astype(np.float32)
    ids, logits = np.arange(V, dtype=np.int32), row.astype(np.float64)
    ctx = StepContext(hist, history, vocab, {}, {}, seed, V)
    failed: list[BaseException] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not exercise.__code__:
            codes.setdefault(frame.f_code, frame.f_globals)

    def exercise():
        step.off(params, True)
        step.truncates(params, V)
        touched = step.touches(params, ctx) if step.touches is not None else np.empty(0, np.int32)
        if step.cut is not None:
            step.cut(RowView(row), params, 1.0, None, 1.0, touched, row[touched].astype(np.float64))
        if step.run is not None:
            out_ids, _ = step.run(ids, logits, params, ctx)
            for used in ctx.used:
                if used.sampled is not None and out_ids.size:
                    used.sampled(ctx.states[used.name], int(out_ids[0]), params)

    def worker():
        sys.setprofile(profile)
        try:
            exercise()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            failed.append(e)
        finally:
            sys.setprofile(None)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    for code, g in codes.items():
        f = Path(code.co_filename)  # ours and the tests', not numpy's or the import system's
        if f.is_absolute() and any(f.resolve().is_relative_to(ROOT / d) for d in ("clickpaca", "tests")):
            seen.extend(_global_state(code, g))
    return seen


def test_every_row_that_touches_shared_state_says_so():
    rows = R.steps()
    assert set(ON) == {s.name for s in rows}, "a new step needs its parameters in ON"
    touched = {}
    for s in rows:
        p = SamplerParams(**ON[s.name])
        assert s.run is None or not s.off(p, True), s.name  # ON switches it on
        touched[s.name] = shared_touches(s, p)
    unsaid = {n: w for n, w in touched.items() if w and not R.step(n).shared_state}
    assert not unsaid, f"rows that touch shared state without saying so (shared_state=True): {unsaid}"
    assert {n for n, w in touched.items() if w} == {s.name for s in rows if s.shared_state}
    assert touched["dry"]  # the one built-in that does: the vocabulary and its memo


_MEMO_38: dict = {}  # module-level state a careless step might keep


def test_the_check_catches_a_step_that_does_not_say_so():
    """Test-only steps, registered like any other and marked like a new step left
    unmarked: each kind of shared access is caught; marked, the same step passes."""
    def peek(ids, logits, p, ctx):  # reads token text: the shared vocabulary
        ctx.vocab.pieces()
        return ids, logits

    def memo(ids, logits, p, ctx):  # keeps a memo at module level
        _MEMO_38[p.top_k] = ids.size
        return ids, logits

    def grow(ids, logits, p, ctx):  # changes the engine's history list
        ctx.history.append(0)
        return ids, logits

    def registry(ids, logits, p, ctx):  # looks itself up in the live registry
        ctx.uniform(R.step("registry_38"))
        return ids, logits

    for fn, what in ((peek, "ctx.vocab.pieces"), (memo, "reads _MEMO_38 (dict)"),
                     (grow, "ctx.history.append"), (registry, "reads _by_name (dict)")):
        name = fn.__name__ + "_38"
        for marked in (False, True):
            R.register(R.Step(name, R.GENERAL, run=fn, off=lambda p, h: False, shared_state=marked))
            try:
                got = shared_touches(R.step(name), SamplerParams())
                assert any(what in w for w in got), (name, got)
                if marked:
                    continue
                with pytest.raises(AssertionError, match=f"without saying so.*{name}"):
                    ON[name] = {}
                    try:
                        test_every_row_that_touches_shared_state_says_so()
                    finally:
                        del ON[name]
            finally:
                R.unregister(name)
    # the same function with nothing shared passes
    R.register(R.Step("quiet_38", R.GENERAL, run=lambda ids, logits, p, ctx: (ids[:3], logits[:3]),
                      off=lambda p, h: False))
    try:
        assert shared_touches(R.step("quiet_38"), SamplerParams()) == []
    finally:
        R.unregister("quiet_38")


@pytest.mark.parametrize("step", [s for s in STEPS if s.keeps_one], ids=lambda s: s.name)
@settings(max_examples=100, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32 - 1), tok=st.integers(0, V - 1),
       logit=st.floats(-30, 30))
def test_keeps_one_keeps_a_one_token_set(step, params, seed, tok, logit):
    """What ``keeps_one`` claims (chain.greedy_tail relies on it): run on a one-token
    set, the step keeps the token (its logit may be rescaled)."""
    out_ids, out_logits = step.run(np.array([tok], np.int32), np.array([logit]), params, ctx_for(seed, params))
    assert out_ids.tolist() == [tok] and out_logits.size == 1 and np.isfinite(out_logits[0])
