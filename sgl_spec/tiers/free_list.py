"""Free indices of a fixed range: pop a prefix, push at the end; a used mask catches
double frees. Not thread-safe: its owner locks. CPU tensors."""

from __future__ import annotations

import torch


class FreeList:
    def __init__(self, n: int):
        self.size = n
        self.free = torch.arange(n, dtype=torch.int64)
        self.used = torch.zeros(n, dtype=torch.bool)
        self.parts: list[torch.Tensor] = []
        self.count = n  # free indices

    def pop(self, n: int) -> torch.Tensor | None:
        """``n`` free indices ([n] int64), now used; None (and nothing taken) when fewer
        than ``n`` are free."""
        if n > self.count:
            return None
        if n > len(self.free):
            self.free = torch.cat([self.free, *self.parts])
            self.parts = []
        out, self.free = self.free[:n], self.free[n:]
        self.used[out] = True
        self.count -= n
        return out

    def push(self, idx: torch.Tensor) -> None:
        """Return used indices; RuntimeError naming them on a double free."""
        if not idx.numel():
            return
        if not self.used[idx].all():
            raise RuntimeError(f"double free of {idx[~self.used[idx]].tolist()[:8]}")
        self.used[idx] = False
        self.parts.append(idx.clone())
        self.count += idx.numel()
