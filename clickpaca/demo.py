"""`clickpaca demo`: the main job in one command.

Starts a real server on the default model, registers a GBNF grammar and a JSON
schema, then runs six differently steered sequences in the same batch (one
llama_decode per tick) and prints what each produced and how fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from .client import Client

YES_NO = 'root ::= ("yes" | "no") "."'
PERSON = ('%json_schema {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, '
          '"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], '
          '"additionalProperties": false}')


def turn(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    extra = {"modelPath": args.model} if args.model else {}
    with Client.spawn() as c:
        ready = c.init(nCtx=4096, nSeqMax=8, **extra)
        print(f"model: {ready['model']['description']} ({ready['model']['path']})")
        print(f"build: {ready['build']} {ready['buildCommit']} (b{ready['buildNumber']}), "
              f"KV {ready['cacheTypeK']}/{ready['cacheTypeV']} {ready['kvBytes'] / 2**20:.1f} MiB, "
              f"nCtx {ready['nCtx']} shared by up to {ready['nSeqMax']} sequences\n")
        c.grammar("yesno", YES_NO)
        c.grammar("person", PERSON)
        jobs = {
            0: ("free, greedy", turn("Name three colours."), {"temperature": 0, "maxTokens": 40}),
            1: ("GBNF yes/no", turn("Is the sky blue?"), {"grammar_id": "yesno", "temperature": 0.8, "seed": 1}),
            2: ("JSON schema", turn("Invent a person."), {"grammar_id": "person", "temperature": 0.8, "seed": 2, "maxTokens": 60}),
            3: ("ban 'Paris'", "The capital of France is", {"temperature": 0, "maxTokens": 12,
                                                            "logit_bias": [{"token": 9079, "bias": -1e9}]}),
            4: ("penalties", turn("Write a list of fruits."), {"temperature": 0.7, "seed": 4, "maxTokens": 40,
                                                               "penaltyRepeat": 1.3, "penaltyPresent": 0.5}),
            5: ("stop string", "Count: one, two, three,", {"temperature": 0, "maxTokens": 40, "stop": ["six"]}),
        }
        for sid, (_, prompt, params) in jobs.items():
            c.infer(sid, prompt, **params)
        for sid, (label, _, _) in jobs.items():
            tokens, final = c.collect(sid)
            text = "".join(t["piece"] for t in tokens).strip().replace("\n", " ")
            if final["type"] == "error":
                print(f"[{sid}] {label:13s} ERROR {final['message']}")
                continue
            print(f"[{sid}] {label:13s} {text[:90]!r}")
            print(f"    {final['tokens_predicted']} tokens, stop: {final['stop_reason']}, "
                  f"prompt {final['prompt_tps'] or 0:.0f} tok/s, generation {final['eval_tps'] or 0:.1f} tok/s")
        c.quit()
    print(f"\ndone in {time.perf_counter() - t0:.1f} s. Protocol: docs/PROTOCOL.md; tests: make test")
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(argparse.Namespace(model=None)))
