"""clickpaca.wire.client: a server that dies is one ServerError naming how it died, for every
reader, never a hang or a traceback; `clickpaca demo` / `ppl` report a death in one line.

The deaths are real: a real server process, killed with the signal a bad build dies of
(SIGILL, what ggml's AMX path did on the first prompt, issue #23)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clickpaca.wire.client import Client, ServerError
from clickpaca.llama.cpu import cpu_name

from conftest import spawn_server

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent


def test_a_killed_server_is_one_server_error_naming_the_signal_and_its_stderr():
    c = spawn_server()
    try:
        c.infer(0, "Once upon a time", maxTokens=400, temperature=0,
                logit_bias=[{"token": t, "bias": -1e9} for t in (1, 106, 212)])
        first = next(c.stream(0))
        assert first["type"] == "token"
        os.kill(c.proc.pid, signal.SIGILL)
        with pytest.raises(ServerError) as err:
            for _ in c.stream(0):
                pass
        msg = str(err.value)
        assert msg.startswith("the server died: SIGILL (illegal instruction)"), msg
        assert cpu_name() in msg and "likely cause" in msg, msg
        assert err.value.event["status"] == -signal.SIGILL
        # every later reader learns the same, at once: a new sequence, a misc wait, a request
        for call in (lambda: c.wait(1, timeout=5), lambda: c.init(timeout=5),
                     lambda: c.text(0, timeout=5)):
            with pytest.raises(ServerError) as again:
                call()
            assert str(again.value) == msg
    finally:
        c.close()


def test_the_death_report_carries_the_last_stderr_lines(tmp_path):
    """stderr to a file (as the benches do): the report reads its tail back."""
    log = open(tmp_path / "server.log", "wb")
    c = Client.spawn(stderr=log, python=sys.executable)
    try:
        c.send_raw(b"not json\n")  # an error event on stdout; nothing on stderr yet
        log.flush()
        with open(tmp_path / "server.log", "ab") as f:  # what a dying native library prints
            f.write(b"ggml: fatal: something went wrong in a kernel\n")
        os.kill(c.proc.pid, signal.SIGSEGV)
        with pytest.raises(ServerError) as err:
            c.init(timeout=60)
        msg = str(err.value)
        assert msg.startswith("the server died: SIGSEGV"), msg
        assert "something went wrong in a kernel" in msg and err.value.event["stderr"], msg
    finally:
        c.close()
        log.close()


def test_a_server_that_exits_cleanly_is_not_called_dead():
    """End of input: the server exits 0, and a reader is told so, not that it died."""
    c = spawn_server()
    c.wfile.close()
    with pytest.raises(ServerError) as err:
        c.wait(0, timeout=60)
    assert str(err.value) == "the server exited (status 0)"
    assert c.close() == 0


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmd = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append((child, cmd))
            todo.append(child)
    return out


def wait_for(pid: int, needle: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child, cmd in descendants(pid):
            if needle in cmd:
                return child
        time.sleep(0.1)
    raise AssertionError(f"no process {needle!r} below {pid} within {timeout} s")


def test_demo_reports_a_dead_server_in_one_line_and_exits_non_zero():
    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", "demo"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = wait_for(proc.pid, "clickpaca serve")
    time.sleep(1.0)  # let it load the model and start the batch
    os.kill(server, signal.SIGILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("clickpaca demo:")]
    assert len(lines) == 1 and "the server died: SIGILL (illegal instruction)" in lines[0], err[-3000:]


def test_an_in_process_native_death_is_one_line_too():
    """`clickpaca ppl` runs llama.cpp in its own process: the guarded child dies, and the
    command prints the signal, the CPU and the likely cause in one line, exit 128+signal."""
    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", "ppl", "--cache", "f16", "--ctx", "512",
                             "--chunks", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    child = wait_for(proc.pid, "clickpaca ppl")
    time.sleep(0.5)
    os.kill(child, signal.SIGILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGILL, (out[-2000:], err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("clickpaca ppl: died:")]
    assert len(lines) == 1, err[-3000:]
    assert "SIGILL (illegal instruction)" in lines[0] and cpu_name() in lines[0], lines[0]


def test_the_client_imports_neither_numpy_nor_the_protocol_nor_the_sampler():
    """Issue #25: client.py imported the protocol (numpy, the sampler) to learn the end
    events; it reads them from endings.py, which the protocol checks at import."""
    code = ("import sys, clickpaca.wire.client; "
            "print(sorted(m for m in ('numpy', 'clickpaca.wire.protocol', 'clickpaca.sampling') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-500:])
    from clickpaca.wire.client import END_TYPES
    from clickpaca.wire.protocol import END_EVENTS
    assert END_TYPES == END_EVENTS


def test_the_engine_package_imports_nothing_itself():
    """Engine left the package __init__: the pure engine modules load without the model."""
    code = "import sys, clickpaca.engine.plan; print('clickpaca.llama.core' in sys.modules, 'cffi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False False", (out.stdout, out.stderr[-500:])
