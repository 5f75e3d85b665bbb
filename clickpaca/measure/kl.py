"""KL divergence and top-1 agreement between ways of computing the same windows, in-process.

The server's `score` returns only the NLL of each text token, not the full
distribution, so the comparison runs the same windows as `score` (scoring.windows_for:
llama-perplexity's chunks, second half of each window scored) through one Context per
`Variant` and compares the log-softmax rows position by position against each reference
variant's:
  KL(P_ref || P) = sum_v p_ref(v) (log p_ref(v) - log p(v)),
  top-1 agreement = argmax_v p_ref == argmax_v p.
A variant is a cache type (the effect measured), or the default f16 computation changed
in one thing that should not matter (the noise floor: chunking, batch shape, cell
placement, flash attention, weight repacking), or the exact reference (f32 K/V, flash
attention off, which computes attention in f32).
A reference's rows of one window are kept (each row is 1 MiB at 262,144 tokens); other
variants' rows are compared STEP at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ..llama import core
from ..llama.cachetypes import DEFAULT, EXACT, attention
from ..wire.scoring import chunk_rows, log_softmax, windows_for
from ..results.stats import progress

STEP = 64


@dataclass(frozen=True)
class Variant:
    """One way to compute the windows' distributions."""

    name: str
    type_k: str = DEFAULT
    type_v: str = DEFAULT
    flash_attn: str = "on"
    repack: bool = True
    chunk: int = STEP  # tokens of the window per decode (prompt chunking)
    company: int = 0  # other windows decoded in the same batches (batch shape)
    offset: int = 0  # cells another sequence holds before the window's (cell placement)
    #: called with the model's Native, returns an object whose `callback` goes to the
    #: Context as its eval callback (measure/kvsim: K/V rewritten by a simulated type)
    hook: Any = None

    @property
    def pair(self) -> str:
        return f"{self.type_k}/{self.type_v}"


#: The exact reference: attention in f32 (flash attention would cast K/V to f16).
F32_REF = Variant(f"{EXACT} (flash attention off)", EXACT, EXACT, flash_attn="off")

#: The fast default (f16, flash attention on, repacked weights, one KV buffer), the
#: noise floor's baseline, and each thing that should not matter changed alone.
NOISE_BASE = Variant(f"{DEFAULT} default")
NOISE = (
    Variant("prompt chunks of 16 (not 64)", chunk=16),
    Variant("with 3 other windows in each batch", company=3),
    Variant("cells after 100 of another sequence", offset=100),
    Variant("flash attention off", flash_attn="off"),
    Variant("weights not repacked", repack=False),
)


