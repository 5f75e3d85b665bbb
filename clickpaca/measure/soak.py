"""A soak through the Unix socket server: many clients mixing every request kind for a
fixed time, some hanging up mid-request, and what must hold throughout.

The fuzz tests throw many odd lines at a server for a few minutes; this runs ordinary
work for longer: `clients` clients (16), each in its own thread, pick one piece of work
after another (infer, DRY with a breaker set of its own, a grammar, score, prefill and
fork, save and load, a capture, a cancel) until the time is up; `abrupt` of them also
hang up now and then with requests in flight, and connect again. Every loop ends by
itself at the deadline. Checked, and reported with the figures:

- every request ends exactly once: each answer awaited arrives, and no further end
  event is left on any sequence after the clients stop;
- the server's resident memory (VmRSS, sampled every `sample_s`): its level (the median
  of the last quarter's samples) grows by at most `rss_bound_mib` over the warm-up's
  baseline (the first `warm_up` share of the run), and no sample exceeds that by more
  than `rss_transient_mib` (what one tick may hold for a moment);
- no file is made outside the state directory: the server runs in a directory of its
  own with TMPDIR pointing into it, and both are empty again after it exits; nothing
  half-written (statedir.TEMP_PREFIX) is left in the state directory;
- no infer waits more than `gap_ticks` engine ticks between two of its tokens (`done`
  max_gap_ticks: a generating sequence gets a token every tick);
- DRY's breaker tables are all made by the readers (stats `dryBreakerSets.builds`).

`make soak` runs it for 10 minutes; tests/test_soak_socket.py for about a minute.
Loopback only: a Unix socket in a fresh temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.statedir import TEMP_PREFIX
from ..llama import cachetypes
from ..wire.client import Client, ServerError, ServerGone

END_TYPES = {"done", "error", "scored", "prefilled", "forked", "saved", "loaded", "freed"}
DOC = ("From fairest creatures we desire increase, that thereby beauty's rose might never die, "
       "but as the riper should by time decease, his tender heir might bear his memory. ")
PROMPTS = ["Write a short story about a lighthouse keeper.", "The capital of France is",
           "List three colours:", "Once upon a time", "def fibonacci(n):"]
GRAMMARS = ['root ::= [0-9]+', 'root ::= "yes" | "no"', '%json_schema {"type": "integer"}',
            '%llguidance {}\nstart: /[a-z]+/', 'root ::= ("a" | "b") [0-9]']
LAST_NODE = "l_out-17"  # the default model's last layer output (a row per logits row)
KINDS = ("infer", "dry", "grammar", "score", "prefill_fork", "save_load", "capture", "cancel")


@dataclass
class Config:
    seconds: float = 600.0
    clients: int = 16
    abrupt: int = 4  # of the clients, those that also hang up with requests in flight
    seed: int = 54
    warm_up: float = 0.25  # share of the run before the RSS baseline
    sample_s: float = 5.0
    rss_bound_mib: float = 64.0  # the level's growth after warm-up (a leak or a creep)
    # a single sample's room above that: what one tick may hold for a moment (the logits
    # rows a tick hands to the host, up to nBatch rows of 262,144 floats: 1 MiB each)
    rss_transient_mib: float = 256.0
    gap_ticks: int = 1
    build: str = "mainline"
    cache_type_k: str = cachetypes.DEFAULT
    cache_type_v: str = cachetypes.DEFAULT
    n_ctx: int = 4096
    n_seq_max: int = 64
    n_batch: int = 256


@dataclass
class Report:
    config: dict
    seconds: float = 0.0
    requests: dict = field(default_factory=dict)  # kind -> requests sent and awaited
    ends: dict = field(default_factory=dict)  # end event type -> count
    errors: dict = field(default_factory=dict)  # error message (first 60 chars) -> count
    hang_ups: int = 0
    tokens: int = 0
    ticks: int = 0
    max_gap_ticks: int = 0
    rss_mib: list = field(default_factory=list)  # (seconds into the run, VmRSS MiB)
    caches_mib: list = field(default_factory=list)  # (seconds, the stats caches' bytes together, MiB)
    rss_growth_mib: float = 0.0  # the highest sample after warm-up over the baseline
    rss_level_mib: float = 0.0  # the median of the last quarter's samples over the baseline
    dry: dict = field(default_factory=dict)
    files_outside: list = field(default_factory=list)
    temp_files: list = field(default_factory=list)
    load: tuple = ()
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Tally:
    """Counts shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.ends: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.tokens = 0
        self.max_gap = 0
        self.hang_ups = 0
        self.problems: list[str] = []

    def end(self, ev: dict) -> None:
        with self.lock:
            self.ends[ev["type"]] = self.ends.get(ev["type"], 0) + 1
            if ev["type"] == "error":
                key = ev.get("message", "")[:60]
                self.errors[key] = self.errors.get(key, 0) + 1
                if "internal error" in key:
                    self.problems.append(f"internal error: {ev.get('message')}")
            self.max_gap = max(self.max_gap, ev.get("max_gap_ticks", 0))

    def count(self, kind: str, tokens: int = 0) -> None:
        with self.lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1
            self.tokens += tokens

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


