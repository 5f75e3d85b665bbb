"""The real server, driven through clickpaca.wire.client, with arrival times on every event.

`TimedClient` stamps each event with `_t` (time.perf_counter() when the reader thread
parsed it), so first-token and last-token times do not depend on when the benchmark
thread gets round to reading a queue.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from ...wire.client import Client, ServerError, default_python
from ...results.stats import median, progress

#: The default model's end-of-generation tokens (<eos>, <end_of_turn>, </s>).
EOG_TOKENS = (1, 106, 212)
#: A grammar registered at start-up only to wait for the server's tokenizer build.
WARM_UP_GRAMMAR_ID = "_bench_warm_up"
#: Events closer than this belong to the same tick (ticks take milliseconds or more).
BURST_S = 0.002


class TimedClient(Client):
    """A Client that stamps each event with its arrival time (perf_counter) as `_t`."""

    def _decode(self, line: bytes) -> dict:
        ev = super()._decode(line)
        ev["_t"] = time.perf_counter()
        return ev


class Server:
    """A spawned `clickpaca serve` with its init answer, stderr log and problems seen
    (`env`: more of its environment, e.g. against.server_env for an earlier commit's)."""

    def __init__(self, init: dict[str, Any], log_dir: str | None = None, env: dict[str, str] | None = None) -> None:
        self.init_params = {k: v for k, v in init.items() if v is not None}
        fd, self.log_path = tempfile.mkstemp(prefix="clickpaca-bench-server-", suffix=".log",
                                             dir=log_dir)
        self._log = os.fdopen(fd, "wb")
        t0 = time.perf_counter()
        self.client = TimedClient.spawn(env={"OMP_WAIT_POLICY": "passive", **(env or {})}, stderr=self._log,
                                        python=default_python())
        self.problems: list[str] = []
        self.exit_code: int | None = None
        try:
            self.ready = self.client.init(**self.init_params)
            self.init_s = time.perf_counter() - t0
            # The server builds llguidance's tokenizer in a background thread after init
            # (2-3 s of one core). Registering a grammar waits for it, so it cannot
            # compete with the first measured run (it did: 10 tok/s instead of 28).
            self.client.grammar(WARM_UP_GRAMMAR_ID, 'root ::= "x"')
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------- helpers

    def ban_eog(self) -> dict[str, Any]:
        """Infer fields that ban the end-of-generation tokens, so every sequence runs to
        maxTokens."""
        return {"logit_bias": [{"token": t, "bias": -1e9} for t in EOG_TOKENS]}

    def ticks(self) -> int:
        """The server's decodes so far (`stats` `ticks`): a round's difference is how many
        ticks it took, which no load on the machine changes."""
        self.client.send({"type": "stats"})
        return self.client.wait_misc({"stats"}, 120)["ticks"]

    def close(self) -> None:
        try:
            self.client.quit(now=True)
        except OSError:
            pass
        self.exit_code = self.client.close(timeout=60)
        self._log.close()
        if self.exit_code not in (0, None):
            tail = open(self.log_path, "rb").read()[-600:].decode("utf-8", "replace").strip()
            self.problems.append(f"server exited with code {self.exit_code} at shutdown "
                                 f"(log {self.log_path}): {tail}")
            progress(f"SERVER PROBLEM: {self.problems[-1]}")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Servers:
    """The servers of a bench's sides, by name. With ``fresh``, a side gets a new process
    whenever the round changes (the old one closed first), so the rounds sample what
    differs from one process to the next (heap layout, thread placement) as well as the
    machine's slow phases; otherwise each side keeps one process for the whole run."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.specs: dict[str, tuple[dict[str, Any], dict[str, str] | None]] = {}
        self.live: dict[str, tuple[Server, Any]] = {}
        #: the init answer of the first process of each side
        self.ready: dict[str, dict] = {}
        #: problems of every process so far, each with its side's name
        self.problems: list[str] = []
        #: processes started per side
        self.started: dict[str, int] = {}

    def add(self, name: str, init: dict[str, Any], env: dict[str, str] | None = None) -> Server:
        """Declare a side and start its first process (so a bad init fails before any round)."""
        self.specs[name] = (init, env)
        return self.get(name, None)

    def get(self, name: str, round_key: Any) -> Server:
        """The side's server for this round (``round_key``: any value naming the round)."""
        server, key = self.live.get(name, (None, None))
        # key None: the process add() started, not yet used by a round: it serves the first
        if server is not None and (key == round_key or not self.fresh or key is None):
            self.live[name] = (server, round_key)
            return server
        if server is not None:
            self._retire(name, server)
        init, env = self.specs[name]
        server = Server(init, env=env)
        self.ready.setdefault(name, server.ready)
        self.started[name] = self.started.get(name, 0) + 1
        self.live[name] = (server, round_key)
        return server

    def close(self) -> None:
        for name, (server, _) in list(self.live.items()):
            self._retire(name, server)

    def _retire(self, name: str, server: Server) -> None:
        self.live.pop(name, None)
        server.close()
        self.problems += [f"{name}: {p}" for p in server.problems]


def exact_prompt(n_tokens: int) -> str:
    """A prompt of exactly n_tokens tokens for the default model: BOS + " the" * (n-1)
    (" the" is one token; the server reports tokens_prompt, which the benches check)."""
    return " the" * max(1, n_tokens - 1)


@dataclass
class SeqRun:
    seq_id: int
    t_sent: float
    tokens: int = 0
    t_first: float | None = None
    t_last: float | None = None
    final: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)  # arrival of every token event
    ids: list[int] = field(default_factory=list)  # the token of every token event

    @property
    def ok(self) -> bool:
        return self.final.get("type") == "done"

    @property
    def ttft(self) -> float | None:
        return self.t_first - self.t_sent if self.t_first is not None else None

    @property
    def wall_tps(self) -> float | None:
        """Tokens/s between the first and the last token event ((n-1) intervals)."""
        if self.t_first is None or self.t_last is None or self.tokens < 2 or self.t_last <= self.t_first:
            return None
        return (self.tokens - 1) / (self.t_last - self.t_first)

    @property
    def total_s(self) -> float | None:
        t = self.final.get("_t")
        return t - self.t_sent if t is not None else None


