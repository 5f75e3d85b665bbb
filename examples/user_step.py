"""A step of your own in the sampler chain: a bias toward words from a list.

    .venv/bin/python examples/user_step.py            # 24 prompts, bias 0 / 2 / 4 / 8
    .venv/bin/python examples/user_step.py --n 6

The step is the decorated function below: it adds `wordBias` to the logit of the first
token of each word in `words` (with and without a leading space). It is elementwise:
it says which tokens it touches, so the chain runs it on those few tokens only, never
on the whole 262,144-token row. The server loads this very file (`Workbench.spawn(
steps=[__file__])`, i.e. `clickpaca serve --steps examples/user_step.py`); requests
put `word_bias` in `samplers` and pass `words` and `wordBias`, checked like any
built-in parameter. The table shows how often the listed words appear as the bias
grows, and the step's own CPU time per request (`done.steps_ms`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from clickpaca.sampling.usersteps import ELEMENTWISE, choice_strings, param, real, step


def word_ids(words: tuple[str, ...], vocab) -> np.ndarray:
    """Sorted first-token ids of the words, as they start a word or follow a space."""
    def make() -> np.ndarray:
        ids = {vocab.tokenize(form.encode())[0] for w in words for form in (w, " " + w)}
        return np.asarray(sorted(ids), dtype=np.int32)
    return vocab.memo(("word_bias", words), make)


@step("word_bias", ELEMENTWISE,
      params=[param("words", (), choice_strings(64, 32), "words to favour"),
              param("wordBias", 4.0, real(0, 30), "added to the logit of each word's first token")],
      off=lambda p, has_hist: not p.words or p.word_bias == 0,
      touches=lambda p, ctx: word_ids(p.words, ctx.vocab))
def word_bias(ids, logits, p, ctx):
    """Raise the logits of the listed words' first tokens."""
    out = logits.copy()
    out[np.isin(ids, word_ids(p.words, ctx.vocab))] += p.word_bias
    return ids, out


WORDS = ["blue", "green", "silver", "golden", "red"]
PROMPTS = ["The house at the end of the street was", "She opened the box and found", "The sky that evening looked",
           "He painted the old fence", "The dragon's scales were", "In the shop window there was a dress,",
           "The river in spring is", "My grandmother's kitchen had", "The car parked outside was",
           "At the bottom of the lake lay", "The bird on the branch had feathers", "The king wore a crown",
           "Her eyes were", "The door of the cottage was painted", "Autumn leaves turned",
           "The lamp gave off a light that was", "The sea near the harbour was", "On the table stood a vase,",
           "The flag of the ship was", "His bicycle was", "The stone in the ring was", "The fields in June are",
           "The old sign above the door was", "The cat had a collar,"]
# the chain of the built-in steps, with the user's step after the penalties
SAMPLERS = ["logit_bias", "penalties", "word_bias", "top_k", "min_p", "top_p", "temperature"]


def mentions(text: str) -> int:
    return len(re.findall(r"\b(" + "|".join(WORDS) + r")\b", text, flags=re.IGNORECASE))


def main(argv: list[str] | None = None) -> int:
    from clickpaca import Workbench

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_N", len(PROMPTS))))
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_TOKENS", 16)))
    ap.add_argument("--out", default="examples-output")
    args = ap.parse_args(argv)

    prompts = (PROMPTS * (args.n // len(PROMPTS) + 1))[:args.n]
    biases = [0.0, 2.0, 4.0, 8.0]
    items = [{"prompt": p, "label": f"wordBias={b:g}", "wordBias": b} for b in biases for p in prompts]
    with Workbench.spawn(steps=[__file__], nCtx=4096, nSeqMax=16) as wb:
        gens = wb.generate(items, samplers=SAMPLERS, words=WORDS, temperature=0.8, seed=3, maxTokens=args.tokens)
    rows = []
    print(f"words: {', '.join(WORDS)}\n")
    print("| wordBias | outputs with a listed word | listed words per output | step CPU ms per request |")
    print("|--:|--:|--:|--:|")
    for b in biases:
        mine = [g for g in gens if g.label == f"wordBias={b:g}" and g.ok]
        hits = [mentions(g.text) for g in mine]
        ms = [g.steps_ms["word_bias"] for g in mine if g.steps_ms]
        rows.append({"word_bias": b, "outputs": len(mine), "with_word": sum(h > 0 for h in hits),
                     "per_output": sum(hits) / len(hits), "step_ms": sum(ms) / len(ms) if ms else None})
        step_ms = "-" if not ms else f"{rows[-1]['step_ms']:.3f}"
        print(f"| {b:g} | {rows[-1]['with_word']}/{len(mine)} | {rows[-1]['per_output']:.2f} | {step_ms} |")
    for g in gens[-3:]:
        print(f"  {g.request['prompt']!r} -> {g.text.strip()!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "user_step.json").write_text(json.dumps({"rows": rows, "records": gens.to_records()}, indent=1))
    print(f"records: {out / 'user_step.json'}")
    for g in gens.errors:
        print(f"ERROR [{g.index}] {g.error}", file=sys.stderr)
    return 0 if not gens.errors else 1


if __name__ == "__main__":
    sys.exit(main())
