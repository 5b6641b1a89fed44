"""The upper tier of a layer-tiered KV pool: fewer device slots than the full pool, mapped
from its slots (docs/design/round-attention.md).

Layers below the split keep every token in the full pool (sglang's slots). Layers at and
above it keep only the tokens some running request attends there (its *working set*) in
``size`` upper slots; ``map[full_slot]`` is the upper slot holding that token's upper-layer
KV, or -1. The last entry of ``map`` is a sentinel for full slot -1 (padding in index
tensors), so ``translate`` passes -1 through, as sglang's SWA pools do.

Who owns what: this object owns the map and the upper free list; the KV buffers belong to
the pool. Not thread-safe: the scheduler's thread calls it (the pool's owner locks).
CPU or device tensors for ``map`` (``device``); the free list stays on the CPU.
"""

from __future__ import annotations

import torch

from .free_list import FreeList


class UpperSlots:
    def __init__(self, full_size: int, size: int, device: str | torch.device = "cpu"):
        if not 0 < size <= full_size:
            raise ValueError(f"need 0 < upper size ({size}) <= full size ({full_size})")
        self.full_size, self.size = full_size, size
        self.map = torch.full((full_size + 1,), -1, dtype=torch.int64, device=device)
        self.free_list = FreeList(size)

    def available(self) -> int:
        return self.free_list.count

    def used(self) -> int:
        return self.size - self.free_list.count

    def mapped(self, full: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of ``full`` ([n] int64 slots) have an upper slot."""
        return self.map[full] >= 0

    def assign(self, full: torch.Tensor) -> torch.Tensor | None:
        """Upper slots for ``full`` ([n] int64, distinct, none mapped yet); returns them
        ([n] int64, map's device), or None (nothing assigned) when fewer are free.
        ValueError where a slot is already mapped or repeated: a slot is owned once."""
        if full.numel() != torch.unique(full).numel():
            raise ValueError("assign: repeated full slots")
        if bool(self.mapped(full).any()):
            raise ValueError(f"assign: full slots already mapped: "
                             f"{full[self.mapped(full)].tolist()[:8]}")
        upper = self.free_list.pop(full.numel())
        if upper is None:
            return None
        upper = upper.to(self.map.device)
        self.map[full] = upper
        return upper

    def release(self, full: torch.Tensor) -> int:
        """Unmap those of ``full`` that are mapped and free their upper slots (finish,
        abort, retraction, a round stored to the host); returns how many were freed."""
        upper = self.map[full]
        held = upper >= 0
        if not bool(held.any()):
            return 0
        self.free_list.push(upper[held].cpu())
        self.map[full[held]] = -1
        return int(held.sum())

    def translate(self, full: torch.Tensor) -> torch.Tensor:
        """Upper slots of ``full`` (-1 where unmapped or padding)."""
        return self.map[full]

    def check(self) -> list[str]:
        """Violations of the accounting: an upper slot mapped twice, mapped but free, or
        used but unmapped (leaked). Empty when consistent."""
        live = self.map[:-1][self.map[:-1] >= 0].cpu()
        out = []
        if live.numel() != torch.unique(live).numel():
            out.append("an upper slot is mapped from two full slots")
        used = self.free_list.used
        if live.numel() and not bool(used[live].all()):
            out.append("a mapped upper slot is on the free list")
        if int(used.sum()) != live.numel():
            out.append(f"{int(used.sum()) - live.numel()} upper slots used but unmapped")
        if int(self.map[-1]) != -1:
            out.append("the sentinel is mapped")
        return out
