"""Issue 19: the inputs that stopped, froze or escaped the server, replayed on real servers.

Each test is named after a defect and sends the original input to a real `clickpaca
serve` process (stdio, and a socket server where clients share the process), then
checks the answer is an `error` naming the field and that the server keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from clickpaca.engine.handlers import MAX_GRAMMARS_PER_SESSION
from clickpaca.wire.protocol import (MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_BYTES,
                                     MAX_STOPS, MAX_TEMPLATE_BYTES)
from clickpaca.sampling.table import N_PROBS_MAX

from clickpaca.engine import kvstate
from clickpaca.wire.client import Client, ServerError
from conftest import spawn_server
from test_socket import start_server, stop_server

pytestmark = pytest.mark.model

DEEP = b'{"type":"infer","seq_id":0,"prompt":' + b'{"a":' * 1000 + b"1" + b"}" * 1001 + b"\n"
CHAIN_4000 = "\n".join(["root ::= r0"] + [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(4000)]
                       + ['r4000 ::= "z"'])
REF_CHAIN_1000 = "%json_schema " + json.dumps({"$ref": "#/$defs/a0", "$defs": {
    **{f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(1000)},
    "a1000": {"type": "integer"}}})


@pytest.fixture(scope="module")
def srv():
    c = spawn_server(nCtx=2048, nSeqMax=8, nBatch=64)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sock(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "s.sock"
    proc = start_server(path, "--max-seqs-per-client", "6", nCtx=2048, nSeqMax=16, nBatch=64)
    yield path
    stop_server(proc, path)


def alive(c: Client, sid: int = 7) -> None:
    c.infer(sid, "The capital of France is", maxTokens=2, temperature=0)
    toks, done = c.collect(sid)
    assert done["type"] == "done" and len(toks) == 2, done


def error_for(c: Client, sid: int) -> dict:
    ev = c._queues[sid].get(timeout=120)
    assert ev["type"] == "error", ev
    return ev


# ------------------------------------------------------------------ 1. deep JSON


def test_deep_json_is_refused_and_the_reader_keeps_reading(srv):
    srv.send_raw(DEEP)
    ev = error_for(srv, 0)
    assert ev["request"] == "infer" and "nested deeper than 32" in ev["message"], ev
    srv.send_raw(b'{"type":"infer","seq_id":1,"prompt":' + b"[" * 900 + b"]" * 900 + b"}\n")
    assert "nested deeper than 32" in error_for(srv, 1)["message"]
    for depth in (1100, 5000):  # beyond what orjson parses: refused as JSON, on no sequence
        srv.send_raw(b'{"type":"infer","seq_id":1,"prompt":' + b"[" * depth + b"]" * depth + b"}\n")
        ev = srv.next_misc()
        assert ev["type"] == "error" and "depth limit exceeded" in ev["message"], ev
    alive(srv)
    assert srv.proc.poll() is None


def test_deep_json_over_a_socket_does_not_drop_the_client(sock):
    with Client.connect(sock) as c:
        c.send_raw(DEEP)
        assert "nested deeper" in error_for(c, 0)["message"]
        alive(c)


# ------------------------------------------------------------------ 2. grammar crash


def test_a_4000_rule_chain_grammar_is_refused_before_compiling(srv):
    srv.send({"type": "grammar", "id": "chain", "grammar": CHAIN_4000})
    ev = srv.next_misc()
    assert ev["type"] == "error" and ev["request"] == "grammar", ev
    assert "4002 rules, the limit is 1000" in ev["message"], ev
    srv.send({"type": "grammar", "id": "refs", "grammar": REF_CHAIN_1000})
    ev = srv.next_misc()
    assert ev["type"] == "error" and "subschemas, the limit is 1000" in ev["message"], ev
    nested = "root ::= " + '("a" ' * 100 + '"b"' + ")" * 100
    srv.send({"type": "grammar", "id": "nested", "grammar": nested})
    ev = srv.next_misc()
    assert ev["type"] == "error" and "nested 100 levels deep" in ev["message"], ev
    alive(srv)


def test_a_grammar_over_the_size_limit_is_refused_once_naming_the_field(srv):
    # the size's one check is the edge's (wire/protocol/); grammars/limits.py checks only rules and nesting
    text = 'root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"'
    srv.send({"type": "grammar", "id": "big", "grammar": text})
    ev = srv.next_misc()
    assert ev["type"] == "error" and ev["request"] == "grammar", ev
    assert ev["message"] == f"grammar: {len(text)} bytes, the limit is {MAX_GRAMMAR_BYTES}", ev
    alive(srv)


def test_a_chain_inside_the_limits_compiles_on_the_compile_thread(srv):
    # 900 chained rules: legal, and deeper than 8 MiB of stack could hold for $refs
    chain = "\n".join(["root ::= r0"] + [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(900)] + ['r900 ::= "z"'])
    assert srv.grammar("ok", chain) == {"type": "grammar_ready", "id": "ok"}
    srv.infer(2, "Say y:", maxTokens=3, temperature=0, grammar_id="ok")
    toks, done = srv.collect(2)
    assert done["type"] == "done" and toks, done
    assert all(t["piece"] in ("x", "y", "z") or t["piece"].startswith(("x", "y", "z")) for t in toks), toks


def test_the_crashing_grammar_from_one_socket_client_leaves_the_others_generating(sock):
    with Client.connect(sock) as a, Client.connect(sock) as b:
        a.infer(0, "Write a long story about a lighthouse.", maxTokens=40, temperature=0)
        b.send({"type": "grammar", "id": "chain", "grammar": CHAIN_4000})
        assert b.next_misc()["type"] == "error"
        toks, done = a.collect(0)
        assert done["type"] == "done" and len(toks) == done["tokens_predicted"], done


def test_too_many_grammar_ids_in_one_session(srv):
    limit = MAX_GRAMMARS_PER_SESSION
    answers = []
    for i in range(limit + 6):  # earlier tests of this module hold a few ids already
        try:
            answers.append(srv.grammar(f"g{i}", 'root ::= "a"')["type"])
        except ServerError as e:
            assert f"holds {limit} grammars, the limit" in str(e), e
            answers.append("refused")
    first = answers.index("refused")
    assert limit - 4 <= first <= limit and set(answers[first:]) == {"refused"}, answers
    assert srv.grammar("g0", 'root ::= "b"')["type"] == "grammar_ready"  # replacing is fine


# ------------------------------------------------------------------ 3. init aborts


@pytest.mark.parametrize("n_ctx,n_seq", [(16, 17), (100, 128), (255, 256)])
def test_init_with_nctx_below_nseqmax_is_an_error_not_an_abort(n_ctx, n_seq, tmp_path):
    c = Client.spawn()
    try:
        c.send({"type": "init", "nCtx": n_ctx, "nSeqMax": n_seq, "nBatch": 512, "stateDir": str(tmp_path)})
        ev = c.next_misc(timeout=300)
        assert ev["type"] == "error" and ev["message"].startswith("nCtx: must be >= nSeqMax"), ev
        c.send({"type": "init", "nThreads": 513})
        assert "nThreads: must be <= 512" in c.next_misc()["message"]
        c.send({"type": "init", "build": "../../tmp/evil"})
        assert c.next_misc()["message"].startswith("build: must be a build name")
        # the process is still there, uninitialised, and a good init works
        ready = c.init(nCtx=n_seq, nSeqMax=n_seq, nBatch=512, stateDir=str(tmp_path))
        assert ready["nSeqMax"] == n_seq
        alive(c, 0)
    finally:
        c.close()
    assert c.proc.returncode == 0


# ------------------------------------------------------------------ 4. slot leak


def test_a_failed_load_releases_its_slot(srv):
    srv.send({"type": "load", "seq_id": 0, "path": "a\u0000b"})
    ev = error_for(srv, 0)
    assert ev["message"].startswith("path:") and "internal" not in ev["message"], ev
    alive(srv, 0)  # seq 0 is not "already active"
    srv.send({"type": "free", "seq_id": 0})
    ev = error_for(srv, 0)  # nothing held: no `done` for a request that never started
    assert "holds nothing" in ev["message"], ev


def test_a_state_file_with_an_out_of_vocabulary_token_is_refused_at_load(srv):
    srv.request({"type": "prefill", "seq_id": 3, "prompt": "A short document."})
    srv.request({"type": "save", "seq_id": 3, "path": "good.kv"})
    srv.request({"type": "free", "seq_id": 3})
    sd = srv.ready["stateDir"]
    data = open(os.path.join(sd, "good.kv"), "rb").read()
    header, tokens, payload = kvstate.decode(data, "good.kv")
    tokens[1] = 10 ** 6
    toks = struct.pack(f"<{len(tokens)}i", *tokens)
    header["sha256"] = hashlib.sha256(toks + payload).hexdigest()
    h = json.dumps(header).encode()
    with open(os.path.join(sd, "oov.kv"), "wb") as f:
        f.write(kvstate.MAGIC + struct.pack("<I", len(h)) + h + toks + payload)
    srv.send({"type": "load", "seq_id": 3, "path": "oov.kv"})
    ev = error_for(srv, 3)
    assert "token 1000000, outside the vocabulary" in ev["message"], ev
    alive(srv, 3)  # the slot came back
    assert srv.request({"type": "load", "seq_id": 3, "path": "good.kv"})["type"] == "loaded"
    srv.request({"type": "free", "seq_id": 3})


# ------------------------------------------------------------------ 5. FIFO


def test_loading_a_fifo_is_refused_without_blocking_anyone(srv):
    sd = srv.ready["stateDir"]
    os.mkfifo(os.path.join(sd, "pipe"))  # no writer will ever appear
    srv.infer(4, "Write a long story about a lighthouse.", maxTokens=30, temperature=0)
    srv.send({"type": "load", "seq_id": 5, "path": "pipe"})
    ev = error_for(srv, 5)
    assert "not a regular file" in ev["message"], ev
    toks, done = srv.collect(4)
    assert done["type"] == "done" and len(toks) == 30, done
    os.symlink("/dev/zero", os.path.join(sd, "zero"))
    srv.send({"type": "load", "seq_id": 5, "path": "zero"})
    assert "not a regular file" in error_for(srv, 5)["message"]


# ------------------------------------------------------------------ 6. paths


def test_save_and_load_take_names_inside_the_state_directory(srv, tmp_path):
    sd = srv.ready["stateDir"]
    srv.request({"type": "prefill", "seq_id": 6, "prompt": "Held text."})
    outside = tmp_path / "unrelated.txt"
    outside.write_text("keep me")
    os.chmod(outside, 0o644)
    for bad in ["evil/../x", "../x", str(tmp_path / "x.kv"), ".hidden", "", "a/b"]:
        srv.send({"type": "save", "seq_id": 6, "path": bad})
        ev = error_for(srv, 6)
        assert ev["message"].startswith("path:"), ev
    assert not os.path.exists(os.path.join(sd, "evil")) and not (tmp_path / "x.kv").exists()
    # a symlink in the directory is never followed or replaced
    os.symlink(outside, os.path.join(sd, "link.kv"))
    srv.send({"type": "save", "seq_id": 6, "path": "link.kv"})
    assert "not a regular file" in error_for(srv, 6)["message"]
    assert os.path.islink(os.path.join(sd, "link.kv")) and outside.read_text() == "keep me"
    # an existing file that is not a state file is not replaced
    (open(os.path.join(sd, "notes.txt"), "w")).write("mine")
    srv.send({"type": "save", "seq_id": 6, "path": "notes.txt"})
    assert "not a clickpaca state file" in error_for(srv, 6)["message"]
    assert open(os.path.join(sd, "notes.txt")).read() == "mine"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    # errors do not reveal what exists outside the directory
    msgs = []
    for p in ["/etc/passwd", "/etc/no-such-file-here"]:
        srv.send({"type": "load", "seq_id": 5, "path": p})
        msgs.append(error_for(srv, 5)["message"].replace(p, "P"))
    assert msgs[0] == msgs[1], msgs
    # a state file is replaced in place, and nothing else is left in the directory
    assert srv.request({"type": "save", "seq_id": 6, "path": "held.kv"})["type"] == "saved"
    assert srv.request({"type": "save", "seq_id": 6, "path": "held.kv"})["type"] == "saved"
    assert not [n for n in os.listdir(sd) if n.startswith(".")]
    srv.request({"type": "free", "seq_id": 6})


def test_socket_clients_have_their_own_state_names(sock):
    with Client.connect(sock) as a, Client.connect(sock) as b:
        a.request({"type": "prefill", "seq_id": 0, "prompt": "Client A's document."})
        b.request({"type": "prefill", "seq_id": 0, "prompt": "Client B's other document."})
        a.request({"type": "save", "seq_id": 0, "path": "doc.kv"})
        b.send({"type": "load", "seq_id": 1, "path": "doc.kv"})  # A's private name
        assert "no state file named" in error_for(b, 1)["message"]
        b.request({"type": "save", "seq_id": 0, "path": "doc.kv"})  # B's own, A's is untouched
        assert a.request({"type": "load", "seq_id": 1, "path": "doc.kv"})["tokens"] == \
            a.request({"type": "fork", "seq_id": 0, "dst_seq_id": 2})["tokens"]
        # shared names: never replaced silently
        name = f"shared-{os.getpid()}.kv"
        a.request({"type": "save", "seq_id": 0, "path": name, "shared": True})
        b.send({"type": "save", "seq_id": 0, "path": name, "shared": True})
        assert "replace: true" in error_for(b, 0)["message"]
        loaded = b.request({"type": "load", "seq_id": 3, "path": name, "shared": True})
        assert loaded["tokens"] == a.request({"type": "fork", "seq_id": 0, "dst_seq_id": 4})["tokens"]
        b.request({"type": "save", "seq_id": 0, "path": name, "shared": True, "replace": True})
        # --allow-any-path does not exist for sockets: absolute paths are names, refused
        b.send({"type": "load", "seq_id": 5, "path": "/etc/passwd"})
        assert error_for(b, 5)["message"].startswith("path:")


def test_a_client_holds_at_most_its_share_of_slots(sock):
    with Client.connect(sock) as a, Client.connect(sock) as b:
        for sid in range(6):
            a.request({"type": "prefill", "seq_id": sid, "prompt": "Held."})
        a.send({"type": "prefill", "seq_id": 6, "prompt": "One too many."})
        ev = error_for(a, 6)
        assert "--max-seqs-per-client 6" in ev["message"], ev
        alive(b, 0)  # another client still gets a slot


# ------------------------------------------------------------------ 7. --queue


def test_queue_counts_events_and_drops_a_client_that_does_not_read(tmp_path):
    path = tmp_path / "q.sock"
    proc = start_server(path, "--queue", "8", nCtx=4096, nSeqMax=8, nBatch=64)
    lines: list[str] = []
    dropped = threading.Event()

    def watch():
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            if "dropping" in lines[-1] and "event queue full (8 events" in lines[-1]:
                dropped.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect(str(path))
        for sid in range(6):  # ~6 KiB per token event with nProbs 100; this client never reads
            hog.sendall(json.dumps({"type": "infer", "seq_id": sid, "prompt": "Tell a story.",
                                    "maxTokens": 400, "nProbs": 100, "temperature": 0}).encode() + b"\n")
        with Client.connect(path) as other:
            deadline = time.monotonic() + 600
            while not dropped.is_set():
                assert time.monotonic() < deadline and proc.poll() is None, lines[-5:]
                dropped.wait(1)
            alive(other, 0)
        hog.close()
    finally:
        stop_server(proc, path)


# ------------------------------------------------------------------ head-of-line blocking

LONG_TEXT = ("From fairest creatures we desire increase, that thereby beauty's rose might never die. "
             * 460)[:40000]


def test_a_one_token_infer_behind_a_40000_character_score_ends_first(srv):
    """Ordering, not timing: the score needs a tick per window (about ten here); the infer
    behind it must not wait for them all."""
    srv.send({"type": "score", "seq_id": 5, "text": LONG_TEXT})
    srv.infer(6, "Hello", maxTokens=1, temperature=0)
    toks, done = srv.collect(6)
    assert done["type"] == "done" and len(toks) == 1, done
    assert srv._queues[5].empty(), "the score ended before the infer sent behind it"
    scored = srv.collect(5)[1]
    assert scored["type"] == "scored" and scored["windows"] >= 8, scored


def test_a_score_from_one_socket_client_does_not_hold_up_another(sock):
    with Client.connect(sock) as a, Client.connect(sock) as b:
        a.send({"type": "score", "seq_id": 0, "text": LONG_TEXT})
        time.sleep(0.2)  # let the score start (not a threshold: the order below holds either way)
        b.infer(0, "Hello", maxTokens=1, temperature=0)
        assert b.collect(0)[1]["type"] == "done"
        assert a._queues[0].empty(), "the score ended before the other client's infer"
        assert a.collect(0)[1]["type"] == "scored"


def test_a_1_mb_prompt_beyond_the_context_is_refused_while_others_generate(srv):
    """The prompt (tokenized on the reader thread, prepare.py) is refused: it cannot fit
    the context; the running generation ends normally."""
    srv.infer(0, "Write a long story about a lighthouse.", maxTokens=60, temperature=0)
    assert next(srv.stream(0))["type"] == "token"
    srv.send({"type": "infer", "seq_id": 1, "prompt": "word " * 200_000, "maxTokens": 1})
    ev = error_for(srv, 1)
    assert "do not fit the context" in ev["message"], ev
    toks, done = srv.collect(0)
    assert done["type"] == "done", done


# ------------------------------------------------------------------ issue 30
#
# quit with stdin open; requests whose size or shape froze the engine thread; limits;
# the stats request; the small ones. Waits are bounded in ticks: a "tick" here is the
# median gap between a generating sequence's tokens in the same run.

GAP_TICKS = 12  # a well-behaved sequence's longest gap while a hostile request is prepared
HOSTILE = {  # each is refused: it cannot fit nCtx 2048 (the srv and sock fixtures)
    "1024 empty chat turns": {"messages": [{"role": "user", "content": ""}] * 1024, "chatTemplate": "gemma"},
    "16,000 '<'": {"prompt": "<" * 16000},
    "1 MiB of '<'": {"prompt": "<" * (1 << 20)},
    "300,000 one-character lines": {"prompt": "a\n" * 300_000},
}


class Stamped(Client):
    """A client that notes when each event arrived (`_t`, monotonic seconds)."""

    def _decode(self, line: bytes) -> dict:
        ev = super()._decode(line)
        ev["_t"] = time.monotonic()
        return ev


def stamped_stdio(**init) -> Stamped:
    from conftest import TEST_BUILD, TEST_CACHE_K, TEST_CACHE_V

    c = Stamped.spawn(python=sys.executable)
    c.init(**{"nCtx": 2048, "nSeqMax": 8, "nBatch": 64, "build": TEST_BUILD, "cacheTypeK": TEST_CACHE_K,
              "cacheTypeV": TEST_CACHE_V, "stateDir": tempfile.mkdtemp(prefix="clkp-state-"), **init})
    return c


def longest_gap_in_ticks(arrivals: list[float], start: float, end: float) -> float:
    """The longest wait for a token within [start, end], in units of the median gap."""
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    tick = gaps[len(gaps) // 2]
    inside = [start] + [t for t in arrivals if start < t < end] + [end]
    return max(b - a for a, b in zip(inside, inside[1:])) / tick


def hostile_while_generating(runner: Stamped, hostile: Client, fields: dict, sid: int = 0) -> tuple[dict, float]:
    """`runner` generates on sid; `hostile` sends its request (on seq 1) once tokens flow.
    (the hostile request's error, the runner's longest gap meanwhile in ticks)."""
    # after init the grammar engine reads the vocabulary on a thread of its own (a Python
    # loop over 262,144 tokens that competes for the GIL): wait for it, it is no request's
    runner.grammar("warm", 'root ::= "a"')
    runner.infer(sid, "Write a long story about a lighthouse keeper.", maxTokens=400, temperature=0)
    it = runner.stream(sid)
    arrivals = [next(it)["_t"] for _ in range(8)]
    t0 = time.monotonic()
    hostile.send({"type": "infer", "seq_id": 1, "maxTokens": 1, **fields})
    ev = hostile._queues[1].get(timeout=600)
    t1 = ev["_t"] if "_t" in ev else time.monotonic()
    runner.send({"type": "cancel", "seq_id": sid})
    arrivals += [e["_t"] for e in it if e["type"] == "token"]
    assert t1 < arrivals[-1], "the runner ended before the hostile request was answered"
    gap = longest_gap_in_ticks(arrivals, t0, t1)
    print(f"answered after {t1 - t0:.2f}s; the generating sequence's longest gap meanwhile {gap:.1f} ticks "
          f"(load {os.getloadavg()[0]:.1f})")
    return ev, gap


@pytest.fixture(scope="module")
def stamped():
    c = stamped_stdio()
    yield c
    c.close()


@pytest.mark.parametrize("case", ["before init", "idle", "running", "now"])
def test_quit_with_stdin_left_open_exits_0(case):
    """Exit status 134 (SIGABRT: 'could not acquire lock for <stdin> at interpreter
    shutdown') before: the daemon reader held sys.stdin's lock at exit."""
    from conftest import TEST_BUILD

    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", "serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [] if case == "before init" else [
        {"type": "init", "nCtx": 1024, "nSeqMax": 2, "nBatch": 64, "build": TEST_BUILD,
         "stateDir": tempfile.mkdtemp(prefix="clkp-state-")}]
    if case in ("running", "now"):
        lines.append({"type": "infer", "seq_id": 0, "prompt": "Tell a story.", "temperature": 0,
                      "maxTokens": 12 if case == "running" else 100_000})
    lines.append({"type": "quit", "now": case == "now"})
    proc.stdin.write(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    proc.stdin.flush()  # and stdin stays open
    try:
        out, err = [], []
        threads = [threading.Thread(target=lambda s=s, o=o: o.append(s.read()), daemon=True)
                   for s, o in ((proc.stdout, out), (proc.stderr, err))]
        for t in threads:
            t.start()
        rc = proc.wait(timeout=300)
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()
    assert rc == 0, err[0][-2000:]
    assert b"Fatal Python error" not in err[0]
    events = [json.loads(x) for x in out[0].splitlines()]
    if case in ("running", "now"):
        ends = [e for e in events if e.get("seq_id") == 0 and e["type"] in ("done", "error")]
        assert len(ends) == 1, events[-3:]
        if case == "running":
            assert ends[0]["type"] == "done" and ends[0]["tokens_predicted"] == 12, ends


def test_20000_chat_turns_are_refused_by_their_number(srv):
    """50.5 s on the engine thread before ("100004 tokens do not fit")."""
    srv.send({"type": "infer", "seq_id": 1, "maxTokens": 1, "chatTemplate": "gemma",
              "messages": [{"role": "user", "content": ""}] * 20_000})
    ev = error_for(srv, 1)
    assert ev["message"] == f"messages: 20000 messages, the limit is {MAX_MESSAGES}", ev
    alive(srv)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_prompt_on_stdio_leaves_another_sequence_generating(stamped, name):
    ev, gap = hostile_while_generating(stamped, stamped, HOSTILE[name])
    assert ev["type"] == "error" and "do not fit the context" in ev["message"], ev
    assert gap <= GAP_TICKS, f"{name}: the generating sequence waited {gap:.0f} ticks"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_socket_client_leaves_another_generating(sock, name):
    with Stamped.connect(sock) as runner, Stamped.connect(sock) as hostile:
        ev, gap = hostile_while_generating(runner, hostile, HOSTILE[name])
        assert ev["type"] == "error" and "do not fit the context" in ev["message"], ev
        assert gap <= GAP_TICKS, f"{name}: the other client's sequence waited {gap:.0f} ticks"
        alive(runner)


@pytest.mark.parametrize("field,value,message", [
    ("stop", ["x"] * (MAX_STOPS + 1), f"stop: {MAX_STOPS + 1} strings, the limit is {MAX_STOPS}"),
    ("stop", ["y" * (MAX_STOP_BYTES + 1)], f"stop: a string of {MAX_STOP_BYTES + 1} bytes"),
    ("logit_bias", [{"token": t, "bias": 1.0} for t in range(MAX_LOGIT_BIAS + 1)],
     f"logit_bias: {MAX_LOGIT_BIAS + 1} entries, the limit is {MAX_LOGIT_BIAS}"),
    ("chatTemplate", "t" * (MAX_TEMPLATE_BYTES + 1), f"chatTemplate: {MAX_TEMPLATE_BYTES + 1} bytes"),
    ("nProbs", N_PROBS_MAX + 1, f"nProbs: must be <= {N_PROBS_MAX}, got {N_PROBS_MAX + 1}"),  # its row's one check
])
def test_request_size_limits_name_the_field(srv, field, value, message):
    req = {"type": "infer", "seq_id": 2, "prompt": "Hi", "maxTokens": 1, field: value}
    if field == "chatTemplate":
        req = {**req, "prompt": None, "messages": [{"role": "user", "content": "Hi"}]}
        del req["prompt"]
    srv.send(req)
    assert error_for(srv, 2)["message"].startswith(message)


def stats_of(c: Client) -> dict:
    c.send({"type": "stats"})
    while True:  # (earlier errors on no sequence wait in the same queue)
        ev = c.misc.get(timeout=120)
        if ev["type"] == "stats":
            return ev


def check_bounds(stats: dict) -> None:
    for name, row in stats["caches"].items():
        assert 0 <= row["entries"] <= row["maxEntries"] and 0 <= row["bytes"] <= row["maxBytes"], (name, row)


@pytest.fixture()
def fresh():
    """A server of its own: the module's `srv` session has filled its grammar ids in the
    tests of the per-session limit above."""
    c = spawn_server(nCtx=2048, nSeqMax=8, nBatch=64)
    yield c
    c.close()


def test_stats_names_every_cache_with_its_bounds(fresh):
    srv = fresh
    alive(srv)  # at least one tick
    first = stats_of(srv)
    assert set(first["caches"]) == {"grammarCache", "sessionGrammars", "allSessionGrammars", "samplerPlans",
                                    "tokenPieces", "dryBreakerSets"}, first
    assert first["ticks"] > 0 and first["rssBytes"] > 0
    check_bounds(first)
    cache = first["caches"]["grammarCache"]
    for i in range(cache["maxEntries"] + 6):  # distinct texts: the compile cache stays at its bound
        assert srv.grammar(f"s{i % 4}", f'root ::= "{i}"')["type"] == "grammar_ready"
    later = stats_of(srv)
    check_bounds(later)
    assert later["caches"]["grammarCache"]["entries"] == cache["maxEntries"]
    assert later["ticks"] >= first["ticks"]


def test_stats_over_a_socket_counts_every_client(sock):
    with Client.connect(sock) as a, Client.connect(sock) as b:
        a.grammar("ga", 'root ::= "a"')
        b.grammar("gb", 'root ::= "b"')
        b.grammar("gc", 'root ::= "c"')
        st = stats_of(a)
        check_bounds(st)
        assert st["caches"]["sessionGrammars"]["entries"] == 1
        assert st["caches"]["allSessionGrammars"]["sessions"] >= 2
        assert st["caches"]["allSessionGrammars"]["entries"] >= 3


@pytest.mark.parametrize("transport", ["stdio", "socket"])
def test_sample_is_accepted_as_the_last_step_only(srv, sock, transport):
    c = srv if transport == "stdio" else Client.connect(sock)
    try:
        c.infer(3, "The capital of France is", maxTokens=2, temperature=0,
                samplers=["top_k", "temperature", "sample"])
        toks, done = c.collect(3)
        assert done["type"] == "done" and len(toks) == 2, done
        c.infer(3, "Hi", maxTokens=1, samplers=["sample", "top_k"])
        ev = error_for(c, 3)
        assert "unknown step \"sample\" ('sample' is the fixed last step: only there)" in ev["message"], ev
    finally:
        if c is not srv:
            c.close()


def test_a_tiny_temperature_is_greedy_without_warnings(tmp_path):
    """"no candidate has a finite logit" and a numpy overflow warning on stderr before."""
    from conftest import TEST_BUILD

    err = open(tmp_path / "stderr", "w+b")
    c = Client.spawn(stderr=err, python=sys.executable)
    try:
        c.init(nCtx=1024, nSeqMax=2, nBatch=64, build=TEST_BUILD, stateDir=str(tmp_path))
        runs = []
        for t in (5e-324, 1e-30, 0):
            c.infer(0, "The capital of France is", maxTokens=4, temperature=t, nProbs=2)
            toks, done = c.collect(0)
            assert done["type"] == "done" and len(toks) == 4, (t, done)
            runs.append([x["token"] for x in toks])
        assert runs[0] == runs[1] == runs[2]
    finally:
        c.close()
    err.seek(0)
    text = err.read().decode(errors="replace")
    assert "Warning" not in text and "overflow" not in text, text[-2000:]


def test_one_stderr_line_per_dropped_client(tmp_path):
    path = tmp_path / "d.sock"
    proc = start_server(path, nCtx=4096, nSeqMax=32, nBatch=64)
    try:
        socks = []
        for i in range(24):  # all streaming, then all hung up at once
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            s.sendall(json.dumps({"type": "infer", "seq_id": 0, "prompt": "Tell a story.",
                                  "maxTokens": 200, "temperature": 0}).encode() + b"\n")
            socks.append(s)
        time.sleep(2)
        for s in socks:
            s.close()
        with Client.connect(path) as c:
            alive(c, 0)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=120)
    lines = err.decode(errors="replace").splitlines()
    drops = [x for x in lines if "dropping" in x]
    assert all(x.count("clickpaca:") == 1 and x.startswith("clickpaca: dropping client-") for x in drops), drops
    assert not path.exists()
