"""``exact``: never sparse; every decode step attends the whole history."""

from __future__ import annotations

import torch

from .policy import SelectionPolicy
from .subset import Subset, dense_subset


class ExactPolicy(SelectionPolicy):
    name = "exact"

    def attends_layers(self, rid: str) -> bool:
        return False

    def decode_layer(
        self, rid: str, layer: int, q: torch.Tensor, k: torch.Tensor | None = None
    ) -> Subset:
        self.states.get(rid)  # unknown rids are errors here too
        return dense_subset(self.shape.num_kv_heads, q.device)
