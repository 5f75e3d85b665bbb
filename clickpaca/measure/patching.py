"""What activation patching costs, through the server on the activations build.

    OMP_WAIT_POLICY=passive python -m clickpaca.measure.patching --rounds 7

Each round sends 8 infer requests at once (the same prompt of about 100 tokens, 16 greedy
tokens each) under each setup, the setups alternating within the round: `none` (no patch),
`1 of 8` (one sequence patches l_out-8 at every prompt position with its own rows: one graph
split and one write in its prompt decode), `8 of 8`, and `1 of 8, 18 nodes` (one sequence
patches every layer's l_out at every prompt position: a split per patched node, and 18 x 82
rows sent and written), and the same at one position (the splits without the rows' bytes). A patch touches only the decodes
that carry one (here each sequence's prompt decode), so the generation steps after it run
with no callback. Prints the median (min-max) wall seconds and server CPU seconds per
round and their ratios to `none`, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


from ..activations.capture import decode, encode
from ..wire.client import Client

PROMPT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
          "Later, towers of stone carried lamps of oil, and mirrors behind the flame sent the light "
          "further out to sea. Keepers lived at the foot of the tower, trimming wicks through the night "
          "and writing the weather into their logbooks, until electric lamps and clockwork made the "
          "work lighter and, in the end,")
N_SEQ = 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    c = Client.spawn(env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive")})
    init = {"build": "activations", "nCtx": 4096, "nSeqMax": N_SEQ, "nBatch": 1024}
    if args.threads:
        init["nThreads"] = args.threads
    c.init(**init)
    try:
        n_layer = int(c.ready["model"]["nLayer"])
        layers = [f"l_out-{il}" for il in range(n_layer)]
        ev = c.request({"type": "prefill", "seq_id": 0, "prompt": PROMPT, "capture": layers, "captureTokens": "all"})
        c.request({"type": "free", "seq_id": 0})
        n = ev["tokens"]
        own = {k: ev["capture"]["nodes"][k] for k in layers}

        def entry(node: str, one: bool = False) -> dict:
            if one:  # the last prompt position only: the split without the rows' bytes
                src = {**own[node], "shape": [1, own[node]["shape"][1]],
                       "data": encode(decode(own[node])[-1:], "float32")["data"]}
                return {"node": node, "positions": [n - 1], "source": src}
            return {"node": node, "positions": list(range(n)), "source": own[node]}

        setups = {"none": [None] * N_SEQ,
                  "1 of 8": [[entry("l_out-8")]] + [None] * (N_SEQ - 1),
                  "8 of 8": [[entry("l_out-8")]] * N_SEQ,
                  f"1 of 8, {n_layer} nodes": [[entry(k) for k in layers]] + [None] * (N_SEQ - 1),
                  f"1 of 8, {n_layer} nodes, 1 position": [[entry(k, True) for k in layers]] + [None] * (N_SEQ - 1)}
        times: dict[str, list[float]] = {k: [] for k in setups}
        cpu: dict[str, list[float]] = {k: [] for k in setups}
        for _ in range(args.rounds):
            for name, patches in setups.items():
                t0, c0 = time.perf_counter(), cpu_seconds(c.proc.pid)
                for i, p in enumerate(patches):
                    c.infer(i, PROMPT, maxTokens=args.tokens, temperature=0, reusePrefix=False,
                            **({"patch": p} if p else {}))
                for i in range(N_SEQ):
                    _, done = c.collect(i)
                    assert done["type"] == "done", done
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(cpu_seconds(c.proc.pid) - c0)
        base, cbase = statistics.median(times["none"]), statistics.median(cpu["none"])
        out = {"prompt_tokens": n, "tokens": args.tokens, "rounds": args.rounds, "load": os.getloadavg()[0],
               "setups": {k: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3),
                              "max_s": round(max(v), 3), "ratio": round(statistics.median(v) / base, 3),
                              "cpu_median_s": round(statistics.median(cpu[k]), 3),
                              "cpu_min_s": round(min(cpu[k]), 3), "cpu_max_s": round(max(cpu[k]), 3),
                              "cpu_ratio": round(statistics.median(cpu[k]) / cbase, 3)}
                          for k, v in times.items()}}
        print(json.dumps(out, indent=1))
    finally:
        c.close()
    return 0


def cpu_seconds(pid: int) -> float:
    """The server process's CPU time so far, all its threads (/proc/PID/stat utime + stime):
    with OMP_WAIT_POLICY=passive waiting threads sleep, so this is what the setup computed,
    less disturbed by other processes' load than the wall clock."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
