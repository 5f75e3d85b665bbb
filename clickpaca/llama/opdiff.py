"""Which graph nodes make one token's result depend on what else is decoded: experiments.

    python -m clickpaca.llama.opdiff [--repack 0|1] [--fa on|off] [--unified 0|1] [EXPERIMENT ...]
    python -m clickpaca.llama.opdiff --cache turbo3 --fa on --dump A.pkl      # on one build
    python -m clickpaca.llama.opdiff --against A.pkl B.pkl                     # B made on another

Each experiment decodes the same token of sequence 0 twice, on two fresh contexts differing
in one thing, records every node (opdump.py) and prints the nodes that are sources of a
difference: gen (alone or beside 7 other sequences' tokens), chunk (a 24-token prompt whole
or as 16 + 8), chunk1 (23 + 1), batch (beside 7 other prompts), placement (after another
sequence's cells), fork (continued in a fork). Across builds (two libraries cannot share a
process) `--dump` saves every node of one 96-token prompt on the build that serves `--cache`,
and `--against` compares two dumps at its first, 64th and last token: a source there is a
kernel that rounds differently on the two builds. Findings: docs/DETERMINISM.md.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import numpy as np

from . import core
from .cachetypes import DEFAULT, build_for, parse_pair
from .models import resolve_model
from .opdump import OpRecorder, compare, summary

N_SEQ = 8
PROMPT = 24
DUMP_TOKENS = 96  # one micro-batch of at least 64 query rows: flash attention's tiled path
TEXT = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the "
        "morning light. A river runs through the valley and the children play on its banks until "
        "the sun goes down behind the hills. In the city, trains arrive every few minutes and the "
        "market opens before dawn, when bakers pull bread from their ovens and the streets smell "
        "of coffee. Scientists measure the temperature of the ocean at many depths to learn how heat "
        "moves around the planet over decades. The library keeps old maps of the coast, drawn by "
        "sailors who charted every rock and shoal with great care and patience. ")


class Rig:
    """One model and a way to make fresh contexts with a recorder attached."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = core.Model(resolve_model(None), repack=bool(args.repack), build=args.build)
        toks = self.model.tokenize(TEXT * 4, add_special=False)
        self.prompts = [np.concatenate([[self.model.bos], toks[i * (PROMPT - 1):(i + 1) * (PROMPT - 1)]])
                        .astype(np.int32) for i in range(N_SEQ)]

    def context(self) -> tuple[core.Context, OpRecorder, core.Batch]:
        rec = OpRecorder(self.model.nat)
        ctx = core.Context(self.model, n_ctx=1024, n_batch=512, n_seq_max=N_SEQ, n_threads=self.args.threads,
                           flash_attn=self.args.fa, kv_unified=bool(self.args.unified),
                           type_k=self.args.type_k, type_v=self.args.type_v, eval_callback=rec.callback)
        return ctx, rec, core.Batch(self.model.nat, 512)

    def decode(self, ctx: core.Context, batch: core.Batch, parts: list[tuple[int, np.ndarray, int]]) -> np.ndarray:
        """Decode (seq, tokens, pos0) parts in one batch, logits of every token; the rows."""
        batch.clear()
        for seq, toks, pos0 in parts:
            batch.add(toks, pos0, seq, output_last=True, output_all=True)
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return ctx.logits().copy()


def run(rig: Rig, steps: list[list[tuple[int, np.ndarray, int]]], record_from: int) -> tuple:
    """Decode the steps in order on a fresh context; record only from step `record_from`."""
    ctx, rec, batch = rig.context()
    try:
        for i, parts in enumerate(steps):
            if isinstance(parts, tuple):  # a memory operation: ("rm", seq, p0) or ("cp", src, dst)
                if parts[0] == "rm":
                    ctx.seq_rm(parts[1], parts[2], -1)
                else:
                    ctx.seq_cp(parts[1], parts[2], -1, -1)
                continue
            rec.armed = i >= record_from
            logits = rig.decode(ctx, batch, parts)
        return rec.evals, logits
    finally:
        ctx.close()


