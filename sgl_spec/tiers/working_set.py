"""The upper tier of a layer-tiered KV pool: fewer device slots than the full pool, mapped
from its slots (docs/design/round-attention.md).

Layers below the split keep every token in the full pool (sglang's slots). Layers at and
above it keep only the tokens some running request attends there (its *working set*) in
``size`` upper slots; ``map[full_slot]`` is the upper slot holding that token's upper-layer
KV, or -1. The last entry of ``map`` is a sentinel for full slot -1 (padding in index
tensors), so ``translate`` passes -1 through, as sglang's SWA pools do.

Several requests can attend the same token (a round two questions of one conversation
selected, a forked prefix): ``acquire`` / ``drop`` count the holders of each upper slot and
free it when the last one drops it; ``assign`` / ``release`` are the single-owner calls they
build on.

Who owns what: this object owns the map, the holder counts and the upper free list; the KV
buffers belong to the pool. Not thread-safe: the scheduler's thread calls it (the pool's owner locks).
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
        self.refs = torch.zeros(size, dtype=torch.int32)  # holders of each upper slot (CPU)

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
        self.refs[upper] = 1
        upper = upper.to(self.map.device)
        self.map[full] = upper
        return upper

    def acquire(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One more holder of each of ``full`` ([n] int64, distinct): those not mapped get
        upper slots. Returns (upper slots [n], [n] bool: newly mapped, whose rows the
        caller fills), or None (nothing changed) when too few slots are free."""
        if full.numel() != torch.unique(full).numel():
            raise ValueError("acquire: repeated full slots")
        new = ~self.mapped(full)
        if int(new.sum()) > self.free_list.count:
            return None
        if bool(new.any()):
            self.assign(full[new])
            self.refs[self.map[full[new]].cpu()] = 0
        upper = self.map[full]
        self.refs[upper.cpu()] += 1
        return upper, new

    def drop(self, full: torch.Tensor) -> int:
        """One holder fewer of each of ``full`` (mapped; a slot listed twice is two
        holds); slots nobody holds any more are freed. Returns how many were freed."""
        upper = self.map[full]
        if bool((upper < 0).any()):
            raise ValueError(f"drop: full slots not mapped: {full[upper < 0].tolist()[:8]}")
        cpu = upper.cpu()
        self.refs.index_add_(0, cpu, torch.full_like(cpu, -1, dtype=self.refs.dtype))
        last = self.refs[cpu] <= 0
        return self.release(torch.unique(full[last.to(full.device)])) if bool(last.any()) else 0

    def rekey(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One hold on each of ``src`` moves to ``dst`` ([n] int64, pairwise; sglang freed
        ``src`` and points the request at ``dst``, which holds the same token): where
        ``dst`` has no upper slot, ``src``'s becomes ``dst``'s (no copy); where it has one
        (another holder's copy of the same token), the hold moves to it and ``src``'s is
        dropped. ValueError where a moved slot has other holders (its rows cannot serve
        two full slots)."""
        if src.numel() != dst.numel():
            raise ValueError(f"rekey: {src.numel()} source slots, {dst.numel()} targets")
        move = ~self.mapped(dst)
        if bool(move.any()):
            s, d = src[move], dst[move]
            upper = self.map[s]
            if bool((upper < 0).any()) or bool((self.refs[upper.cpu()] != 1).any()):
                raise ValueError("rekey: a moved slot is unmapped or held twice")
            self.map[d], self.map[s] = upper, -1
        if bool((~move).any()):
            self.acquire(dst[~move])
            self.drop(src[~move])

    def release(self, full: torch.Tensor) -> int:
        """Unmap those of ``full`` that are mapped and free their upper slots (finish,
        abort, retraction, a round stored to the host); returns how many were freed."""
        upper = self.map[full]
        held = upper >= 0
        if not bool(held.any()):
            return 0
        self.refs[upper[held].cpu()] = 0
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
        if live.numel() and not bool((self.refs[live] > 0).all()):
            out.append("a mapped upper slot has no holder")
        if bool((self.refs[~used] != 0).any()):
            out.append("a free upper slot has holders")
        if int(self.map[-1]) != -1:
            out.append("the sentinel is mapped")
        return out
