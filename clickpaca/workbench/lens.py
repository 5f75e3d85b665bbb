"""`wb.lens`: the logit lens of one generation as a tidy table, and its picture.

The rows come from the token events' `lens` (docs/PROTOCOL.md): one per generated token,
layer and rank, with the token text and its log-probability. The picture is the classic
logit-lens grid, layers by generated tokens, each cell the layer's top token, coloured by
its log-probability (matplotlib, the optional `plot` extra), drawn by the call that
collected the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LensTable:
    """The tidy rows (`records`: token, position, generated, layer, rank, token_id,
    token_text, logprob, entropy) and the generation they came from."""

    records: list[dict[str, Any]]
    pieces: list[str]  # the generated tokens' text, in order
    layers: list[int]
    figure: Any = None  # the matplotlib Figure when drawn

    def to_records(self) -> list[dict[str, Any]]:
        return list(self.records)

    def to_pandas(self):
        """A pandas DataFrame of the records (pandas is the optional `pandas` extra)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("to_pandas needs pandas: pip install 'clickpaca[pandas]'") from e
        return pd.DataFrame.from_records(self.records)

    def grid(self) -> list[list[dict[str, Any]]]:
        """[layer][token] -> that cell's rank-0 record (the picture's cells)."""
        at = {(r["layer"], r["token"]): r for r in self.records if r["rank"] == 0}
        return [[at[(L, t)] for t in range(len(self.pieces))] for L in self.layers]


def table(token_events: list[dict]) -> LensTable:
    """The LensTable of an infer's token events (each with its `lens`)."""
    records, pieces, layers = [], [], []
    for i, ev in enumerate(token_events):
        lens = ev.get("lens")
        if lens is None:
            continue
        pieces.append(ev["piece"])
        layers = lens["layers"]
        for L, top, ent in zip(lens["layers"], lens["top"], lens["entropy"]):
            for rank, x in enumerate(top):
                records.append({"token": i, "generated": ev["piece"], "layer": L, "rank": rank,
                                "token_id": x["token"], "token_text": x["piece"], "logprob": x["logprob"],
                                "entropy": ent})
    return LensTable(records, pieces, list(layers))


def draw(t: LensTable, path: str | None = None) -> Any:
    """The picture: layers (rows, the last at the top) by generated tokens (columns), each
    cell its top token's text over its log-probability's colour. Saved to ``path`` when given."""
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the lens picture needs matplotlib: pip install 'clickpaca[plot]' "
                          "(or plot=False)") from e
    g = t.grid()
    nl, nt = len(t.layers), len(t.pieces)
    lp = [[c["logprob"] for c in row] for row in g]
    fig, ax = plt.subplots(figsize=(1.1 * nt + 2, 0.35 * nl + 1.5))
    im = ax.imshow(lp, aspect="auto", origin="lower", cmap="viridis", vmin=min(min(r) for r in lp), vmax=0)
    for i, row in enumerate(g):
        for j, c in enumerate(row):
            ax.text(j, i, _label(c["token_text"]), ha="center", va="center", fontsize=7, color="w")
    ax.set_yticks(range(nl), [str(L) for L in t.layers])
    ax.set_xticks(range(nt), [_label(p) for p in t.pieces], rotation=45, ha="right")
    ax.set_ylabel("layer")
    ax.set_xlabel("generated token")
    fig.colorbar(im, ax=ax, label="top token's log-probability")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


def _label(text: str) -> str:
    """A token's text for a cell: escapes shown, at most 8 characters, `$` kept literal
    (matplotlib would read a pair of them as math)."""
    return repr(text)[1:-1][:8].replace("$", r"\$")
