"""What a measuring command checks before any work, and what marks its run failed after.

Before: the arguments that can be checked without measuring (the cache types against the
build that computes them, the model, llama.cpp's tools, the text, the schema corpus, the
commit of --against, a center file, the names of chains and loads, --score-last,
--noise-of without --noise). A failure
is one `Refused` line naming the argument and what to do; the command exits 2 and records
nothing. A command declares what it needs as names of CHECKS (a bench in its row of
bench/benches.py, ppl and kv-retrieval in their NEEDS); `NAME if OPTION` runs that check
only when the option is given.

After: `failures` reads a result for what went wrong while measuring (a type a server
refused, a problem a side reported); the run is then recorded with what was measured and
marked failed. `measured` is the one way a measuring command runs: checks, then the work
inside a recording, each outcome in one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from ..base.paths import make_target
from ..llama import cachetypes, kvcenter
from ..llama.native import build_dir
from ..results import recording

__all__ = ["Refused", "Failed", "CHECKS", "check", "failures", "measured", "noise_of"]


class Refused(ValueError):
    """An argument refused before any work; the message is the one line to print."""


def _build_present(build: str, why: str) -> None:
    if not (build_dir(build) / "build-info.json").exists():
        raise Refused(f"{why} needs build {build!r}, which is not built here: run `make {make_target(build)}`")


def _cache(args: Any, centered: bool = False) -> None:
    """Every type of --cache (and --noise-of) is a row, in the build asked for (or, without
    --build, in one build per pair), and that build is here."""
    asked = getattr(args, "build", None) or cachetypes.MAINLINE
    specs = [s for s in str(getattr(args, "cache", None) or "").split(",") if s.strip()]
    noise_of = getattr(args, "noise_of", None)
    fields = [("--cache", s) for s in specs] + ([("--noise-of", noise_of)] if noise_of else [])
    for option, spec in fields:
        try:
            c = False
            if centered:
                k, v, c = kvcenter.parse_pair(spec, option)
            else:
                k, v = cachetypes.parse_pair(spec)
                cachetypes.get(k, f"{option} {spec!r}: K"), cachetypes.get(v, f"{option} {spec!r}: V")
            if c and not getattr(args, "center", None):
                raise Refused(f"{option} {spec!r}: a centered pair (K+c/V) needs --center FILE "
                              "(`clickpaca kv-center` writes one)")
            build = kvcenter.build_for_centered(k, v) if c else cachetypes.build_for(k, v)
        except ValueError as e:
            raise Refused(str(e)) from None
        if asked != cachetypes.MAINLINE:
            if build not in (cachetypes.MAINLINE, asked):
                raise Refused(f"{option} {spec!r}: a type of build {build!r}, not of --build {asked}")
            build = asked
        _build_present(build, f"{option} {spec}")


def _model(args: Any) -> None:
    from ..llama.models import NAMED_MODELS, resolve_model

    model = getattr(args, "model", None)
    try:
        resolve_model(model)
    except (ValueError, OSError) as e:  # ModelError is a ValueError
        names = f" (or a registry name: {', '.join(sorted(NAMED_MODELS))})" if model else ""
        raise Refused(f"--model: {e}{names}") from None


def _tool(name: str) -> Callable[[Any], None]:
    def check_tool(args: Any) -> None:
        from .bench.tools import ToolError, tool_path

        build = getattr(args, "build", None) or cachetypes.MAINLINE
        _build_present(build, name)
        try:
            tool_path(name, build)
        except ToolError as e:
            raise Refused(str(e)) from None
    return check_tool


def _llama_server(args: Any) -> None:
    from .bench.llama_server import PeerError, server_binary

    try:
        server_binary(getattr(args, "build", None) or cachetypes.MAINLINE)
    except (PeerError, OSError, ValueError) as e:
        raise Refused(f"llama-server: {e}") from None


def _text(args: Any) -> None:
    from .texts import TextError, default_text_path

    path = getattr(args, "text", None)
    if path:
        if not Path(path).is_file():
            raise Refused(f"--text {path}: no such file")
        return
    try:
        default_text_path()
    except TextError as e:
        raise Refused(f"the default text: {e}") from None


def _corpus(args: Any) -> None:
    from .schemas import PACKAGES, check_spec

    spec = getattr(args, "corpus", None)
    if not spec:
        raise Refused("needs a corpus: a directory of JSON schema files or a package "
                      f"({', '.join(sorted(set(PACKAGES.values())))})")
    try:
        check_spec(spec)
    except FileNotFoundError as e:
        raise Refused(f"corpus {spec!r}: not a directory, and {e}") from None


def _against(args: Any) -> None:
    from .bench.against import ROOT

    rev = getattr(args, "against", None)
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Refused(f"--against {rev}: not a commit of this checkout ({ROOT})")


def _center(args: Any) -> None:
    center = getattr(args, "center", None)
    try:
        kvcenter.read(center)
    except (ValueError, OSError) as e:  # CenterError is a ValueError
        raise Refused(f"--center {center}: {e}") from None


def _chain(args: Any) -> None:
    from .bench.batch import chain_params

    for name in str(args.chain).split(","):
        try:
            chain_params(name.strip(), {})
        except ValueError as e:
            raise Refused(str(e)) from None


def _loads(args: Any) -> None:
    from .bench.peer_loads import loads

    known = [x.name for x in loads()]
    unknown = [w.strip() for w in str(args.loads).split(",") if w.strip() and w.strip() not in known]
    if unknown:
        raise Refused(f"--loads: unknown {', '.join(unknown)}; known: {', '.join(known)}")


def _score_last(args: Any) -> None:
    from ..wire.scoring import check_score_last

    try:
        check_score_last(args.score_last, args.ctx, "--score-last")
    except ValueError as e:
        raise Refused(str(e)) from None
    if getattr(args, "native", False):
        raise Refused("--score-last: llama-perplexity (--native) cannot score a window's tail only; "
                      "leave out one of the two")


def noise_of(args: Any) -> None:
    """--noise-of names whose noise floor --noise measures: alone it asks for nothing."""
    if getattr(args, "noise_of", None) and not getattr(args, "noise", False):
        raise Refused("--noise-of: needs --noise (it says whose noise floor to measure)")


#: name -> check of the parsed arguments (raises Refused).
CHECKS: dict[str, Callable[[Any], None]] = {
    "model": _model,
    "cache": _cache,
    "cache+c": lambda args: _cache(args, centered=True),
    "text": _text,
    "corpus": _corpus,
    "against": _against,
    "center": _center,
    "chain": _chain,
    "loads": _loads,
    "score_last": _score_last,
    "noise_of": noise_of,
    "llama-server": _llama_server,
    **{tool: _tool(tool) for tool in ("llama-bench", "llama-batched-bench", "llama-perplexity")},
}


def check(args: Any, needs: tuple[str, ...]) -> None:
    """Run the checks `needs` names (`NAME if OPTION`: only when args.OPTION is set)."""
    for need in needs:
        name, _, option = need.partition(" if ")
        if option and not getattr(args, option, None):
            continue
        CHECKS[name](args)


def failures(out: Any) -> list[str]:
    """What went wrong while measuring, as a result says it: its problems, its sides'
    problems, and its rows' errors (one line each)."""
    if not isinstance(out, dict):
        return []
    found = []
    for key in ("problems", "server_problems"):
        for p in out.get(key) or ():
            found.append(str(p.get("message", p)) if isinstance(p, dict) else str(p))
    for row in out.get("rows") or ():
        if isinstance(row, dict):
            for key, value in row.items():
                if (key == "error" or key.startswith("error_") or key.endswith("_error")
                        or (key == "errors" and value)):
                    label = next((row[k] for k in ("cache", "load", "name", "seqs") if row.get(k) is not None), None)
                    found.append(f"{label}: {value}" if label is not None else str(value))
    return found


#: Errors a command reports in one line (a native tool, llama-server, a server, a file);
#: anything else is a defect and keeps its traceback.
REPORTED = (RuntimeError, ValueError, OSError)


class Failed(RuntimeError):
    """Something failed while measuring; what was measured is recorded with the run."""


def measured(command: str, args: Any, needs: tuple[str, ...], work: Callable[[Any], Any]) -> int:
    """Check `needs` (nothing recorded when one is refused: exit 2), then run `work` inside
    a recording of `command`: a result with failures, or an error during the work, is
    recorded as failed (with what was emitted) and exits 1, in one line."""
    try:
        check(args, needs)
    except Refused as e:
        print(f"clickpaca {command}: {e}", file=sys.stderr)
        return 2
    try:
        with recording(command, args):
            found = failures(work(args))
            if found:
                more = f" (and {len(found) - 1} more: see the run)" if len(found) > 1 else ""
                raise Failed(found[0] + more)
    except REPORTED as e:
        print(f"clickpaca {command}: failed: {e}", file=sys.stderr)
        return 1
    return 0
