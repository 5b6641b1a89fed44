"""How Krul's host arena stores a row: one token's K and V at one layer, [H, D] each.

A registry of row codecs (``CODECS``, ``codec_class(name)``; ``--spec-krul-codec``):

* ``full``: the pool's dtype as it is, what stock's host pool holds (1.0x);
* ``int8``: per-token, per-head symmetric int8 with a bf16 scale (``krul.quant``; its
  reference is ``quant.quantize_ref``): H*D + 2*H bytes for each of K and V, 0.516x of
  bf16 at head_dim 64, about 1% relative error on real KV (docs/design/krul.md §11).

Merged pairs (``krul.merge``) store their shared direction through the same codec, so
the two savings multiply. A store is a fixed set of CPU tensors; rows are int64 ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .quant import Int8Rows, dequantize, quantize


class RowStore(ABC):
    """``num_rows`` rows of K and V; ``put`` encodes, ``get`` decodes to ``dtype``."""

    name: ClassVar[str]

    def __init__(self, num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype):
        self.H, self.D, self.dtype = num_heads, head_dim, dtype

    @classmethod
    @abstractmethod
    def row_bytes_for(cls, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one row's K and V."""

    @property
    def row_bytes(self) -> int:
        return self.row_bytes_for(self.H, self.D, self.dtype)

    @abstractmethod
    def put(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, H, D] (any float dtype) in ``rows`` [n]."""

    @abstractmethod
    def get(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``rows`` as [n, H, D] in ``dtype``."""

    @abstractmethod
    def raw(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """What ``rows`` hold, as stored (checksums read these bytes)."""


class FullStore(RowStore):
    name = "full"

    def __init__(self, num_rows, num_heads, head_dim, dtype):
        super().__init__(num_rows, num_heads, head_dim, dtype)
        self.k = torch.empty(num_rows, num_heads, head_dim, dtype=dtype)
        self.v = torch.empty_like(self.k)

    @classmethod
    def row_bytes_for(cls, num_heads, head_dim, dtype):
        return 2 * num_heads * head_dim * dtype.itemsize

    def put(self, rows, k, v):
        self.k[rows] = k.to(self.dtype)
        self.v[rows] = v.to(self.dtype)

    def get(self, rows):
        return self.k[rows], self.v[rows]

    def raw(self, rows):
        return [self.k[rows], self.v[rows]]


class Int8Store(RowStore):
    name = "int8"

    def __init__(self, num_rows, num_heads, head_dim, dtype):
        super().__init__(num_rows, num_heads, head_dim, dtype)
        self.k = torch.empty(num_rows, num_heads, head_dim, dtype=torch.int8)
        self.v = torch.empty_like(self.k)
        self.k_scale = torch.empty(num_rows, num_heads, dtype=torch.bfloat16)
        self.v_scale = torch.empty_like(self.k_scale)

    @classmethod
    def row_bytes_for(cls, num_heads, head_dim, dtype):
        return 2 * (num_heads * head_dim + 2 * num_heads)

    def put(self, rows, k, v):
        for x, q, s in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            r = quantize(x)
            q[rows], s[rows] = r.q, r.scale

    def get(self, rows):
        return (dequantize(Int8Rows(self.k[rows], self.k_scale[rows]), self.dtype),
                dequantize(Int8Rows(self.v[rows], self.v_scale[rows]), self.dtype))

    def raw(self, rows):
        return [self.k[rows], self.k_scale[rows], self.v[rows], self.v_scale[rows]]


CODECS: dict[str, type[RowStore]] = {c.name: c for c in (FullStore, Int8Store)}


def codec_class(name: str) -> type[RowStore]:
    if name not in CODECS:
        raise ValueError(f"Krul row codec {name!r} is invalid; valid: {', '.join(CODECS)}")
    return CODECS[name]
