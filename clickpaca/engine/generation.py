"""What a generating sequence does with its logits row after a decode: sample through
its own sampler chain and grammar mask, then emit the token (with log-probabilities
when asked) and end the request when it is over: an end-of-generation token, a
completed grammar, a stop string or maxTokens. The InferJob's half that needs the
tick's rows; it also starts the tick's grammar masks (the only reader of matchers
besides the job).
"""

from __future__ import annotations

import numpy as np

from .mask_ahead import MaskJob
from ..protocol import token_event
from ..sampling import SampleResult
from ..sampling.batch import sample_tick
from ..usersteps import StepFailed
from .jobs import InferJob
from .runtime import Runtime
from .sequences import Sequence, Sequences


def start_masks(rt: Runtime, sampling: list[Sequence]) -> MaskJob:
    """Start filling the grammar masks of the sequences that sample this tick (their
    InferJobs: only they sample) that have a grammar; mask_ahead.py runs it during the
    decode."""
    return rt.masks.start([(seq.slot, seq.job.matcher) for seq in sampling if seq.job.matcher is not None])


def sample(rt: Runtime, seqs: Sequences, sampling: list[tuple[Sequence, int]], logits: np.ndarray,
           job: MaskJob) -> None:
    """Sample each (sequence, row) of this tick and accept the token. The tick's rows go
    to sampling.batch.sample_tick at once: greedy and top-k chains without a grammar share
    passes over the block, every other row runs its own chain, spread over the decode's
    threads (idle while the host samples); the results are bit for bit the per-sequence
    ones (tests/test_sampling_batch.py)."""
    gens = [seq.job for seq, _ in sampling]  # InferJobs: only they sample
    # the mask job was started for exactly the plan's sampling entries
    masks = [job.row(seq.slot) if gen.matcher is not None else None for (seq, _), gen in zip(sampling, gens)]
    results = sample_tick([gen.sampler for gen in gens], logits, [row for _, row in sampling], masks,
                          isolate=(StepFailed,), threads=rt.ctx.n_threads)
    for (seq, row), gen, mask, res in zip(sampling, gens, masks, results):
        try:
            if isinstance(res, StepFailed):
                raise res
            if res.empty and mask is not None:  # a ban of a token the grammar forces: spell it shorter
                wider = gen.matcher.widen_forced(mask)
                if wider is not None:
                    res = gen.sampler.sample(logits[row], wider)
        except StepFailed as e:  # a user-defined step raised: this sequence ends, the others go on
            seqs.fail(seq, str(e))
            continue
        if res.empty:
            seqs.fail(seq, f"no token can be sampled: {res.reason}")
            continue
        _accept(rt, seqs, seq, gen, int(res.token), res)


def _accept(rt: Runtime, seqs: Sequences, seq: Sequence, gen: InferJob, token: int, res: SampleResult) -> None:
    # A sampled token enters the context: the sequence's one history takes it (the
    # sampler reads that list: its penalty window follows at the next draw; the next
    # tick feeds it to the KV cells); the matcher just below.
    seq.tokens.append(token)
    if rt.model.is_eog(token):
        grammar_done = gen.matcher is not None and gen.matcher.is_accepting()
        seqs.finish(seq, "grammar" if grammar_done else "eos")
        return
    if gen.matcher is not None and not gen.matcher.consume(token):
        seqs.fail(seq, f"grammar rejected token {token} (matcher: {gen.matcher.error()})")
        return
    piece = gen.utf8.feed(rt.model.token_to_piece(token, special=True))
    logprobs = None
    if gen.sampler.params.n_probs:
        logprobs = {"logprob": res.logprob, "top": _top(rt, res.top),
                    "steered_logprob": res.steered_logprob, "steered_top": _top(rt, res.steered_top)}
    if res.trace is not None:
        logprobs = {**(logprobs or {}), "trace": res.trace}
    seq.session.send(token_event(seq.seq_id, token, piece, logprobs))
    gen.n_predicted += 1
    stop = gen.stops.feed(piece) if gen.stops else None
    if stop is not None:
        seqs.finish(seq, "stop", stop=stop)
    elif gen.matcher is not None and gen.matcher.is_stopped():
        seqs.finish(seq, "grammar")
    elif gen.n_predicted >= gen.max_tokens:
        seqs.finish(seq, "max_tokens")


def _top(rt: Runtime, pairs) -> list[dict]:
    return [{"token": t, "piece": rt.piece(t), "logprob": lp} for t, lp in pairs]
