"""One haystack through one setup: prefilled once, every question asked through a fork.

The haystack goes into sequence 0 in prompt chunks; each question gets its own sequence,
a fork of sequence 0 (llama_memory_seq_cp: the forks share the haystack's cells, nothing
is computed again). Each fork then decodes its question followed by the answer
(teacher forcing), which gives the rows that predict the answer's tokens; those answer
cells are removed and the fork continues greedily from the question, which gives the
model's own answer. All forks share each decode (or, `solo`, one fork per decode: the
batch-shape variant of the noise floor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...llama import core, kvcenter
from ...llama.cachetypes import DEFAULT
from ...wire.scoring import log_softmax


@dataclass(frozen=True)
class Setup:
    """One way to compute the answers: a cache type, or the f16 default changed in one
    thing that should not matter (the noise floor), or the exact f32 reference."""

    name: str
    type_k: str = DEFAULT
    type_v: str = DEFAULT
    flash_attn: str = "on"
    repack: bool = True
    chunk: int = 256  # haystack tokens per decode (prompt chunking)
    offset: int = 0  # cells another sequence holds before the haystack's (cell placement)
    solo: bool = False  # questions one per decode instead of all forks in one (batch shape)
    centered: bool = False  # keys stored minus the study's center (--center; llama/kvcenter.py)

    @property
    def pair(self) -> str:
        return f"{self.type_k}/{self.type_v}"


@dataclass
class Answer:
    """What one fork gave: log-prob rows of the answer's tokens, the greedy tokens."""

    logp: np.ndarray  # [len(answer), n_vocab] log-softmax rows, row j predicts answer[j]
    answer_logp: float  # sum of log p(answer[j] | ...) in nats
    greedy: list[int]


def _ctx_size(hay: int, qa: list[tuple[np.ndarray, np.ndarray]], offset: int, max_new: int) -> int:
    forks = sum(len(q) + max(len(a), max_new) for q, a in qa)
    return -(-(hay + offset + forks + 16) // 256) * 256


def run(model: core.Model, s: Setup, hay: np.ndarray, qa: list[tuple[np.ndarray, np.ndarray]],
        max_new: int, threads: int | None = None,
        center: kvcenter.Center | None = None) -> tuple[list[Answer], dict[str, Any]]:
    """(one Answer per question, timings). qa: (question tokens, answer tokens) pairs;
    `center`: the key center a `centered` setup sets on its context."""
    if s.centered and center is None:
        raise ValueError(f"{s.name}: a centered setup needs the center (--center)")
    hay = np.asarray(hay, dtype=np.int32)
    groups = [[i] for i in range(len(qa))] if s.solo else [list(range(len(qa)))]
    feed = [np.concatenate([q, a[:-1]]).astype(np.int32) for q, a in qa]
    n_batch = max(s.chunk, s.offset, 8, *(sum(len(feed[i]) for i in g) for g in groups))
    ctx = core.Context(model, n_ctx=_ctx_size(len(hay), qa, s.offset, max_new), n_batch=n_batch,
                       n_ubatch=n_batch, n_seq_max=len(qa) + 2, type_k=s.type_k, type_v=s.type_v,
                       n_threads=threads, flash_attn=s.flash_attn)
    batch = core.Batch(model.nat, n_batch)
    other = len(qa) + 1  # the sequence whose cells come first (offset)

    def decode() -> None:
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {s.name}")

    try:
        if s.centered:
            kvcenter.apply(ctx, center)
        if s.offset:
            batch.clear()
            batch.add(hay[:s.offset], 0, other, output_last=False)
            decode()
        t0 = time.perf_counter()
        for start in range(0, len(hay), s.chunk):
            batch.clear()
            batch.add(hay[start:start + s.chunk], start, 0, output_last=False)
            decode()
        t_prefill = time.perf_counter() - t0
        for i in range(len(qa)):
            ctx.seq_cp(0, 1 + i)
        p0 = len(hay)
        answers: list[Answer | None] = [None] * len(qa)
        t0 = time.perf_counter()
        for g in groups:
            batch.clear()
            for i in g:
                q, a = qa[i]
                row = batch.add(feed[i], p0, 1 + i, output_last=False)
                batch.logits[row + len(q) - 1: row + len(feed[i])] = 1  # len(a) rows
            decode()
            logits = ctx.logits()
            at = 0
            for i in g:
                a = np.asarray(qa[i][1])
                lp = log_softmax(logits[at:at + len(a)])
                at += len(a)
                answers[i] = Answer(lp, float(lp[np.arange(len(a)), a].sum(dtype=np.float64)),
                                    [int(lp[0].argmax())])
        for i, (q, _) in enumerate(qa):
            ctx.seq_rm(1 + i, p0 + len(q), -1)  # forget the forced answer; continue from the question
        for step in range(1, max_new):
            for g in groups:
                batch.clear()
                for i in g:
                    batch.add([answers[i].greedy[-1]], p0 + len(qa[i][0]) + step - 1, 1 + i)
                decode()
                logits = ctx.logits()
                for j, i in enumerate(g):
                    answers[i].greedy.append(int(logits[j].argmax()))
        t_questions = time.perf_counter() - t0
    finally:
        ctx.close()
    return answers, {"prefill_s": t_prefill, "questions_s": t_questions, "n_ctx": ctx.n_ctx}
