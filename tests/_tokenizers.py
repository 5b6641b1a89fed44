"""Test stand-ins for HF tokenizers."""

from __future__ import annotations

import re


class WordTokenizer:
    """Words, punctuation and whitespace runs as tokens: a deterministic stand-in."""

    _PIECE = re.compile(r"\w+|[^\w\s]|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inverse: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in self._PIECE.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.inverse)
                self.inverse.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.inverse[i] for i in ids)
