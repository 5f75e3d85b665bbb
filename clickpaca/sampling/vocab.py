"""The model's vocabulary as sampler steps see it: token bytes and tokenization.

Only steps that work on token text need it (DRY's sequence breakers, which are strings
matched against token pieces). Built lazily, once per model: reading 262,144 pieces
through the bindings takes about a second, so nothing pays it unless such a step runs.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Vocab"]


class Vocab:
    """Token pieces (bytes, special tokens as their text) and tokenization (no BOS, no
    special-token parsing), plus a memo for what steps derive from them."""

    def __init__(self, model: Any):
        self._model = model
        self._pieces: list[bytes] | None = None
        self._memo: dict = {}

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    def pieces(self) -> list[bytes]:
        if self._pieces is None:
            piece = self._model.token_to_piece
            self._pieces = [piece(t, special=True) for t in range(self._model.n_vocab)]
        return self._pieces

    def tokenize(self, data: bytes) -> list[int]:
        return self._model.tokenize(data, add_special=False, parse_special=False).tolist()

    def peek(self, key: Any) -> Any:
        """memo's value for key, None when it was never made (nothing is made)."""
        return self._memo.get(key)

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """make() once per key (e.g. a step's processed parameters)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]
