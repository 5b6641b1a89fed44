"""Torch reference of ``dequant_scatter``: unpack, scale, convert, then an indexed write."""

from __future__ import annotations

import torch


def dequant_scatter_reference(codes: torch.Tensor, scale: torch.Tensor, bits: int,
                              rows: torch.Tensor, out: torch.Tensor, dst: torch.Tensor) -> None:
    c = codes[rows]
    if bits == 4:  # pack4's layout: offset by 8, even element in the low nibble
        lo, hi = (c & 15).to(torch.int16) - 8, (c >> 4).to(torch.int16) - 8
        c = torch.stack([lo, hi], dim=-1).flatten(-2)
    out[dst] = (c.float() * scale[rows].float()[..., None]).to(out.dtype)