def kl_rows(logp_ref: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) per row, in nats (float64 sums)."""
    p = np.exp(logp_ref)
    return (p * (logp_ref - logp)).sum(axis=1, dtype=np.float64)


class _Runner:
    """A Context (and batch) for one variant; `rows` yields its scored rows of a window."""

    def __init__(self, model: core.Model, v: Variant, window: int, threads: int | None) -> None:
        self.v = v
        n_batch = max(v.chunk * (1 + v.company), v.offset, 8)
        n_ctx = -(-(window * (1 + v.company) + v.offset) // 256) * 256
        self.hook = v.hook(model.nat) if v.hook is not None else None
        self.ctx = core.Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                n_seq_max=v.company + 2, type_k=v.type_k, type_v=v.type_v,
                                n_threads=threads, flash_attn=v.flash_attn,
                                eval_callback=self.hook.callback if self.hook is not None else None)
        self.batch = core.Batch(model.nat, n_batch)

    def rows(self, wins: list, wi: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first scored position, log-prob rows) blocks of window wi, in position order."""
        ctx, batch, v = self.ctx, self.batch, self.v
        toks, first = wins[wi]
        last = len(toks) - 2
        ctx.clear()
        if v.offset:
            batch.clear()
            batch.add(toks[:v.offset], 0, 1, output_last=False)
            self._decode()
        company = [wins[(wi + 1 + j) % len(wins)][0] for j in range(v.company)]
        for start in range(0, len(toks), v.chunk):
            chunk = toks[start:start + v.chunk]
            lo, n_out = chunk_rows(start, len(chunk), first, last)
            batch.clear()
            batch.add(chunk, start, 0, output_last=False)
            if n_out:
                batch.logits[lo - start: lo - start + n_out] = 1
            for j, other in enumerate(company):
                batch.add(other[start:start + len(chunk)], start, 2 + j, output_last=False)
            self._decode()
            if n_out:
                logits = ctx.logits()
                for a in range(0, n_out, STEP):
                    yield lo + a, log_softmax(logits[a:a + STEP])

    def _decode(self) -> None:
        rc = self.ctx.decode(self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {self.v.name}")

    def close(self) -> None:
        self.ctx.close()


def compare_variants(model_path: str, variants: list[Variant], refs: list[int], tokens: np.ndarray,
                     window: int, build: str = "mainline",
                     threads: int | None = None, score_last: int | None = None,
                     keep_refused: bool = False) -> list[dict[str, Any]]:
    """Per variant: ppl, nll, per-position NLL, and against each reference variant (indices
    into `variants`) KL statistics and top-1 agreement, under "vs" keyed by its name.
    score_last: score each window's last positions only (scoring.windows_for).
    keep_refused: a variant whose context llama.cpp refuses (core.ContextError: a cache type
    the model's shapes or the attention cannot take) gets a record of its own with "error"
    (the refusal, naming its types) and no values, and the others are measured as usual
    (against the references that were not refused); without it, the refusal is raised."""
    models: dict[bool, core.Model] = {}
    runners: dict[int, _Runner] = {}
    refused: dict[int, str] = {}
    try:
        for i, v in enumerate(variants):
            if v.repack not in models:
                models[v.repack] = core.Model(model_path, build=build, repack=v.repack)
            try:
                runners[i] = _Runner(models[v.repack], v, window, threads)
            except core.ContextError as e:
                if not keep_refused:
                    raise
                refused[i] = f"{v.name} (K {v.type_k}, V {v.type_v}, flash attention {v.flash_attn}): {e}"
                progress(f"kl: {refused[i]}")
        m = next(iter(models.values()))
        wins = windows_for(tokens, window, m.bos if m.add_bos else None, score_last)
        refs = [r for r in refs if r not in refused]
        order = refs + [i for i in range(len(variants)) if i not in refs and i not in refused]
        # each variant against every reference computed before it (a reference: the ones before it)
        before = {i: refs[:refs.index(i)] if i in refs else refs for i in order}
        nll: list[list[float]] = [[] for _ in variants]
        kl = [{r: [] for r in before.get(i, [])} for i in range(len(variants))]
        top1 = [{r: [] for r in before.get(i, [])} for i in range(len(variants))]
        for wi in range(len(wins)):
            progress(f"kl: window {wi + 1}/{len(wins)}")
            toks, first = wins[wi]
            kept: dict[int, np.ndarray] = {}  # reference -> its rows of the window's scored positions
            for i in order:
                if i in refs:
                    kept[i] = np.empty((len(toks) - 1 - first, m.n_vocab), dtype=np.float32)
                for pos, logp in runners[i].rows(wins, wi):
                    n = len(logp)
                    nll[i].extend((-logp[np.arange(n), toks[pos + 1:pos + 1 + n]]).tolist())
                    for r in kl[i]:
                        ref = kept[r][pos - first:pos - first + n]
                        kl[i][r].extend(kl_rows(ref, logp).tolist())
                        top1[i][r].extend((ref.argmax(axis=1) == logp.argmax(axis=1)).tolist())
                    if i in refs:
                        kept[i][pos - first:pos - first + n] = logp
    finally:
        for r in runners.values():
            r.close()
        for model in models.values():
            model.close()
    out = []
    for i, v in enumerate(variants):
        if i in refused:
            out.append({"variant": v.name, "cache_k": v.type_k, "cache_v": v.type_v, "flash_attn": v.flash_attn,
                        "error": refused[i], "vs": {}})
            continue
        n = np.asarray(nll[i])
        rec: dict[str, Any] = {"variant": v.name, "cache_k": v.type_k, "cache_v": v.type_v,
                               "flash_attn": v.flash_attn, "tokens": len(n), "nll": float(n.mean()),
                               "ppl": float(np.exp(n.mean())), "windows": len(wins),
                               "token_nll": nll[i], "vs": {}}
        for r in kl[i]:
            d = np.asarray(kl[i][r])
            rec["vs"][variants[r].name] = {
                "kl_mean": float(d.mean()), "kl_median": float(np.median(d)),
                "kl_p99": float(np.quantile(d, 0.99)), "kl_max": float(d.max()),
                "top1_agreement": float(np.mean(top1[i][r])),
                "dppl": float(np.exp(n.mean()) - np.exp(np.mean(nll[r]))),
                "token_kl": kl[i][r], "token_top1": [float(x) for x in top1[i][r]]}
        out.append(rec)
    return out


def compare(model_path: str, pairs: list[tuple[str, str]], tokens: np.ndarray, window: int,
            build: str = "mainline", threads: int | None = None) -> dict[str, dict[str, Any]]:
    """Per cache pair 'k/v' (flash attention on, as llama-perplexity -fa on): ppl, nll, and
    (for all but the first) KL and top-1 vs the first; the per-position values under
    token_nll, token_kl, token_top1 (paired comparisons)."""
    variants = [Variant(f"{k}/{v}", k, v, flash_attn=attention(k, v)) for k, v in pairs]
    recs = compare_variants(model_path, variants, [0], tokens, window, build, threads)
    out = {}
    for v, rec in zip(variants, recs):
        vs = rec["vs"].get(variants[0].name)
        rec.update(vs if vs else {"kl_mean": 0.0, "top1_agreement": 1.0})
        out[v.name] = rec
    return out