def run_group(server: Server, prompts: list[str], params: dict[str, Any],
              seq_ids: list[int] | None = None, timeout: float = 3600,
              per_seq: list[dict[str, Any]] | None = None) -> list[SeqRun]:
    """Start one infer per prompt back to back, then collect every sequence.
    per_seq: extra fields for each sequence (e.g. its seed)."""
    c = server.client
    ids = seq_ids or list(range(len(prompts)))
    lines = [orjson.dumps({"type": "infer", "seq_id": sid, "prompt": prompt, **params,
                           **(per_seq[i] if per_seq else {})}) + b"\n"
             for i, (sid, prompt) in enumerate(zip(ids, prompts))]
    t = time.perf_counter()
    c.send_raw(b"".join(lines))  # one write: the server sees the N requests together
    runs = [SeqRun(sid, t) for sid in ids]
    for r in runs:
        for ev in c.stream(r.seq_id, timeout):
            if ev["type"] == "token":
                r.tokens += 1
                if r.t_first is None:
                    r.t_first = ev["_t"]
                r.t_last = ev["_t"]
                r.times.append(ev["_t"])
                r.ids.append(ev.get("token"))
            else:
                r.final = ev
    return runs


def group_stats(runs: list[SeqRun]) -> dict[str, Any]:
    """Aggregate generation speed of sequences that ran together.

    steady_tps (= wall_tps, the headline): token events per second while every sequence
    is generating (from the last sequence's first token to the first sequence's last
    token): llama-batched-bench's S_TG measures that phase. span_tps: tokens after each
    sequence's first / (last token anywhere - first token anywhere), which also counts
    ticks where some sequences were still in their prompt. admission_skew_ms: spread of
    the sequences' first tokens. eval_tps_sum: the sum of the server's done.eval_tps.
    tokens_digest: of every sequence's tokens, in order (two sides' outputs compared).
    """
    ok = [r for r in runs if r.ok]
    errors = [r.final for r in runs if not r.ok]
    firsts = [r.t_first for r in ok if r.t_first is not None]
    lasts = [r.t_last for r in ok if r.t_last is not None]
    gen = sum(max(0, r.tokens - 1) for r in ok)
    span = (max(lasts) - min(firsts)) if firsts and lasts else None
    # steady state: from the moment every sequence has its first token to the moment the
    # first one ends, every sequence generates in every tick (prompts are all done), as
    # in llama-batched-bench's generation phase
    # The events of one tick arrive in one burst (the server writes once per loop turn)
    # but are stamped microseconds apart: the window runs from the burst holding the last
    # first token (excluded) to the burst holding the first last token (included).
    steady = None
    if firsts and lasts:
        t0, t1 = max(firsts), min(lasts)
        if t1 > t0 + BURST_S:
            n = sum(sum(1 for t in r.times if t0 + BURST_S < t <= t1 + BURST_S) for r in ok)
            steady = n / (t1 - t0) if n else None
    eval_tps = [r.final.get("eval_tps") for r in ok]
    stop = {}
    for r in ok:
        stop[r.final.get("stop_reason")] = stop.get(r.final.get("stop_reason"), 0) + 1
    per_tok = [(r.t_last - r.t_first) / (r.tokens - 1) for r in ok
               if r.tokens > 1 and r.t_first is not None and r.t_last is not None]
    return {
        "seqs": len(runs), "ok": len(ok), "errors": [e.get("message") for e in errors],
        "tokens": [r.tokens for r in runs], "stop_reasons": stop,
        "tokens_digest": hashlib.sha256(repr([r.ids for r in runs]).encode()).hexdigest()[:16],
        "prompt_tokens": sorted({r.final.get("tokens_prompt") for r in ok}),
        "steady_tps": steady,
        "span_tps": gen / span if span and span > 0 else None,
        "wall_tps": steady if steady is not None else (gen / span if span and span > 0 else None),
        "admission_skew_ms": (max(firsts) - min(firsts)) * 1000 if firsts else None,
        "eval_tps_sum": sum(v for v in eval_tps if v) if eval_tps else None,
        "latency_per_token_ms": median(per_tok) * 1000 if per_tok else None,
        "ttft_ms": median([r.ttft for r in ok]) * 1000 if ok and any(r.ttft for r in ok) else None,
        "seq_total_s": median([r.total_s for r in ok]),
    }


__all__ = [
    "EOG_TOKENS",
    "SeqRun",
    "Server",
    "ServerError",
    "TimedClient",
    "exact_prompt",
    "group_stats",
    "run_group",
]