class _Worker:
    """One client's loop: a piece of work at a time, each answer awaited and checked."""

    def __init__(self, path: Path, n: int, cfg: Config, tally: _Tally, deadline: float,
                 breaker_sets: list) -> None:
        self.path, self.n, self.cfg, self.tally, self.deadline = path, n, cfg, tally, deadline
        self.rng = random.Random(cfg.seed * 1000 + n)
        self.abrupt = n < cfg.abrupt
        self.sets = breaker_sets
        self.c = Client.connect(path)
        self.grammars: set[str] = set()
        self.saves = 0

    def run(self, primed: threading.Barrier | None = None) -> None:
        """Each kind of work once (the warm-up's primer, before the clock), then pieces
        of work until the deadline (set once every client is primed)."""
        try:
            if primed is not None:
                for kind in self.rng.sample(KINDS, len(KINDS)):
                    getattr(self, kind)()
                primed.wait()
            while time.monotonic() < self.deadline:
                if self.abrupt and self.rng.random() < 0.08:
                    self.hang_up()
                    continue
                kind = self.rng.choice(KINDS)
                getattr(self, kind)()
            self.check_quiet()
        except (ServerError, ServerGone, AssertionError, OSError, TimeoutError) as e:
            self.tally.problem(f"client {self.n}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - reported, the other clients go on
            self.tally.problem(f"client {self.n}: {type(e).__name__}: {e}")
        finally:
            self.c.close()

    # -- the pieces of work ------------------------------------------------------------

    def one(self, kind: str, seq_id: int, req: dict, expect: set[str]) -> dict:
        """Send one request and await its one end event (tokens before it are counted)."""
        self.c.send({**req, "seq_id": seq_id})
        return self.await_end(kind, seq_id, expect)

    def await_end(self, kind: str, seq_id: int, expect: set[str]) -> dict:
        tokens = 0
        for ev in self.c.stream(seq_id, timeout=300):
            if ev["type"] == "token":
                tokens += 1
                continue
            if ev["type"] not in END_TYPES:
                raise AssertionError(f"{kind}: unexpected event {ev}")
            self.tally.end(ev)
            self.tally.count(kind, tokens)
            if ev["type"] not in expect and ev["type"] != "error":
                raise AssertionError(f"{kind}: {ev['type']}, expected one of {sorted(expect)}: {ev}")
            return ev
        raise AssertionError(f"{kind}: the stream ended without an end event")

    def sampling(self) -> dict:
        r = self.rng
        return {"temperature": r.choice([0, 0.7, 1.0]), "seed": r.randrange(1 << 30), "topK": r.choice([0, 40])}

    def infer(self) -> None:
        self.one("infer", 0, {"type": "infer", "prompt": self.rng.choice(PROMPTS),
                              "maxTokens": self.rng.randint(4, 24), **self.sampling()}, {"done"})

    def dry(self) -> None:
        self.one("dry", 0, {"type": "infer", "prompt": "one two three one two three one two",
                            "maxTokens": self.rng.randint(4, 16), "dryMultiplier": 0.8,
                            "drySequenceBreakers": self.rng.choice(self.sets), **self.sampling()}, {"done"})

    def grammar(self) -> None:
        gid = f"g{self.rng.randrange(4)}"
        if gid not in self.grammars:
            self.c.grammar(gid, self.rng.choice(GRAMMARS), timeout=300)
            self.tally.count("grammar")
            self.grammars.add(gid)
        self.one("grammar infer", 0, {"type": "infer", "prompt": "Answer:", "grammar_id": gid,
                                      "maxTokens": self.rng.randint(2, 8), **self.sampling()}, {"done"})

    def score(self) -> None:
        text = DOC[: self.rng.randint(40, len(DOC))]
        extra = {"capture": [LAST_NODE], "captureTokens": "last"} if self.rng.random() < 0.3 else {}
        self.one("score", 1, {"type": "score", "text": text, **extra}, {"scored"})

    def prefill_fork(self) -> None:
        if self.one("prefill", 1, {"type": "prefill", "prompt": DOC[: self.rng.randint(30, 120)]},
                    {"prefilled"})["type"] != "prefilled":
            return
        if self.one("fork", 1, {"type": "fork", "dst_seq_id": 2}, {"forked"})["type"] == "forked":
            self.one("infer (forked)", 2, {"type": "infer", "prompt": " And then", "maxTokens": 3,
                                           **self.sampling()}, {"done"})
        self.one("free", 1, {"type": "free"}, {"freed"})

    def save_load(self) -> None:
        if self.one("prefill", 1, {"type": "prefill", "prompt": DOC[: self.rng.randint(30, 120)]},
                    {"prefilled"})["type"] != "prefilled":
            return
        name = f"soak{self.saves % 3}.kv"
        self.saves += 1
        saved = self.one("save", 1, {"type": "save", "path": name}, {"saved"})
        self.one("free", 1, {"type": "free"}, {"freed"})
        if saved["type"] == "saved" and self.one("load", 1, {"type": "load", "path": name},
                                                  {"loaded"})["type"] == "loaded":
            self.one("infer (loaded)", 1, {"type": "infer", "prompt": " Then", "maxTokens": 2,
                                           **self.sampling()}, {"done"})

    def capture(self) -> None:
        self.one("capture", 0, {"type": "infer", "prompt": self.rng.choice(PROMPTS), "maxTokens": 3,
                                "capture": [LAST_NODE], "captureTokens": "last", **self.sampling()}, {"done"})

    def cancel(self) -> None:
        """An infer cancelled after a token or two: one end (done, cancelled); when it
        ended by itself before the cancel arrived, the cancel's own error follows."""
        self.c.send({"type": "infer", "seq_id": 3, "prompt": self.rng.choice(PROMPTS), "maxTokens": 100,
                     "temperature": 0})
        want, tokens, first = self.rng.randint(1, 3), 0, None
        for ev in self.c.stream(3, timeout=300):
            if ev["type"] != "token":
                first = ev
                break
            tokens += 1
            if tokens >= want:
                break
        if first is not None:  # it ended before any cancel was sent
            self.tally.end(first)
            self.tally.count("cancel", tokens)
            return
        self.c.cancel(3)
        first = self.await_end("cancel", 3, {"done"})
        if not (first["type"] == "done" and first["stop_reason"] == "cancelled"):
            self.await_end("cancel (after the end)", 3, {"error"})

    def hang_up(self) -> None:
        """Requests in flight, then the connection closed without reading the answers."""
        self.c.infer(0, self.rng.choice(PROMPTS), maxTokens=100)
        self.c.send({"type": "prefill", "seq_id": 1, "prompt": DOC})
        if self.rng.random() < 0.5:
            self.c.send({"type": "infer", "seq_id": 2, "prompt": "one two one two", "maxTokens": 50,
                         "dryMultiplier": 0.8, "drySequenceBreakers": self.rng.choice(self.sets)})
        time.sleep(self.rng.random() * 0.5)
        self.c.sock.shutdown(socket.SHUT_RDWR)
        self.c.close()
        with self.tally.lock:
            self.tally.hang_ups += 1
        self.c = Client.connect(self.path)
        self.grammars = set()

    def check_quiet(self) -> None:
        """Nothing more arrives once every awaited answer has: no second end event."""
        time.sleep(1.0)
        for sid, ev in self.c.unread().items():
            raise AssertionError(f"an event after its request's end on seq {sid}: {ev}")


# ------------------------------------------------------------------ the server and its books


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def files_under(root: Path, but: Path) -> list[str]:
    skip = os.path.join(str(but), "")
    found = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    return sorted(p for p in found if not p.startswith(skip))


def stats(path: Path) -> dict:
    with Client.connect(path) as c:
        c.send({"type": "stats"})
        while True:
            ev = c.misc.get(timeout=120)
            if ev["type"] == "stats":
                return ev


def start(cfg: Config, work: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The server in a directory of its own (cwd and TMPDIR inside it), its state
    directory beside; (process, socket path, state directory)."""
    home, state, tmp = work / "server", work / "state", work / "server" / "tmp"
    tmp.mkdir(parents=True)
    path = work / "soak.sock"
    init = {"nCtx": cfg.n_ctx, "nSeqMax": cfg.n_seq_max, "nBatch": cfg.n_batch, "build": cfg.build,
            "stateDir": str(state), "cacheTypeK": cfg.cache_type_k, "cacheTypeV": cfg.cache_type_v,
            "capture": True}
    env = dict(os.environ, TMPDIR=str(tmp), OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", "serve", "--socket", str(path),
                             "--max-seqs-per-client", "4", "--init", json.dumps(init)],
                            cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError((work / "server.log").read_text(errors="replace")[-2000:])
        try:
            Client.connect(path).close()
            return proc, path, state
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("the socket server did not start") from None
            time.sleep(0.2)


def prime(path: Path, cfg: Config, sets: list) -> None:
    """Before the clock: the largest decode this server makes (a score whose window is
    the whole context: full batches, every row's logits, over every KV cell; llama.cpp's
    compute buffer and the logits rows kept reach their high-water marks) and each kind
    of work once (the DRY index, the grammar engine's vocabulary, a capture), so that
    the warm-up's baseline holds what any run holds. Then every client does each kind
    once, all at once (`_Worker.run`), before the clock starts."""
    with Client.connect(path) as c:
        text = " ".join(f"Line {i} of the primer, and a few more words." for i in range(cfg.n_ctx // 8))
        c.send({"type": "score", "seq_id": 0, "text": text, "window": cfg.n_ctx})
        ev = c.wait(0, timeout=900)
        assert ev["type"] == "scored", ev
    w = _Worker(path, cfg.clients, cfg, _Tally(), float("inf"), sets)
    for kind in KINDS:
        getattr(w, kind)()
    w.c.close()
    if w.tally.problems:
        raise RuntimeError(f"the primer failed: {w.tally.problems}")


def run(cfg: Config) -> Report:
    """The soak, start to end (the server started and stopped here)."""
    rep = Report(config=asdict(cfg))
    work = Path(tempfile.mkdtemp(prefix="clickpaca-soak-"))
    proc = None
    try:
        proc, path, state = start(cfg, work)
        rng = random.Random(cfg.seed)
        sets = [["".join(rng.choices("etaoinshr :", k=40)) for _ in range(64)] for _ in range(24)]
        tally = _Tally()
        prime(path, cfg, sets)
        workers = [_Worker(path, n, cfg, tally, float("inf"), sets) for n in range(cfg.clients)]
        primed = threading.Barrier(cfg.clients + 1)
        threads = [threading.Thread(target=w.run, args=(primed,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        primed.wait(timeout=1800)  # every client has done each kind of work once
        t0 = time.monotonic()
        for w in workers:
            w.deadline = t0 + cfg.seconds
        while any(t.is_alive() for t in threads):
            now = round(time.monotonic() - t0, 1)
            rep.rss_mib.append((now, round(rss_mib(proc.pid), 1)))
            rep.caches_mib.append((now, round(sum(c["bytes"] for c in stats(path)["caches"].values()) / 2**20, 1)))
            if proc.poll() is not None:
                tally.problem(f"the server exited with {proc.returncode}")
                break
            for t in threads:
                t.join(cfg.sample_s / len(threads))
        rep.seconds = round(time.monotonic() - t0, 1)
        st = stats(path)
        rep.ticks = st["ticks"]
        rep.dry = st["caches"]["dryBreakerSets"]
        rep.rss_mib.append((rep.seconds, round(rss_mib(proc.pid), 1)))
        base = next((m for s, m in rep.rss_mib if s >= cfg.warm_up * cfg.seconds), rep.rss_mib[-1][1])
        after = [m for s, m in rep.rss_mib if s >= cfg.warm_up * cfg.seconds]
        rep.rss_growth_mib = round(max(after) - base, 1)
        rep.rss_level_mib = round(statistics.median(after[-max(1, len(after) // 4):]) - base, 1)
        rep.requests, rep.ends, rep.errors = tally.requests, tally.ends, tally.errors
        rep.tokens, rep.max_gap_ticks, rep.hang_ups = tally.tokens, tally.max_gap, tally.hang_ups
        rep.problems = list(tally.problems)
        proc.terminate()
        proc.wait(120)
        rep.files_outside = files_under(work, but=state)
        rep.files_outside = [p for p in rep.files_outside if not p.endswith("server.log")]
        rep.temp_files = sorted(str(p) for p in state.rglob(TEMP_PREFIX + "*")) if state.exists() else []
        rep.load = tuple(round(x, 1) for x in os.getloadavg())
        judge(cfg, rep)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return rep


def judge(cfg: Config, rep: Report) -> None:
    """What must hold, into rep.problems."""
    p = rep.problems
    if rep.rss_level_mib > cfg.rss_bound_mib:
        p.append(f"VmRSS's level grew {rep.rss_level_mib} MiB after the warm-up (bound {cfg.rss_bound_mib})")
    if rep.rss_growth_mib > cfg.rss_bound_mib + cfg.rss_transient_mib:
        p.append(f"VmRSS peaked {rep.rss_growth_mib} MiB over the warm-up's baseline "
                 f"(bound {cfg.rss_bound_mib} + {cfg.rss_transient_mib} for one tick's transients)")
    if rep.max_gap_ticks > cfg.gap_ticks:
        p.append(f"an infer waited {rep.max_gap_ticks} ticks between two tokens (bound {cfg.gap_ticks})")
    if rep.files_outside:
        p.append(f"files outside the state directory: {rep.files_outside[:5]}")
    if rep.temp_files:
        p.append(f"half-written files in the state directory: {rep.temp_files[:5]}")
    if rep.dry.get("builds", {}).get("engine", 0):
        p.append(f"the engine thread made DRY tables: {rep.dry['builds']}")
    if not rep.requests:
        p.append("no request was answered")


def summary(rep: Report) -> str:
    n = sum(rep.requests.values())
    rss = rep.rss_mib
    return (f"soak: {rep.config['clients']} clients ({rep.config['abrupt']} hanging up), {rep.seconds:.0f} s, "
            f"{n} requests answered ({rep.tokens} tokens, {rep.ticks} ticks), {rep.hang_ups} hang-ups; "
            f"VmRSS {rss[0][1]:.0f} -> {rss[-1][1]:.0f} MiB, level +{rep.rss_level_mib}, peak +{rep.rss_growth_mib} after warm-up "
            f"(bound {rep.config['rss_bound_mib']}); longest token gap {rep.max_gap_ticks} ticks "
            f"(bound {rep.config['gap_ticks']}); DRY tables made {rep.dry.get('builds')}; "
            f"load {rep.load}; {'OK' if rep.ok else 'PROBLEMS: ' + '; '.join(rep.problems)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clickpaca.measure.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=Config.seconds)
    ap.add_argument("--clients", type=int, default=Config.clients)
    ap.add_argument("--abrupt", type=int, default=Config.abrupt)
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--build", default=Config.build)
    ap.add_argument("--json", help="also write the whole report here")
    a = ap.parse_args(argv)
    rep = run(Config(seconds=a.seconds, clients=a.clients, abrupt=a.abrupt, seed=a.seed, build=a.build))
    print(summary(rep))
    print("requests:", json.dumps(rep.requests), "\nends:", json.dumps(rep.ends), "\nerrors:", json.dumps(rep.errors))
    print("VmRSS MiB (s, MiB):", rep.rss_mib)
    print("caches MiB (s, MiB):", rep.caches_mib)
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(rep), indent=1))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
