"""`clickpaca bench state`: time to first token over a long document, cold vs held state.

A ~2,000-token document (the start of a public-domain play) and a short question:
- cold: `infer` of document + question (reusePrefix off, so nothing is shared);
- fork: the document is `prefill`ed once into sequence 0; each round `fork`s it to
  sequence 1 and `infer`s only the question there;
- loaded: sequence 0 is `save`d to a file; a NEW server `load`s it each round and
  `infer`s only the question.
TTFT = wall clock from sending the infer to receiving its first token event. The three
run alternately (`--repeats` rounds); medians are reported, with the greedy answers
(they should agree). Also: state file size per cache type (--cache, default
f16,q8_0,q4_0), one server per type.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from ...llama.cachetypes import DEFAULT, MAINLINE, STUDY_CACHE, attention, build_for, pair_name, parse_pair
from ..common import model_path, out_dir, with_defaults
from ...results.report import emit, machine
from .serve import Server, run_group
from ...results.stats import alternate, median, parse_list, progress, ratio, summary
from ...results.table import markdown
from ..texts import read_text

DOC_TOKENS = 2000
CHARS_PER_TOKEN = 3.45  # Gemma's tokenizer on the start of Hamlet (measured ~3.2-3.5)
#: Starts with a letter: the document ends with a newline, so the cold prompt (document +
#: question as one text) and the held path (question appended) tokenize identically. A
#: question starting with "\n" would merge with the document's last newline into one
#: token when tokenized together, and the paths would see different tokens.
QUESTION = "Question: Who is Horatio, and whom does he speak to about the ghost?\nAnswer:"
GEN = 8
DEFAULT_CACHE = STUDY_CACHE


def document(n_tokens: int, path: str | None = None) -> str:
    text, _ = read_text(path)
    cut = text[: int(n_tokens * CHARS_PER_TOKEN)]
    return cut[: cut.rfind("\n") + 1] if "\n" in cut else cut


def _ttft(server: Server, seq_id: int, prompt: str, params: dict) -> dict[str, Any]:
    [r] = run_group(server, [prompt], params, seq_ids=[seq_id])
    if not r.ok:
        raise RuntimeError(f"infer failed: {r.final}")
    return {"ttft_ms": r.ttft * 1000 if r.ttft is not None else None,
            "tokens_prompt": r.final.get("tokens_prompt"), "tokens_reused": r.final.get("tokens_reused"),
            "text_tokens": r.tokens, "prompt_ms": r.final.get("prompt_ms")}


def measure(args: Any) -> dict[str, Any]:
    model = model_path(args)
    m0 = machine()
    n_doc = int(getattr(args, "doc_tokens", None) or DOC_TOKENS)
    doc = document(n_doc, getattr(args, "text", None))
    tmp = tempfile.mkdtemp(prefix="clickpaca-bench-state-")
    state_file = "doc.state"  # a name in the servers' state directory (stateDir)
    n_ctx = max(2048, 3 * n_doc + 1024)
    base_init = {"modelPath": model, "build": args.build, "nThreads": args.threads,
                 "nCtx": n_ctx, "nSeqMax": 4, "stateDir": tmp}
    progress("state: starting the server, prefilling the document")
    a = Server(base_init)
    problems = a.problems
    bias = a.ban_eog()
    params = {"maxTokens": GEN, "temperature": 0, "reusePrefix": False, **bias}
    pre = a.client.request({"type": "prefill", "seq_id": 0, "prompt": doc})
    saved = a.client.request({"type": "save", "seq_id": 0, "path": state_file})
    progress(f"state: document {pre['tokens']} tokens, prefill {pre['prompt_ms']:.0f} ms, "
             f"state file {saved['bytes']} bytes")
    progress("state: starting a second server for loads")
    b = Server(base_init)
    b.ban_eog()
    answers: dict[str, str] = {}

    def cold(r: int) -> dict:
        return _ttft(a, 2, doc + QUESTION, params)

    def fork(r: int) -> dict:
        t0 = time.perf_counter()
        a.client.request({"type": "fork", "seq_id": 0, "dst_seq_id": 1})
        fork_ms = (time.perf_counter() - t0) * 1000
        out = _ttft(a, 1, QUESTION, params)
        out["fork_ms"] = fork_ms
        return out

    def loaded(r: int) -> dict:
        t0 = time.perf_counter()
        b.client.request({"type": "load", "seq_id": 0, "path": state_file})
        load_ms = (time.perf_counter() - t0) * 1000
        out = _ttft(b, 0, QUESTION, params)
        out["load_ms"] = load_ms
        return out

    try:
        res = alternate({"cold": cold, "fork": fork, "loaded": loaded}, args.repeats, "state")
        # the greedy answers of the last round, per path
        for name, server, sid in (("cold", a, 2), ("fork", a, 1), ("loaded", b, 0)):
            toks = [e["piece"] for e in server.client.all_events
                    if e.get("seq_id") == sid and e["type"] == "token"][-GEN:]
            answers[name] = "".join(toks)
    finally:
        a.close()
        b.close()
    problems += b.problems
    ttft = {k: [x["ttft_ms"] for x in v] for k, v in res.items()}
    cold_med = median(ttft["cold"])
    rows = {k: {"ttft_ms": summary(v), "speedup_vs_cold": ratio(cold_med, median(v))}
            for k, v in ttft.items()}
    rows["fork"]["fork_ms"] = summary([x["fork_ms"] for x in res["fork"]])
    rows["loaded"]["load_ms"] = summary([x["load_ms"] for x in res["loaded"]])
    rows["loaded"]["load_plus_ttft_speedup"] = ratio(
        cold_med, median([x["load_ms"] + x["ttft_ms"] for x in res["loaded"]]))
    for k in rows:
        rows[k]["tokens_prompt"] = res[k][-1]["tokens_prompt"]
        rows[k]["tokens_reused"] = res[k][-1]["tokens_reused"]
        rows[k]["answer"] = answers[k]

    # state file size per cache type
    sizes = []
    for spec in parse_list(getattr(args, "cache", None) or DEFAULT_CACHE, str):
        k, v = parse_pair(spec)
        build = build_for(k, v) if args.build == MAINLINE else args.build
        if (k, v) == (DEFAULT, DEFAULT) and build == args.build:
            sizes.append({"cache": DEFAULT, "bytes": saved["bytes"], "tokens": saved["tokens"],
                          "bytes_per_token": saved["bytes"] / saved["tokens"]})
            continue
        progress(f"state: file size for {pair_name(k, v)}")
        try:
            with Server({**base_init, "build": build, "cacheTypeK": k, "cacheTypeV": v,
                         "flashAttn": attention(k, v), "nSeqMax": 1, "nCtx": n_doc + 512}) as s:
                s.client.request({"type": "prefill", "seq_id": 0, "prompt": doc})
                sv = s.client.request({"type": "save", "seq_id": 0,
                                       "path": f"doc-{k}-{v}.state"})
            problems += s.problems
            sizes.append({"cache": pair_name(k, v), "bytes": sv["bytes"], "tokens": sv["tokens"],
                          "bytes_per_token": sv["bytes"] / sv["tokens"]})
        except Exception as e:  # noqa: BLE001
            sizes.append({"cache": pair_name(k, v), "error": str(e)})
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)
    agree = len({answers[k] for k in answers}) == 1
    notes = [f"document: {pre['tokens']} tokens (start of a public-domain play), question "
             f"{len(QUESTION)} chars, greedy, {GEN} tokens; medians of {args.repeats} alternating rounds",
             "TTFT = wall clock from sending infer to the first token event; goal: fork and loaded "
             ">= 10x faster than cold",
             "greedy answers " + ("agree on all three paths" if agree else
                                  "DIFFER between paths: " + repr(answers))]
    return {"params": {"doc_tokens": pre["tokens"], "threads": args.threads, "repeats": args.repeats,
                       "model": model, "build": args.build, "question": QUESTION},
            "machine_start": m0, "prefill_ms": pre["prompt_ms"], "rows": rows, "state_sizes": sizes,
            "answers_agree": agree, "notes": notes, "server_problems": problems}


def table(out: dict[str, Any]) -> str:
    r = out["rows"]
    t1 = markdown(["path", "TTFT ms (median)", "min", "max", "speed-up vs cold", "extra step ms",
                   "prompt tokens", "reused"],
                  [("cold (document + question)", r["cold"]["ttft_ms"]["median"], r["cold"]["ttft_ms"]["min"],
                    r["cold"]["ttft_ms"]["max"], None, None, r["cold"]["tokens_prompt"], r["cold"]["tokens_reused"]),
                   ("fork of prefilled sequence", r["fork"]["ttft_ms"]["median"], r["fork"]["ttft_ms"]["min"],
                    r["fork"]["ttft_ms"]["max"], r["fork"]["speedup_vs_cold"], r["fork"]["fork_ms"]["median"],
                    r["fork"]["tokens_prompt"], r["fork"]["tokens_reused"]),
                   ("loaded state file (new server)", r["loaded"]["ttft_ms"]["median"],
                    r["loaded"]["ttft_ms"]["min"], r["loaded"]["ttft_ms"]["max"], r["loaded"]["speedup_vs_cold"],
                    r["loaded"]["load_ms"]["median"], r["loaded"]["tokens_prompt"], r["loaded"]["tokens_reused"])],
                  align="lrrrrrrr")
    t2 = markdown(["K/V", "state file bytes", "tokens", "bytes/token"],
                  [(s["cache"], s.get("bytes"), s.get("tokens"), s.get("bytes_per_token"))
                   for s in out["state_sizes"]], align="lrrr")
    return t1 + "\n\n" + t2


def run(args: Any) -> dict[str, Any]:
    args = with_defaults(args)
    out = measure(args)
    emit(out_dir(args), "state", out, table(out), "Time to first token: cold vs held / loaded state")
    return out
