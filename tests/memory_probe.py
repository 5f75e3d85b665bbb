"""What a server's memory does around large requests (issue 43), printed step by step.

    nice -n 10 .venv/bin/python tests/memory_probe.py

A stdio server (init capture: true, nBatch 512, nSeqMax 16): VmRSS after init, after a
short infer, after a plain score of ~1,500 tokens (3 windows), after a score capturing
l_out-17 on every row (every row then has logits), after three infers, and after each
score again; with the resident MiB of the largest anonymous mappings (llama.cpp's
compute buffer and logits output buffer) at the end. Not a test: docs/PROTOCOL.md
("Memory") quotes its numbers.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

from clickpaca.wire.client import Client  # noqa: E402
from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V  # noqa: E402


def rss(c: Client) -> int:
    with open(f"/proc/{c.proc.pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS"))


def big_mappings(c: Client) -> list[tuple[int, int]]:
    out, cur = [], None
    with open(f"/proc/{c.proc.pid}/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = [(b - a) >> 20, 0] if len(head) == 5 else None
                if cur is not None:
                    out.append(cur)
            elif line.startswith("Rss:") and cur is not None:
                cur[1] = int(head[1]) >> 10
    return sorted((tuple(m) for m in out if m[0] >= 100), reverse=True)


def main() -> None:
    c = Client.spawn()
    c.init(nCtx=4096, nSeqMax=16, nBatch=512, build=TEST_BUILD, cacheTypeK=TEST_CACHE_K,
           cacheTypeV=TEST_CACHE_V, capture=True, stateDir="/tmp/clickpaca-memory-probe")
    print(f"load {os.getloadavg()[0]:.1f}; VmRSS MiB:")
    print("  after init", rss(c))
    c.infer(0, "Hello", maxTokens=8)
    c.collect(0)
    print("  after an infer", rss(c))
    text = " ".join(f"Sentence number {i} of the probe." for i in range(200))
    for label, extra in [("a plain score", {}), ("a score capturing l_out-17 on all rows", {"capture": ["l_out-17"]})]:
        ev = c.score(1, text, **extra)
        print(f"  after {label} ({ev['windows']} windows)", rss(c), "mappings (size, resident)", big_mappings(c))
    for _ in range(3):
        c.infer(0, "Hello", maxTokens=8)
        c.collect(0)
    print("  after three infers", rss(c))
    c.score(1, text)
    c.score(1, text, capture=["l_out-17"])
    print("  after both scores again", rss(c), "mappings (size, resident)", big_mappings(c))
    c.close()


if __name__ == "__main__":
    main()
