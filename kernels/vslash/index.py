"""Host-side index for the vertical/slash Triton kernel (MInference-style layout).

Per line head and query block ``m`` (rows ``m*block_m ..``, positions ``p0..p1``):

* key tiles: every ``block_n``-aligned tile of keys that some selected slash
  touches for these rows (slash ``d`` needs keys ``[p0-d, p1-d]``). The kernel
  computes a tile densely but keeps only cells that are causal and lie on a
  selected slash or vertical (bitmap lookups), so normalisation stays exact;
* columns: selected verticals at or before ``p1`` that are *not* inside one of
  those tiles (a vertical inside a tile is already kept by the tile's mask), so
  every selected cell is visited exactly once.

Built once per (layer, extend) with a few vectorised torch ops on the CPU, reused
by every query head of the line head (``plan`` before ``run``, as flashinfer does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .lines import LineSet, check_lines, line_bitmaps


class VSlashIndex(NamedTuple):
    block_count: torch.Tensor  # [H_l, M] int32: key tiles per query block
    block_offset: torch.Tensor  # [H_l, M, max_tiles] int32: tile start keys (padding 0)
    column_count: torch.Tensor  # [H_l, M] int32: extra vertical columns per query block
    column_index: torch.Tensor  # [H_l, M, max_cols] int32: their key positions (padding 0)
    vert_mask: torch.Tensor  # [H_l, N+n] int8: 1 where the column is a selected vertical
    slash_mask: torch.Tensor  # [H_l, N+n] int8: 1 where the offset is a selected slash
    n: int
    history_len: int
    block_m: int
    block_n: int

    def to(self, device: torch.device | str) -> VSlashIndex:
        return self._replace(**{f: getattr(self, f).to(device) for f in self._fields[:6]})


def _pack(rows: torch.Tensor, values: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged (row, value) pairs, sorted by row, into ``(count [M], padded [M, W])``."""
    count = torch.bincount(rows, minlength=num_rows)
    width = max(1, int(count.max()) if count.numel() else 1)
    start = torch.cumsum(count, 0) - count  # [M]
    slot = torch.arange(rows.numel()) - start[rows]
    padded = torch.zeros(num_rows, width, dtype=torch.int32)
    padded[rows, slot] = values.to(torch.int32)
    return count.to(torch.int32), padded


def build_index(
    lines: LineSet, n: int, history_len: int, block_m: int = 64, block_n: int = 64
) -> VSlashIndex:  # CPU tensors; .to(device) before launching
    """Per query block: key tiles for the slashes, leftover columns for the verticals."""
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m ({block_m}) and block_n ({block_n}) must be >= 1")
    num_keys = history_len + n
    check_lines(lines, num_keys)
    num_m = -(-n // block_m)
    num_t = -(-num_keys // block_n)
    p0 = history_len + torch.arange(num_m) * block_m  # [M] first query position
    p1 = torch.clamp(p0 + block_m - 1, max=num_keys - 1)  # [M] last query position
    per_head = []
    for vert, sl in zip(lines.vertical, lines.slash):
        # Tiles touched by slash d in block m: keys [max(p0-d, 0), p1-d] when p1 >= d.
        lo = (p0[:, None] - sl[None, :]).clamp(min=0)  # [M, n_s]
        hi = p1[:, None] - sl[None, :]
        hit = (hi >= 0).long()
        diff = torch.zeros(num_m, num_t + 1, dtype=torch.long)
        diff.scatter_add_(1, lo // block_n, hit)
        diff.scatter_add_(1, hi.clamp(min=0) // block_n + 1, -hit)
        tiles = diff.cumsum(1)[:, :num_t] > 0  # [M, T]
        t_rows, t_ids = tiles.nonzero(as_tuple=True)
        b_count, b_offset = _pack(t_rows, t_ids * block_n, num_m)
        # Verticals not inside a marked tile, causal for the block's last query.
        keep = (vert[None, :] <= p1[:, None]) & ~tiles[:, vert // block_n]  # [M, n_v]
        c_rows, c_j = keep.nonzero(as_tuple=True)
        c_count, c_index = _pack(c_rows, vert[c_j], num_m)
        per_head.append((b_count, b_offset, c_count, c_index))

    def stack(i: int) -> torch.Tensor:
        parts = [h[i] for h in per_head]
        width = max(p.shape[-1] for p in parts)
        return torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts])

    is_v, is_s = line_bitmaps(lines, num_keys)
    return VSlashIndex(
        block_count=torch.stack([h[0] for h in per_head]),
        block_offset=stack(1),
        column_count=torch.stack([h[2] for h in per_head]),
        column_index=stack(3),
        vert_mask=is_v.to(torch.int8),
        slash_mask=is_s.to(torch.int8),
        n=n,
        history_len=history_len,
        block_m=block_m,
        block_n=block_n,
    )


def visit_counts(index: VSlashIndex) -> torch.Tensor:  # [H_l, n, N+n] int32
    """How often the kernel's traversal keeps each cell: the index's torch reference.

    Replays the kernel's masks (tile cells: causal and on a selected slash or
    vertical; column cells: causal). Correct indexes give exactly the line mask,
    each cell once. Dense ``[n, N+n]`` per head: for tests at small sizes.
    """
    idx = index.to("cpu")
    n, num_keys, bm, bn = index.n, index.history_len + index.n, index.block_m, index.block_n
    hl, num_m = idx.block_count.shape
    counts = torch.zeros(hl, n, num_keys, dtype=torch.int32)
    for h in range(hl):
        for m in range(num_m):
            r0, r1 = m * bm, min(n, (m + 1) * bm)
            pos = torch.arange(index.history_len + r0, index.history_len + r1)[:, None]
            for start in idx.block_offset[h, m, : int(idx.block_count[h, m])].tolist():
                cols = torch.arange(start, min(start + bn, num_keys))[None, :]
                off = pos - cols
                on_s = idx.slash_mask[h][off.clamp(min=0)] != 0
                on_v = idx.vert_mask[h][cols] != 0
                counts[h, r0:r1, start : start + bn] += ((off >= 0) & (on_s | on_v)).int()
            cols = idx.column_index[h, m, : int(idx.column_count[h, m])].long()
            counts[h, r0:r1].index_add_(1, cols, (cols[None, :] <= pos).int())
    return counts