def experiment(rig: Rig, name: str) -> None:
    p = rig.prompts
    nxt = [np.array([int(t) + 1], np.int32) for t in range(N_SEQ)]  # any next token
    prefill = [[(s, p[s], 0)] for s in range(N_SEQ)]
    if name == "gen":
        a = run(rig, prefill + [[(0, nxt[0], PROMPT)]], N_SEQ)
        b = run(rig, prefill + [[(s, nxt[s], PROMPT) for s in range(N_SEQ)]], N_SEQ)
        own = list(range(PROMPT)) + [N_SEQ * PROMPT] if rig.args.unified else list(range(PROMPT + 1))
        pairs = ((a, 1, 0, 0, own), (b, N_SEQ, 0, 0, own))
    elif name in ("chunk", "chunk1"):
        cut = 16 if name == "chunk" else PROMPT - 1
        a = run(rig, [[(0, p[0], 0)]], 0)
        b = run(rig, [[(0, p[0][:cut], 0)], [(0, p[0][cut:], cut)]], 1)
        own = list(range(PROMPT))
        pairs = ((a, PROMPT, PROMPT - 1, -1, own), (b, PROMPT - cut, PROMPT - cut - 1, -1, own))
    elif name == "batch":
        a = run(rig, [[(0, p[0], 0)]], 0)
        b = run(rig, [[(s, p[s], 0) for s in range(N_SEQ)]], 0)
        own = list(range(PROMPT))
        pairs = ((a, PROMPT, PROMPT - 1, PROMPT - 1, own), (b, PROMPT * N_SEQ, PROMPT - 1, PROMPT - 1, own))
    elif name == "placement":
        a = run(rig, [[(0, p[0], 0)]], 0)
        b = run(rig, [[(1, p[1], 0)], [(0, p[0], 0)]], 1)
        pairs = ((a, PROMPT, PROMPT - 1, -1, list(range(PROMPT))),
                 (b, PROMPT, PROMPT - 1, -1, list(range(PROMPT, 2 * PROMPT))))
    elif name == "fork":
        q = np.concatenate([p[0][-1:], p[1][1:9]])  # the held doc's last token re-fed, then 8 more
        a = run(rig, [[(1, p[0], 0)], ("rm", 1, PROMPT - 1), [(1, q, PROMPT - 1)]], 2)
        b = run(rig, [[(1, p[0], 0)], ("cp", 1, 2), ("rm", 2, PROMPT - 1), [(2, q, PROMPT - 1)]], 3)
        n = PROMPT - 1 + len(q)
        shift = 1 if rig.args.unified else 0  # the source keeps the doc's last cell in a shared buffer
        pairs = ((a, len(q), len(q) - 1, -1, list(range(n))),
                 (b, len(q), len(q) - 1, -1, list(range(PROMPT - 1)) + list(range(PROMPT - 1 + shift, n + shift))))
    else:
        raise SystemExit(f"unknown experiment {name!r}")
    (ra, na, rowa, la, ca), (rb, nb, rowb, lb, cb) = pairs
    evals_a, logits_a = ra
    evals_b, logits_b = rb
    diffs = compare(evals_a[0], na, rowa, evals_b[0], nb, rowb, ca, cb)
    print(f"{name}: {len(evals_a)} / {len(evals_b)} graph evaluations recorded")
    print(summary(diffs))
    la = logits_a[la]
    lb = logits_b[lb]
    print(f"  logits of the token: {'identical' if np.array_equal(la, lb) else 'differ, max |d| %.4g' % np.abs(la - lb).max()}")


def dump(rig: Rig, path: str) -> None:
    """Record the prompt's one evaluation and write it, with its build, to `path`."""
    toks = rig.model.tokenize(TEXT * 4, add_special=True)[:rig.args.tokens].astype(np.int32)
    (evals, logits) = run(rig, [[(0, toks, 0)]], 0)
    info = rig.model.nat.info
    meta = {"build": rig.args.build, "build_dir": str(rig.model.nat.build_dir.resolve()), "key": info.get("key"),
            "isa": (info.get("cpu") or {}).get("isa"), "experiment": info.get("experiment"),
            "cache": f"{rig.args.type_k}/{rig.args.type_v}", "fa": rig.args.fa, "repack": rig.args.repack}
    with open(path, "wb") as f:
        pickle.dump({"meta": meta, "eval": evals[0], "logits": logits}, f, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"dump: {len(evals[0].nodes)} nodes of {len(toks)} tokens, {meta['cache']} on {meta['build_dir']} -> {path}")


def against(a_path: str, b_path: str) -> None:
    """Two dumps of the same prompt from two builds, node by node at its first, 64th and
    last token."""
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    for tag, d in (("A", a), ("B", b)):
        m = d["meta"]
        print(f"{tag}: {m['cache']} fa {m['fa']} repack {m['repack']} on {m['build_dir']} (key {m['key']})"
              + (f"; {m['experiment']}" if m.get("experiment") else ""))
    n = len(a["logits"])
    if len(b["logits"]) != n:
        raise SystemExit(f"--against: a prompt of {n} tokens against one of {len(b['logits'])}")
    for row in sorted({0, min(63, n - 1), n - 1}):
        diffs = compare(a["eval"], n, row, b["eval"], n, row)
        print(f"token {row}:")
        print(summary(diffs))
    la, lb = a["logits"][-1], b["logits"][-1]
    print(f"  logits of the last token: {'identical' if np.array_equal(la, lb) else 'differ, max |d| %.4g' % np.abs(la - lb).max()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.llama.opdiff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repack", type=int, default=1)
    ap.add_argument("--fa", default="off", choices=["on", "off"])
    ap.add_argument("--unified", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cache", default=DEFAULT,
                    help=f"K/V cache type, or a K/V pair as q8_0/turbo3 (default {DEFAULT})")
    ap.add_argument("--build", default=None, help="default: the one that serves the cache type")
    ap.add_argument("--dump", metavar="FILE", help="record one prompt on this build into FILE and stop")
    ap.add_argument("--tokens", type=int, default=DUMP_TOKENS,
                    help=f"--dump: the prompt's tokens, one micro-batch (default {DUMP_TOKENS}; under 64 "
                         "flash attention takes its row-by-row path)")
    ap.add_argument("--against", nargs=2, metavar=("A", "B"), help="compare two dumps (of two builds)")
    ap.add_argument("experiments", nargs="*", default=["gen", "chunk", "chunk1", "batch", "placement", "fork"])
    args = ap.parse_args(argv)
    if args.against:
        against(*args.against)
        return 0
    args.type_k, args.type_v = parse_pair(args.cache)
    args.build = args.build or build_for(args.type_k, args.type_v)
    print(f"repack {args.repack} fa {args.fa} unified {args.unified} threads {args.threads} "
          f"GGML_CPU_TILED_MM={os.environ.get('GGML_CPU_TILED_MM', '(unset: on)')}")
    rig = Rig(args)
    if args.dump:
        dump(rig, args.dump)
        return 0
    for name in args.experiments:
        if name == "placement" and not args.unified:
            continue
        experiment(rig, name)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
