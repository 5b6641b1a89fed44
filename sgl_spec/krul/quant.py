"""Per-token, per-head int8 / int4 rows: what the host tier's codecs store where layers
share nothing (docs/design/krul.md §11: these models' layers are too unlike to merge).

Each (token, head) vector x [D] is stored as round(x / s) with s = absmax / qmax kept in
bf16 (qmax 127 at 8 bits, 7 at 4 bits), so a bf16 row of H*D*2 bytes becomes H*D + 2*H
bytes at 8 bits (0.516x at D 64) and H*D/2 + 2*H at 4 bits (0.266x); 4-bit values are
packed two to a byte (offset by 8, even element in the low nibble). Symmetric, no zero
point: on real KV the absmax scale loses about 1% (relative L2) at 8 bits and ~10% at 4
(docs/design/krul.md §13). Reference: ``quantize_ref``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class QuantRows(NamedTuple):
    """q: [n, H, D] int8 (bits 8) or [n, H, D/2] uint8 packed nibbles (bits 4);
    scale: [n, H] bf16 (0 for an all-zero vector)."""

    q: torch.Tensor
    scale: torch.Tensor
    bits: int = 8

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


BITS = (8, 4)


def _qmax(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit rows are not supported; valid: {', '.join(map(str, BITS))}")
    return (1 << (bits - 1)) - 1


def pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], [..., D] (D even) -> uint8 [..., D/2]."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> int8 [..., D]: pack4's inverse (the reference the tests read
    codes with; ``dequantize`` unpacks straight to float)."""
    lo, hi = (p & 15).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize(x: torch.Tensor, bits: int = 8) -> QuantRows:
    """[n, H, D] float (any dtype) -> QuantRows at ``bits`` (8, or 4 packed)."""
    qmax = _qmax(bits)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).to(torch.bfloat16)           # [n, H]
    s = scale.float().clamp(min=1e-30)[..., None]
    q = torch.round(xf / s).clamp(-qmax, qmax).to(torch.int8)
    return QuantRows(pack4(q) if bits == 4 else q, scale, bits)


def dequantize(r: QuantRows, dtype: torch.dtype) -> torch.Tensor:
    """QuantRows -> [n, H, D] in ``dtype``."""
    scale = r.scale.float()[..., None]
    if r.bits != 4:
        return (r.q.float() * scale).to(dtype)
    # unpack4 in float, written in place (one pass instead of unpack4, then convert)
    p = r.q
    q = torch.empty(*p.shape[:-1], 2 * p.shape[-1], dtype=torch.float32)
    q[..., 0::2] = p & 15
    q[..., 1::2] = p >> 4
    return q.sub_(8).mul_(scale).to(dtype)


def quantize_ref(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """One vector at a time, float64 except the bf16 scale (as stored); q unpacked."""
    qmax = _qmax(bits)
    n, h, _ = x.shape
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(n, h, dtype=torch.bfloat16)
    for i in range(n):
        for j in range(h):
            v = x[i, j].double()
            sc = torch.tensor(float(v.abs().max()) / qmax).to(torch.bfloat16)
            scale[i, j] = sc
            d = max(float(sc), 1e-30)
            q[i, j] = torch.clamp(torch.round(v / d), -qmax, qmax).to(torch.int8)
    return q, scale
