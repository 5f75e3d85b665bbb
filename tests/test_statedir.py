"""clickpaca.engine.statedir and the grammar limits, without a model (the server-level checks are
in tests/test_hostile_clients.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from clickpaca.engine import statedir
from clickpaca.grammar.grammars import MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES, GrammarError, check_limits
from clickpaca.grammar.grammars.limits import _bracket_depth
from clickpaca.wire.protocol import MAX_JSON_DEPTH, ProtocolError, json_depth, parse_line
from clickpaca.engine.statedir import TEMP_PREFIX, StateDir, StatePathError


def refuse(dir_fd, name):
    raise StatePathError(f"{name} exists")


@pytest.fixture
def sd(tmp_path):
    return StateDir(tmp_path / "state")


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 129, "/etc/passwd", "a\x00b",
                                  TEMP_PREFIX + "1-ab", "é"])
def test_only_plain_names_are_accepted(sd, name):
    with pytest.raises(StatePathError) as e:
        sd.locate(name, None, False)
    assert str(e.value).startswith("path:")


def test_names_resolve_in_namespaces(sd):
    for ns, shared, where in [(None, False, sd.root), ("clients/1-1-ab", False, sd.root / "clients/1-1-ab"),
                              ("clients/1-1-ab", True, sd.root / "shared")]:
        fd, name, _ = sd.locate("x.kv", ns, shared)
        try:
            statedir.write_file(fd, name, [b"data"], name, refuse)
        finally:
            os.close(fd)
        assert (where / "x.kv").read_bytes() == b"data"


def test_non_regular_files_are_never_opened(sd, tmp_path):
    os.mkfifo(sd.root / "fifo")
    (tmp_path / "target").write_bytes(b"secret")
    os.symlink(tmp_path / "target", sd.root / "link")
    os.symlink("/dev/zero", sd.root / "dev")
    (sd.root / "dir").mkdir()
    fd = statedir.open_dir(sd.root)
    try:
        for name in ("fifo", "link", "dev", "dir"):
            with pytest.raises(StatePathError, match="not a regular file"):
                statedir.read_file(fd, name, name)  # a FIFO would block here if opened
            with pytest.raises(StatePathError, match="not a regular file"):
                statedir.write_file(fd, name, [b"x"], name, lambda *a: None)
        with pytest.raises(StatePathError, match="no state file named"):
            statedir.read_file(fd, "missing", "missing")
    finally:
        os.close(fd)
    assert (tmp_path / "target").read_bytes() == b"secret"
    assert sorted(os.listdir(sd.root)) == ["dev", "dir", "fifo", "link"]


def test_a_symlinked_namespace_is_refused(sd, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", sd.root / "shared")
    with pytest.raises(StatePathError):
        sd.locate("x.kv", None, True)


def test_sweep_removes_only_temp_files_of_dead_processes(tmp_path):
    root = tmp_path / "state"
    (root / "clients").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (root / f"{TEMP_PREFIX}{dead}-abcdef").write_bytes(b"half")
    (root / f"{TEMP_PREFIX}{os.getpid()}-abcdef").write_bytes(b"mine, in progress")
    (root / "clients" / f"{dead}-3-abcdef").mkdir()
    (root / "clients" / f"{dead}-3-abcdef" / "x.kv").write_bytes(b"old private state")
    (root / "keep.kv").write_bytes(b"state")
    sd = StateDir(root)
    assert len(sd.swept) == 2
    assert sorted(os.listdir(root)) == sorted([f"{TEMP_PREFIX}{os.getpid()}-abcdef", "clients", "keep.kv"])
    assert os.listdir(root / "clients") == []


def test_any_path_needs_the_opt_in_and_refuses_dotdot(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(StatePathError, match="allow-any-path"):
        StateDir(tmp_path / "s").locate(str(tmp_path / "d" / "x.kv"), None, False)
    sd = StateDir(tmp_path / "s", allow_any_path=True)
    fd, name, _ = sd.locate(str(tmp_path / "d" / "x.kv"), None, False)
    os.close(fd)
    assert name == "x.kv"
    for bad in (str(tmp_path / "d" / ".." / "x.kv"), str(tmp_path / "nodir" / "x.kv")):
        with pytest.raises(StatePathError):
            sd.locate(bad, None, False)
    assert not (tmp_path / "nodir").exists()


# ------------------------------------------------------------------ limits without a model


def test_grammar_limits_are_checked_before_compiling():
    chain = "\n".join(["root ::= r0"] + [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(4000)] + ['r4000 ::= "z"'])
    with pytest.raises(GrammarError, match="4002 rules"):
        check_limits(chain, "gbnf")
    ok = "\n".join(["root ::= r0"] + [f'r{i} ::= "x" r{i + 1}' for i in range(MAX_GRAMMAR_RULES - 2)]
                   + [f'r{MAX_GRAMMAR_RULES - 2} ::= "z"'])
    check_limits(ok, "gbnf")
    deep = "root ::= " + "(" * (MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (MAX_GRAMMAR_NESTING + 1)
    with pytest.raises(GrammarError, match="nested"):
        check_limits(deep, "gbnf")
    # the text's size is the protocol's one check (tests/test_protocol.py BAD), not here
    check_limits('root ::= "' + "a" * (128 << 10) + '"', "gbnf")
    schema: dict = {"type": "integer"}
    for _ in range(40):  # two JSON levels per schema level
        schema = {"type": "object", "properties": {"a": schema}}
    schema = "%json_schema " + json.dumps(schema)
    with pytest.raises(GrammarError, match="nested"):
        check_limits(schema, "json_schema")


def test_brackets_inside_literals_do_not_count():
    assert _bracket_depth(r'root ::= "((((" [^"\\(] ("a") # ((((', "gbnf") == 1
    assert _bracket_depth('start: /((((/ ("a" ["b"])', "lark") == 2


def test_json_depth_is_iterative_and_bounded():
    deep: list = []
    cur = deep
    for _ in range(100_000):  # far deeper than any recursion could go
        cur.append([])
        cur = cur[0]
    assert json_depth(deep, MAX_JSON_DEPTH) == MAX_JSON_DEPTH + 1
    assert json_depth({"a": [1, {"b": 2}]}, MAX_JSON_DEPTH) == 3
    line = b'{"type":"infer","seq_id":3,"prompt":' + b'{"a":' * 1000 + b"1" + b"}" * 1001
    with pytest.raises(ProtocolError) as e:
        parse_line(line)
    assert (e.value.seq_id, e.value.request) == (3, "infer")


def test_created_files_never_replace_anything(sd):
    """create_file (the names a server picks itself) refuses an existing name, a symlink
    included, and leaves what is there as it was."""
    fd = sd.namespace_dir(None)
    try:
        assert statedir.create_file(fd, "a.npy", [b"first"]) == 5
        with pytest.raises(FileExistsError):
            statedir.create_file(fd, "a.npy", [b"second"])
        os.symlink("/nonexistent-target", sd.root / "l.npy")
        with pytest.raises(FileExistsError):
            statedir.create_file(fd, "l.npy", [b"x"])
    finally:
        os.close(fd)
    assert (sd.root / "a.npy").read_bytes() == b"first"
    assert not os.path.exists("/nonexistent-target")


def test_each_server_run_has_its_own_run_id(tmp_path):
    """Two StateDirs on one directory (two servers, or two runs): different run ids, which
    the capture files' names hold."""
    ids = {StateDir(tmp_path / "state").run_id for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith(f"{os.getpid()}-") for i in ids)
