"""Which layers a conversation's KV shares (Krul Sec 4.2, Algorithm 1).

Layers whose attention is mostly on the first and last 10% of the history are
"initial-recent" (I-R): their attention hardly depends on the input, so their KV
can be shared with a similar layer. The others (share under ``gamma``) are
input-sensitive and always stored. Among the I-R layers, pairs are taken in order of
the Euclidean distance between their attention maps, a layer in at most one pair,
until ``ratio`` of all layers are shared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Strategy:
    """A conversation's compression strategy.

    ``pairs``: (i, j) with i < j; layers i and j keep one shared direction and their
    own magnitudes (``merge``). ``input_sensitive``: layers under gamma, never shared.
    """

    num_layers: int
    pairs: tuple[tuple[int, int], ...] = ()
    input_sensitive: tuple[int, ...] = ()

    def __post_init__(self):
        seen: set[int] = set()
        for i, j in self.pairs:
            if not 0 <= i < j < self.num_layers:
                raise ValueError(f"pair ({i}, {j}) is not 0 <= i < j < {self.num_layers}")
            if i in seen or j in seen:
                raise ValueError(f"layer of pair ({i}, {j}) is already in another pair")
            seen.update((i, j))
        if seen & set(self.input_sensitive):
            raise ValueError(f"input-sensitive layers {sorted(seen & set(self.input_sensitive))} "
                             "cannot be shared")

    @property
    def shared(self) -> frozenset[int]:
        return frozenset(x for p in self.pairs for x in p)

    def partner(self, layer: int) -> int | None:
        for i, j in self.pairs:
            if layer in (i, j):
                return j if layer == i else i
        return None

    def to_json(self) -> str:
        return json.dumps({"num_layers": self.num_layers, "pairs": self.pairs,
                           "input_sensitive": self.input_sensitive})

    @classmethod
    def from_json(cls, text: str) -> Strategy:
        d = json.loads(text)
        return cls(d["num_layers"], tuple(tuple(p) for p in d["pairs"]),
                   tuple(d["input_sensitive"]))


def select_pairs(ir_share: torch.Tensor, dist: torch.Tensor, *, gamma: float,
                 ratio: float) -> Strategy:
    """Algorithm 1 (lines 4-28).

    ir_share: [L] float, each layer's mean attention share on the first and last 10%
        of the history (``similarity.Similarity.ir_share``).
    dist: [L, L] float, symmetric, the distance between layers' attention maps
        (``similarity.Similarity.distances``).
    gamma: layers with ir_share < gamma are input-sensitive (line 8).
    ratio: stop once at least ratio * L layers are shared (line 27; N is all layers).
        The check runs before a pair is taken, so ratio 0 shares nothing.
    Ties in distance are broken by (i, j), so the result is deterministic.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    L = ir_share.numel()
    if dist.shape != (L, L):
        raise ValueError(f"dist must be [{L}, {L}], got {list(dist.shape)}")
    ir = [float(x) for x in ir_share.double().tolist()]
    sensitive = tuple(i for i in range(L) if ir[i] < gamma)
    eligible = [i for i in range(L) if ir[i] >= gamma]
    d = dist.double()
    ranked = sorted((float(d[i, j]), i, j) for a, i in enumerate(eligible)
                    for j in eligible[a + 1:])
    shared: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for _, i, j in ranked:
        if len(shared) >= L * ratio:
            break
        if i in shared or j in shared:
            continue
        shared.update((i, j))
        pairs.append((i, j))
    return Strategy(L, tuple(pairs), sensitive)
