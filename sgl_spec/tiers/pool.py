"""A layer-tiered pool's buffers and accounting, as the attention path sees them.

``Tiers`` holds the per-layer K/V buffers of a pool whose layers from ``split`` up (local
indices) have ``upper`` slots plus one scratch row, the ``UpperSlots`` map from the full
pool's slots, and reports the device bytes of each tier (read from the buffers). The pool
(``sgl_spec.integration.tiers.tiered_pool``) owns the buffers; the round runtime
(``sgl_spec.rounds.runtime``) assigns and drops upper slots through ``slots``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .working_set import UpperSlots


class Tiers:
    def __init__(self, split: int, k_bufs: Sequence[torch.Tensor],
                 v_bufs: Sequence[torch.Tensor], full_rows: int, upper: int,
                 first_layer: int = 0):
        if not 0 < split < len(k_bufs):
            raise ValueError(f"split {split} must be inside the pool's {len(k_bufs)} layers")
        self.split, self.first_layer = split, first_layer
        self.k_bufs, self.v_bufs = k_bufs, v_bufs
        self.full_rows, self.upper = full_rows, upper
        self.slots = UpperSlots(full_rows, upper, device=k_bufs[0].device)

    @property
    def num_layers(self) -> int:
        return len(self.k_bufs)

    def is_upper(self, layer_id: int) -> bool:
        """Whether the model's layer ``layer_id`` is in the upper tier."""
        return layer_id - self.first_layer >= self.split

    def upper_bufs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.k_bufs[self.split:]), list(self.v_bufs[self.split:])

    def upper_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Rows of the upper buffers for full slots ``full``: their upper slots, the
        scratch row (the last) where unmapped."""
        up = self.slots.translate(full.long())
        return torch.where(up < 0, torch.full_like(up, self.upper), up)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of each tier's buffers (lower: every layer below the split; upper: the
        rest), read from the tensors."""
        def size(bufs):
            return sum(b.numel() * b.element_size() for b in bufs)

        s = self.split
        return {"lower": size(self.k_bufs[:s]) + size(self.v_bufs[:s]),
                "upper": size(self.k_bufs[s:]) + size(self.v_bufs[s:])}

    def token_bytes(self) -> dict[str, int]:
        """Device bytes one token takes in each tier (all its layers there)."""
        def row(bufs):
            return sum(b[0].numel() * b.element_size() for b in bufs)

        s = self.split
        return {"lower": row(self.k_bufs[:s]) + row(self.v_bufs[:s]),
                "upper": row(self.k_bufs[s:]) + row(self.v_bufs[s:])}
