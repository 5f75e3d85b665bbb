"""`clickpaca demo`: what the workbench is for, in one command and about 30 seconds.

Starts a real server on the default model (a base model: prompts are text to continue,
not chat turns) and shows three things:

1. Seven differently steered sequences in one batch (one llama_decode per tick): free
   greedy text, a GBNF grammar, a JSON schema, a banned token, repetition penalties, a
   stop string, and the log-probabilities of the alternatives (`nProbs`).
2. One document prefilled once and forked into three questions, with the time to the
   first token cold (document + question from scratch) against forked.
3. The KV cache's bytes per token for f16, q8_0 and q4_0, read from real contexts.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import orjson

from ..measure.bench.serve import TimedClient
from ..wire.client import Client

YES_NO = 'root ::= (" yes" | " no") "."'
PERSON = ('%json_schema {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, '
          '"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], '
          '"additionalProperties": false}')
PARIS = 9079  # " Paris" in the Gemma 3 vocabulary (`clickpaca tok " Paris"`)

# Seven sequences, one batch: (label, prompt, parameters).
STEERED = {
    0: ("free, greedy", "Once upon a time, in a small village by the sea,", {"temperature": 0, "maxTokens": 24}),
    1: ("GBNF yes/no", "Question: Is the sun a star?\nAnswer (yes or no):",
        {"grammar_id": "yesno", "temperature": 0.8, "seed": 1}),
    2: ("JSON schema", "A person, as a JSON object with a name and an age:\n",
        {"grammar_id": "person", "temperature": 0.8, "seed": 2, "maxTokens": 40}),
    3: ("ban ' Paris'", "The capital of France is",
        {"temperature": 0, "maxTokens": 12, "logit_bias": [{"token": PARIS, "bias": -1e9}]}),
    4: ("penalties", "My shopping list: apples, bread,",
        {"temperature": 0.7, "seed": 4, "maxTokens": 24, "penaltyRepeat": 1.3, "penaltyPresent": 0.5}),
    5: ("stop at 'six'", "Counting: one, two, three,", {"temperature": 0, "maxTokens": 40, "stop": ["six"]}),
    6: ("alternatives", "The capital of France is", {"temperature": 0, "maxTokens": 1, "nProbs": 5}),
}

DOCUMENT = (
    "Harbour notes. The town of Caldmere sits at the mouth of the river Oss, where the "
    "water meets a shallow grey bay. Its harbour was built in 1822 from granite carried "
    "down from the Tallow Hills, and for a hundred years it sent salted herring to the "
    "cities of the south. The fleet was largest in 1890, with sixty-two boats. Today the "
    "harbour holds eleven fishing boats and a lifeboat painted bright orange. The "
    "lighthouse on the north pier is white with a single red band; its lamp can be seen "
    "from fourteen miles out at sea. Every August the town holds the Lantern Fair, when "
    "the boats are decorated with paper lanterns and sail in a line past the pier at "
    "dusk. The oldest building on the quay is the Customs House, which is now a small "
    "museum of nets, ropes and ship models. The harbour master in 2024 was Ellen Varga, "
    "who had worked on the lifeboat for twenty years before taking the post.\n\n")
HELD, COLD = 0, 1  # after part 1 every slot is free again
QUESTIONS = {
    2: "Question: What colour is the lifeboat?\nAnswer:",
    3: "Question: In which year was the harbour built?\nAnswer:",
    4: "Question: Who was the harbour master in 2024?\nAnswer:",
}


def one_line(text: str, width: int = 72) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def first_token_ms(c: Client, seq_id: int, t_sent: float) -> tuple[float, str, dict]:
    """Read one sequence to its end: ms from sending to its first token's arrival (stamped
    by the client's reader thread, so reading sequences one after another does not count),
    its text, its end."""
    t_first, pieces, final = None, [], {}
    for ev in c.stream(seq_id):
        if ev["type"] == "token":
            t_first = t_first or ev["_t"]
            pieces.append(ev["piece"])
        else:
            final = ev
    ms = (t_first - t_sent) * 1000 if t_first else math.nan
    return ms, "".join(pieces), final


def steered_batch(c: Client) -> None:
    print("1. Seven sequences, seven kinds of steering, one llama_decode per tick")
    c.grammar("yesno", YES_NO)
    c.grammar("person", PERSON)
    for sid, (_, prompt, params) in STEERED.items():
        c.infer(sid, prompt, **params)
    for sid, (label, prompt, _) in STEERED.items():
        tokens, final = c.collect(sid)
        if final["type"] == "error":
            print(f"   [{sid}] {label:14s} ERROR {final['message']}")
            continue
        if sid == 6:
            print(f"   [{sid}] {label:14s} the next token after {prompt!r}, raw distribution:")
            for alt in tokens[0]["top"]:
                print(f"        {alt['piece']!r:12s} logprob {alt['logprob']:7.3f}  "
                      f"p = {math.exp(alt['logprob']):6.1%}")
            continue
        text = "".join(t["piece"] for t in tokens)
        print(f"   [{sid}] {label:14s} {prompt!r} ->")
        print(f"        {one_line(text)}")
        print(f"        {final['tokens_predicted']} tokens, stop: {final['stop_reason']}, "
              f"generation {final['eval_tps'] or 0:.0f} tok/s")


def forked_document(c: Client) -> None:
    print("\n2. One document, prefilled once, forked into three questions")
    t0 = time.perf_counter()
    c.send({"type": "prefill", "seq_id": HELD, "prompt": DOCUMENT})
    held = c.wait(HELD)
    print(f"   document: {held['tokens']} tokens, prefilled once in "
          f"{(time.perf_counter() - t0) * 1000:.0f} ms")
    # Cold: the same document and the first question from scratch, alone.
    t_sent = time.perf_counter()
    c.infer(COLD, DOCUMENT + QUESTIONS[2], temperature=0, maxTokens=8, reusePrefix=False, stop=["\n"])
    cold_ms, _, _ = first_token_ms(c, COLD, t_sent)
    # Forked: each question continues a fork of the held document; all three in one batch.
    for sid in QUESTIONS:
        c.request({"type": "fork", "seq_id": HELD, "dst_seq_id": sid})
    # The three requests go out in one write, so the server reads them before its next tick.
    lines = [orjson.dumps({"type": "infer", "seq_id": sid, "prompt": q, "temperature": 0,
                           "maxTokens": 12, "stop": ["\n"]}) + b"\n" for sid, q in QUESTIONS.items()]
    t_sent = time.perf_counter()
    c.send_raw(b"".join(lines))
    results = {sid: first_token_ms(c, sid, t_sent) for sid in QUESTIONS}
    print(f"   time to first token, cold (document + question from scratch): {cold_ms:6.0f} ms")
    print("   time to first token, forked (3 questions in one batch):        "
          + ", ".join(f"{ms:.0f}" for ms, _, _ in results.values()) + " ms")
    for sid, (ms, text, final) in results.items():
        q = QUESTIONS[sid].split("\n")[0].removeprefix("Question: ")
        answer = text.strip() if final.get("type") == "done" else f"ERROR {final.get('message')}"
        print(f"   [{sid}] {q:42s} -> {answer!r}")
    c.request({"type": "free", "seq_id": HELD})


def kv_bytes_per_token(model_path: str | None) -> None:
    """Create a real context per cache type and read its KV buffer size."""
    from ..llama import core
    from ..llama.cachetypes import STUDY_CACHE
    from ..llama.models import resolve_model

    print("\n3. KV cache bytes per token (K and V together, every layer)")
    model = core.Model(resolve_model(model_path))
    try:
        base = None
        for kind in STUDY_CACHE.split(","):
            ctx = core.Context(model, n_ctx=4096, n_batch=512, n_seq_max=1, type_k=kind, type_v=kind)
            per_token = ctx.kv_bytes / ctx.n_ctx
            ctx.close()
            base = base or per_token
            print(f"   {kind:5s} {per_token / 1024:6.2f} KiB per token  ({per_token / base:.2f}x f16)")
        print("   quality and speed of each type: make kv-study, docs/KV-RESEARCH.md")
    finally:
        model.close()


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    extra = {"modelPath": args.model} if args.model else {}
    with TimedClient.spawn() as c:
        ready = c.init(nCtx=4096, nSeqMax=8, **extra)
        print(f"clickpaca demo: {ready['model']['description']}, a base model "
              f"({ready['model']['path']})")
        print(f"build {ready['build']} {ready['buildCommit']} (b{ready['buildNumber']}), "
              f"{ready['nThreads']} threads, KV {ready['cacheTypeK']}/{ready['cacheTypeV']}, "
              f"nCtx {ready['nCtx']} shared by up to {ready['nSeqMax']} sequences\n")
        steered_batch(c)
        forked_document(c)
        c.quit()
    kv_bytes_per_token(args.model)
    print(f"\ndone in {time.perf_counter() - t0:.1f} s. Protocol: docs/PROTOCOL.md; "
          "what to measure: docs/CAPABILITIES.md; tests: make test")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(argparse.Namespace(model=None)))
