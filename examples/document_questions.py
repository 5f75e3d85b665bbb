"""One document and 50 questions: time to first token cold against forked, as a plot.

    .venv/bin/python examples/document_questions.py          # 50 questions
    .venv/bin/python examples/document_questions.py --n 8

Cold: each question sent with the whole document in front of it, from scratch
(`reusePrefix: false`), so the server computes the document once per question.
Forked: the document is prefilled once (`wb.prefill`) and every question continues a
fork of it (`doc.generate`): only the question's own tokens are computed. Both run
with the same number of slots, so the same number of questions share each decode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from clickpaca import Workbench
from clickpaca.workbench.demo import DOCUMENT

FACTS = ["What colour is the lifeboat?", "In which year was the harbour built?",
         "Who was the harbour master in 2024?", "Which river meets the bay at Caldmere?",
         "How many fishing boats does the harbour hold today?", "What was the harbour built from?",
         "Where did the granite come from?", "What did the town send to the cities of the south?",
         "In which year was the fleet largest?", "How many boats were in the fleet in 1890?",
         "What colour is the lighthouse?", "What colour is the band on the lighthouse?",
         "How far out at sea can the lamp be seen?", "When is the Lantern Fair held?",
         "What are the boats decorated with at the fair?", "When do the boats sail past the pier?",
         "What is the oldest building on the quay?", "What is the Customs House now?",
         "What does the museum hold?", "How long did Ellen Varga work on the lifeboat?",
         "What colour is the water of the bay?", "On which pier is the lighthouse?",
         "What is the name of the town?", "What is painted bright orange?",
         "What sits at the mouth of the river Oss?"]
FORMS = ["Question: {}\nAnswer:", "Q: {}\nA:"]


def questions(n: int) -> list[str]:
    every = [f.format(q) for f in FORMS for q in FACTS]
    return (every * (n // len(every) + 1))[:n]


def plot(cold: list[float], forked: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(len(cold)), cold, "o", label=f"cold (median {statistics.median(cold):.0f} ms)")
    ax.plot(range(len(forked)), forked, "s", label=f"forked (median {statistics.median(forked):.0f} ms)")
    ax.set_yscale("log")
    ax.set_xlabel("question")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("One document, many questions: cold against forked")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=int(os.environ.get("CLICKPACA_EXAMPLE_N", 50)),
                    help="questions (default 50; $CLICKPACA_EXAMPLE_N)")
    ap.add_argument("--slots", type=int, default=9, help="nSeqMax: the document holds one slot, questions share the rest")
    ap.add_argument("--out", default="examples-output")
    args = ap.parse_args(argv)

    qs = questions(args.n)
    steer = {"temperature": 0, "maxTokens": 12, "stop": ["\n"]}
    with Workbench.spawn(nCtx=8192, nSeqMax=args.slots) as wb:
        # cold runs as many at once as the forked questions get (the document holds a slot)
        at_once = wb.n_slots - 1
        cold = wb.generate([DOCUMENT + q for q in qs], concurrency=at_once, reusePrefix=False, **steer)
        with wb.prefill(DOCUMENT) as doc:
            forked = doc.generate(qs, **steer)
            doc_tokens = doc.tokens
    bad = cold.errors + forked.errors
    for g in bad:
        print(f"ERROR [{g.index}] {g.error}", file=sys.stderr)
    c_ms = [g.ttft_ms for g in cold if g.ttft_ms is not None]
    f_ms = [g.ttft_ms for g in forked if g.ttft_ms is not None]
    print(f"document: {doc_tokens} tokens; {len(qs)} questions, {at_once} at a time")
    print(f"time to first token, cold:   median {statistics.median(c_ms):7.0f} ms  (min {min(c_ms):.0f}, max {max(c_ms):.0f})")
    print(f"time to first token, forked: median {statistics.median(f_ms):7.0f} ms  (min {min(f_ms):.0f}, max {max(f_ms):.0f})")
    print(f"prompt tokens computed: cold {sum(g.tokens_prompt or 0 for g in cold)}, "
          f"forked {sum(g.tokens_prompt or 0 for g in forked)}")
    for q, g in list(zip(qs, forked))[:5]:
        print(f"  {q.splitlines()[0]:60s} -> {g.text.strip()!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(c_ms, f_ms, out / "document_questions.png")
    (out / "document_questions.json").write_text(json.dumps(
        {"document_tokens": doc_tokens, "cold": cold.to_records(), "forked": forked.to_records()}, indent=1))
    print(f"plot: {out / 'document_questions.png'}; records: {out / 'document_questions.json'}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
