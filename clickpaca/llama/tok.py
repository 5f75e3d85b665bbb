"""`clickpaca tok`: the token helper (ids of strings, pieces of ids, vocabulary search)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson


def _split_model(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is the model when it names an existing .gguf file."""
    if items and items[0].endswith(".gguf") and Path(items[0]).is_file():
        return items[0], items[1:]
    return None, items


def run_tok(args: argparse.Namespace) -> int:
    from .core import Model, ModelError
    from .models import resolve_model

    model_arg, items = _split_model(list(args.items))
    try:
        model = Model(resolve_model(model_arg), n_gpu_layers=0, build=args.build)
    except ModelError as e:
        print(f"clickpaca tok: {e}", file=sys.stderr)
        return 1
    out = sys.stdout
    if args.search is not None:
        needle = args.search
        hits = []
        for t in range(model.n_vocab):
            piece = model.token_to_piece(t, special=True).decode("utf-8", "replace")
            if needle in piece:
                hits.append({"id": t, "piece": piece})
        _write_pieces(out, hits, args.json)
        return 0
    if args.id:
        try:
            ids = [int(x) for x in args.id]
        except ValueError as e:
            print(f"clickpaca tok: --id takes integers: {e}", file=sys.stderr)
            return 1
        rows = []
        for t in ids:
            if not 0 <= t < model.n_vocab:
                print(f"clickpaca tok: id {t} outside the vocabulary [0, {model.n_vocab})", file=sys.stderr)
                return 1
            rows.append({"id": t, "piece": model.token_to_piece(t, special=True).decode("utf-8", "replace")})
        _write_pieces(out, rows, args.json)
        return 0
    result = []
    for s in items:
        ids = [int(t) for t in model.tokenize(s, add_special=not args.no_bos, parse_special=True)]
        result.append({"text": s, "ids": ids})
    if args.json:
        out.write(orjson.dumps(result).decode() + "\n")
    else:
        for r in result:
            out.write(" ".join(map(str, r["ids"])) + "\n")
    return 0


def _write_pieces(out, rows: list[dict], as_json: bool) -> None:
    """{"id", "piece"} rows as one JSON line, or one `id<TAB>repr(piece)` line each."""
    if as_json:
        out.write(orjson.dumps(rows).decode() + "\n")
    else:
        for r in rows:
            out.write(f"{r['id']}\t{r['piece']!r}\n")
