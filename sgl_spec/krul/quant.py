"""Per-token, per-head int8 rows: the codec the host tier can use where layers share
nothing (docs/design/krul.md §11: these models' layers are too unlike to merge).

Each (token, head) vector x [D] is stored as round(x / s) in int8 with s = absmax / 127
kept in bf16, so a bf16 row of H*D*2 bytes becomes H*D + 2*H bytes (0.516x at D 64).
Symmetric, no zero point: K and V rows are centred enough that the absmax scale loses
about 0.5% (relative L2) on real KV (tests). Reference: ``quantize_ref``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Int8Rows(NamedTuple):
    """q: [n, H, D] int8; scale: [n, H] bf16 (0 for an all-zero vector)."""

    q: torch.Tensor
    scale: torch.Tensor

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def quantize(x: torch.Tensor) -> Int8Rows:
    """[n, H, D] float (any dtype) -> Int8Rows."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).to(torch.bfloat16)          # [n, H]
    s = scale.float().clamp(min=1e-30)[..., None]
    q = torch.round(xf / s).clamp(-127, 127).to(torch.int8)
    return Int8Rows(q, scale)


def dequantize(r: Int8Rows, dtype: torch.dtype) -> torch.Tensor:
    """Int8Rows -> [n, H, D] in ``dtype``."""
    return (r.q.float() * r.scale.float()[..., None]).to(dtype)


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One vector at a time, float64 except the bf16 scale (as stored)."""
    n, h, _ = x.shape
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(n, h, dtype=torch.bfloat16)
    for i in range(n):
        for j in range(h):
            v = x[i, j].double()
            sc = torch.tensor(float(v.abs().max()) / 127.0).to(torch.bfloat16)
            scale[i, j] = sc
            d = max(float(sc), 1e-30)
            q[i, j] = torch.clamp(torch.round(v / d), -127, 127).to(torch.int8)
    return q, scale
