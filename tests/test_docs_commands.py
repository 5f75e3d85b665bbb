"""Every `clickpaca ...` command the docs show parses with the CLI's own argument parser.

The commands are taken from the fenced code blocks and the table cells of docs/*.md and
README.md: `clickpaca ...`, `.venv/bin/clickpaca ...` and `python -m clickpaca ...`, also
after `&&`, `|` or `;` and behind environment assignments or `nice`. A command split over
lines with a trailing backslash is joined; heredoc bodies (NDJSON requests) are data, not
commands. Each command line goes through `clickpaca.cli.build_parser()` without running, so
a renamed or removed subcommand or flag in the code fails here until the docs follow.
`python -m clickpaca.<module> ...` must name a module that exists. No model is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from clickpaca.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

#: words that may stand before the command in one simple command: `nice -n 19 clickpaca ...`
_WRAPPERS = {"nice", "time", "exec", "-n"}
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HEREDOC = re.compile(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")
_INLINE = re.compile(r"`([^`]+)`")


def _words(line: str) -> list[str]:
    """Shell words of one command line; `&&`, `||`, `|`, `;` come out as words of their own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def commands_in(line: str) -> list[list[str]]:
    """The argv (after the program) of every clickpaca command in one shell line.

    `clickpaca.sub` from `python -m clickpaca.sub` comes back as ["-m", "clickpaca.sub", ...].
    """
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        words = _words(line)
    except ValueError:  # an unclosed quote: prose, not a command
        return []
    out, simple = [], []
    for w in words + [";"]:
        if w and set(w) <= set("&|;()<>"):
            found = _command(simple)
            if found is not None:
                out.append(found)
            simple = []
        else:
            simple.append(w)
    return out


def _command(words: list[str]) -> list[str] | None:
    i = 0
    while i < len(words) and (_ENV.match(words[i]) or words[i] in _WRAPPERS
                              or (i and words[i - 1] == "-n" and words[i].isdigit())):
        i += 1
    if i >= len(words):
        return None
    prog, rest = words[i], words[i + 1:]
    if prog == "clickpaca" or prog.endswith("/bin/clickpaca"):
        return rest
    if Path(prog).name.startswith("python") and len(rest) >= 2 and rest[0] == "-m":
        if rest[1] == "clickpaca":
            return rest[2:]
        if rest[1].startswith("clickpaca."):
            return rest
    return None


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, joined line) of every fenced code block's lines, heredoc bodies left out."""
    out: list[tuple[int, str]] = []
    fence, until, pending, start = None, None, "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence = stripped[:3]
            continue
        if stripped.startswith(fence):
            fence, until, pending = None, None, ""
            continue
        if until is not None:  # inside a heredoc body
            if stripped == until:
                until = None
            continue
        if not pending:
            start = no
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line, pending = pending + stripped, ""
        out.append((start, line))
        m = _HEREDOC.search(line)
        if m:
            until = m.group(1)
    return out


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line number, inline code) of every code span in a markdown table row."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            out += [(no, span) for span in _INLINE.findall(line)]
    return out


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every clickpaca command in the docs."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for no, line in shell_lines(text) + table_cells(text):
            for argv in commands_in(line):
                found.append((f"{path.relative_to(ROOT)}:{no}", argv))
    return found


COMMANDS = doc_commands()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def strict_parser() -> argparse.ArgumentParser:
    """The CLI's parser with abbreviations off at every level: `--prompt` for a flag renamed
    from `--prompt-tokens` to `--prompt-tokens-count` must fail, not match a prefix."""
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        todo += list(_subparsers(p).values())
    return parser


def _subcommands() -> set[str]:
    return set(_subparsers(build_parser()))


def parse_error(argv: list[str]) -> str | None:
    """None when the CLI's parser takes argv, else what it said.

    A synopsis's optional parts (`[--ctx 512]`) are parsed as given, every one of them; a
    lone subcommand (a table naming `clickpaca cvec`) must be one.
    """
    argv = [w.strip("[]") for w in argv if w.strip("[]")]
    if len(argv) == 1 and not argv[0].startswith("-"):
        return None if argv[0] in _subcommands() else f"no subcommand {argv[0]}"
    if argv[:1] == ["-m"]:
        module = argv[1]
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        return None if found else f"no module {module}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            strict_parser().parse_args(argv)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return None


def test_the_docs_show_commands():
    # the extraction itself: a doc change or a parser bug that finds nothing must not pass
    assert len(COMMANDS) >= 30, COMMANDS
    subcommands = {argv[0] for _, argv in COMMANDS if argv[:1] != ["-m"]}
    assert {"bench", "ppl", "results", "serve", "kv-retrieval"} <= subcommands


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_parses(where, argv):
    assert parse_error(argv) is None, f"{where}: clickpaca {shlex.join(argv)}: {parse_error(argv)}"


def test_extraction_of_shell_lines():
    text = "\n".join([
        "prose `clickpaca nope --x` is not a code block",
        "```sh",
        "make peer && .venv/bin/clickpaca bench peer --repeats 5   # a comment",
        "CLICKPACA_BUILDS=b nice -n 19 clickpaca ppl --cache f16 \\",
        "    --ctx 512",
        "clickpaca serve <<'EOF' | jq .",
        '{"type":"init"}',
        "clickpaca not-a-command",
        "EOF",
        "echo '{\"type\":\"init\"}' | python -m clickpaca serve",
        "$ python -m clickpaca.measure.kvsim --chunks 2",
        "```",
        "| a | `make x && clickpaca results list` |",
    ])
    found = [argv for _, line in shell_lines(text) + table_cells(text) for argv in commands_in(line)]
    assert found == [
        ["bench", "peer", "--repeats", "5"],
        ["ppl", "--cache", "f16", "--ctx", "512"],
        ["serve"],
        ["serve"],
        ["-m", "clickpaca.measure.kvsim", "--chunks", "2"],
        ["results", "list"],
    ]


def test_a_renamed_flag_fails():
    assert parse_error(["bench", "batch", "--seqs", "8"]) is None
    assert "--sequences" in parse_error(["bench", "batch", "--sequences", "8"])
    assert parse_error(["bench", "nosuchbench"]) is not None
    assert parse_error(["bench", "batch", "--prompt", "32"]) is not None  # no prefix matching
    assert parse_error(["ppl", "--cache", "f16", "[--ctx", "512]", "[--native]"]) is None
    assert parse_error(["ppl", "[--kontext", "512]"]) is not None
    assert parse_error(["cvec"]) is None and parse_error(["cvecs"]) == "no subcommand cvecs"
    assert parse_error(["-m", "clickpaca.no_such_module"]) == "no module clickpaca.no_such_module"
