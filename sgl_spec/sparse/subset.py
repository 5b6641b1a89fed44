"""What one request attends to in one layer, and batching those for the kernels.

A ``Subset`` follows the contract of ``sgl_spec.kernels.sparse_decode.common``: the
selection is unique and lies between the sink and ``recent_start``; the recent window
``[recent_start, seq_len)`` always holds the current token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Subset(NamedTuple):
    sel_idx: torch.Tensor  # [Hkv, n] int64 positions, ascending, unique; n <= budget
    recent_start: int  # first position of the recent window; 0 and n == 0: dense

    @property
    def dense(self) -> bool:
        return self.recent_start == 0 and self.sel_idx.shape[1] == 0


def dense_subset(num_kv_heads: int, device: torch.device | str = "cpu") -> Subset:
    return Subset(torch.empty(num_kv_heads, 0, dtype=torch.int64, device=device), 0)


class PackedSubsets(NamedTuple):
    sel_idx: torch.Tensor  # [B, Hkv, max_sel] int64, padding -1
    sel_len: torch.Tensor  # [B, Hkv] int64
    recent_start: torch.Tensor  # [B] int64


def pack_subsets(
    subsets: Sequence[Subset], num_kv_heads: int, device: torch.device | str
) -> PackedSubsets:
    """One layer's per-request subsets as the kernels' batched arguments (new tensors)."""
    bsz = len(subsets)
    max_sel = max((s.sel_idx.shape[1] for s in subsets), default=0)
    sel_idx = torch.full((bsz, num_kv_heads, max_sel), -1, dtype=torch.int64, device=device)
    sel_len = torch.zeros(bsz, num_kv_heads, dtype=torch.int64, device=device)
    for b, s in enumerate(subsets):
        if s.sel_idx.shape[0] != num_kv_heads:
            raise ValueError(
                f"subset {b} has {s.sel_idx.shape[0]} KV heads, expected {num_kv_heads}"
            )
        n = s.sel_idx.shape[1]
        sel_idx[b, :, :n] = s.sel_idx
        sel_len[b] = n
    recent = torch.tensor([s.recent_start for s in subsets], dtype=torch.int64, device=device)
    return PackedSubsets(sel_idx, sel_len, recent)
