"""The examples of docs/PROTOCOL.md, run against a real server and the real default model.

Every fenced ```ndjson block is a session on a fresh server: each `> ` line is sent as it
is; each `< ` line is an event that must arrive, with the fields shown (`...` stands for
fields not shown, whose values vary). Before a `>` line is sent, the `<` lines above it
must have arrived, as in an interactive session. Events of one sequence must arrive in
the order shown, and no error may arrive that the block does not show.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from clickpaca.wire.client import Client

DOC = Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md"
TIMEOUT = 300  # model load + a few tokens on a loaded machine


def blocks() -> list[tuple[int, list[tuple[int, str, str]]]]:
    """(line number of the fence, [(line number, '>' or '<', text)]) per ndjson block."""
    out, cur, start = [], None, 0
    for no, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        if cur is None:
            if line.strip() == "```ndjson":
                cur, start = [], no
            continue
        if line.strip() == "```":
            out.append((start, cur))
            cur = None
            continue
        if line.startswith("> "):
            cur.append((no, ">", line[2:]))
        elif line.startswith("< "):
            cur.append((no, "<", line[2:]))
        else:
            assert not line.strip(), f"PROTOCOL.md:{no}: a line in an ndjson block must start with '> ' or '< '"
    assert cur is None, "unterminated ndjson block"
    return out


def pattern(text: str) -> dict:
    """A `<` line as a dict of the shown fields (`...` removed)."""
    t = re.sub(r",\s*\.\.\.\s*}", "}", text)
    t = re.sub(r"{\s*\.\.\.\s*,\s*", "{", t)
    t = re.sub(r",\s*\.\.\.\s*,", ",", t)
    t = re.sub(r"{\s*\.\.\.\s*}", "{}", t)
    return json.loads(t)


def matches(pat, value) -> bool:
    if isinstance(pat, dict):
        return isinstance(value, dict) and all(k in value and matches(v, value[k]) for k, v in pat.items())
    if isinstance(pat, list):
        return isinstance(value, list) and len(pat) == len(value) and all(map(matches, pat, value))
    if isinstance(pat, bool) or isinstance(value, bool):
        return pat is value
    if isinstance(pat, (int, float)) and isinstance(value, (int, float)):
        return pat == value
    return type(pat) is type(value) and pat == value


def test_doc_has_examples():
    found = blocks()
    assert found, "docs/PROTOCOL.md has no ```ndjson block"
    for start, lines in found:
        assert any(d == ">" for _, d, _ in lines) and any(d == "<" for _, d, _ in lines), start
        for no, d, text in lines:
            if d == ">":
                json.loads(text)  # a request is plain JSON
            else:
                assert isinstance(pattern(text), dict), no


def test_pattern_and_matches():
    p = pattern('{"type": "done", "seq_id": 0, "n": 2, ...}')
    assert p == {"type": "done", "seq_id": 0, "n": 2}
    assert matches(p, {"type": "done", "seq_id": 0, "n": 2, "x": 1})
    assert not matches(p, {"type": "done", "seq_id": 0, "n": 3})
    assert not matches({"a": True}, {"a": 1}) and not matches({"a": 1}, {"a": True})
    assert matches({"m": {"k": 1}}, {"m": {"k": 1, "z": 2}})


class Session:
    def __init__(self, client: Client) -> None:
        self.c = client
        self.used: set[int] = set()
        self.last_of_seq: dict[int, int] = {}

    def events(self) -> list[dict]:
        with self.c._lock:
            return list(self.c.all_events)

    def find(self, pat: dict) -> int | None:
        sid = pat.get("seq_id")
        after = self.last_of_seq.get(sid, -1) if isinstance(sid, int) and sid >= 0 else -1
        for i, ev in enumerate(self.events()):
            if i > after and i not in self.used and matches(pat, ev):
                return i
        return None

    def expect(self, no: int, text: str) -> None:
        pat = pattern(text)
        deadline = time.monotonic() + TIMEOUT
        while True:
            i = self.find(pat)
            if i is not None:
                break
            if self.c.closed.is_set() or time.monotonic() > deadline:
                evs = self.events()
                same = [e for e in evs if e.get("type") == pat.get("type")]
                pytest.fail(f"PROTOCOL.md:{no}: no event matches {text}\n"
                            f"events of that type: {json.dumps(same)[:3000]}\nall: {json.dumps(evs)[:3000]}")
            time.sleep(0.02)
        self.used.add(i)
        sid = pat.get("seq_id")
        if isinstance(sid, int) and sid >= 0:
            self.last_of_seq[sid] = i


@pytest.mark.model
@pytest.mark.parametrize("start,lines", blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_doc_example(start, lines):
    c = Client.spawn(python=sys.executable)
    try:
        s = Session(c)
        for no, direction, text in lines:
            if direction == ">":
                c.send_raw(text.encode("utf-8") + b"\n")
            else:
                s.expect(no, text)
        shown_errors = any(pattern(t).get("type") == "error" for _, d, t in lines if d == "<")
        if not shown_errors:
            errors = [e for e in s.events() if e.get("type") == "error"]
            assert not errors, f"block at PROTOCOL.md:{start}: unexpected errors {errors}"
    finally:
        rc = c.close(timeout=120)
    assert rc == 0, f"server exit code {rc}"
