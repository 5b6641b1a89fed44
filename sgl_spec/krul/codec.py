"""How Krul's host arena stores a row: one token's K and V at one layer, [H, D] each.

A registry of row codecs (``CODECS``, ``codec_class(name)``; ``--spec-krul-codec``):

* ``full``: the pool's dtype as it is, what stock's host pool holds (1.0x);
* ``int8``: per-token, per-head symmetric int8 with a bf16 scale (``krul.quant``; its
  reference is ``quant.quantize_ref``): H*D + 2*H bytes for each of K and V, 0.516x of
  bf16 at head_dim 64, about 1% relative error on real KV (docs/design/krul.md §11);
* ``k8v4``: keys as ``int8``, values at 4 bits (two to a byte) with a bf16 scale per
  token and head: 0.39x of bf16 at head_dim 64 (docs/design/krul.md §13).

Merged pairs (``krul.merge``) store their shared direction through the same codec, so
the two savings multiply. A store is a fixed set of CPU tensors; rows are int64 ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from sgl_spec.kernels.dequant import dequant_scatter

from .quant import QuantRows, dequantize, quantize


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

    def get_into(self, rows: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                 dst: torch.Tensor) -> None:
        """``k_out[dst], v_out[dst] = get(rows)``: a restore's write into the pool's slots
        (codecs with a one-pass kernel override it)."""
        k, v = self.get(rows)
        k_out[dst] = k.to(k_out.device, k_out.dtype)
        v_out[dst] = v.to(v_out.device, v_out.dtype)

    @abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """The stored tensors, each [num_rows, ...] (codes, then scales, for K then V)."""

    def raw(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """What ``rows`` hold, as stored (checksums and storage pages read these bytes)."""
        return [b[rows] for b in self.buffers()]

    def byte_views(self) -> list[np.ndarray]:
        """Each buffer as a numpy uint8 [num_rows, bytes] view (storage pages are often one
        token: numpy's indexing costs a fraction of torch's per-op overhead there)."""
        if not hasattr(self, "_np"):
            self._np = [b.view(torch.uint8).reshape(b.shape[0], -1).numpy() for b in self.buffers()]
        return self._np

    def row_bytes_of(self, rows: torch.Tensor) -> torch.Tensor:
        """What ``rows`` hold as one uint8 row each, [n, row_bytes] (each buffer in turn)."""
        idx = rows.numpy()
        return torch.from_numpy(np.concatenate([b[idx] for b in self.byte_views()], axis=1))

    def put_row_bytes(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Inverse of ``row_bytes_of``: ``data`` [n, row_bytes] into ``rows``."""
        n = len(rows)
        if tuple(data.shape) != (n, self.row_bytes):
            raise ValueError(f"{tuple(data.shape)} bytes for {n} rows of {self.row_bytes}")
        idx, src, at = rows.numpy(), data.numpy(), 0
        for b in self.byte_views():
            b[idx] = src[:, at:at + b.shape[1]]
            at += b.shape[1]


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

    def buffers(self):
        return [self.k, self.v]


class QuantStore(RowStore):
    """K and V each as per-token, per-head symmetric ints with a bf16 scale
    (``krul.quant``) at ``k_bits`` / ``v_bits`` (8, or 4 packed two to a byte)."""

    k_bits: ClassVar[int]
    v_bits: ClassVar[int]

    def __init__(self, num_rows, num_heads, head_dim, dtype):
        super().__init__(num_rows, num_heads, head_dim, dtype)
        self.k = self._codes(num_rows, num_heads, head_dim, self.k_bits)
        self.v = self._codes(num_rows, num_heads, head_dim, self.v_bits)
        self.k_scale = torch.empty(num_rows, num_heads, dtype=torch.bfloat16)
        self.v_scale = torch.empty_like(self.k_scale)

    @staticmethod
    def _codes(n, h, d, bits):
        if bits == 4:
            if d % 2:
                raise ValueError(f"4-bit rows need an even head_dim, not {d}")
            return torch.empty(n, h, d // 2, dtype=torch.uint8)
        return torch.empty(n, h, d, dtype=torch.int8)

    @classmethod
    def row_bytes_for(cls, num_heads, head_dim, dtype):
        return sum(num_heads * head_dim * b // 8 + 2 * num_heads for b in (cls.k_bits, cls.v_bits))

    def put(self, rows, k, v):
        for x, q, s, b in ((k, self.k, self.k_scale, self.k_bits), (v, self.v, self.v_scale, self.v_bits)):
            r = quantize(x, b)
            q[rows], s[rows] = r.q, r.scale

    def get(self, rows):
        return (dequantize(QuantRows(self.k[rows], self.k_scale[rows], self.k_bits), self.dtype),
                dequantize(QuantRows(self.v[rows], self.v_scale[rows], self.v_bits), self.dtype))

    def get_into(self, rows, k_out, v_out, dst):
        # One pass per row (C++ on a CPU pool) instead of get + an indexed write
        # (docs/design/krul.md §16).
        if k_out.device.type != "cpu":
            return super().get_into(rows, k_out, v_out, dst)
        rows = rows.long()
        dequant_scatter(self.k, self.k_scale, self.k_bits, rows, k_out, dst)
        dequant_scatter(self.v, self.v_scale, self.v_bits, rows, v_out, dst)

    def buffers(self):
        return [self.k, self.k_scale, self.v, self.v_scale]


class Int8Store(QuantStore):
    name, k_bits, v_bits = "int8", 8, 8


class K8V4Store(QuantStore):
    """Keys at 8 bits (they set the softmax, and their channels have outliers), values at
    4: a value's error is averaged over the attended tokens (KIVI keeps V per token too)."""

    name, k_bits, v_bits = "k8v4", 8, 4


CODECS: dict[str, type[RowStore]] = {c.name: c for c in (FullStore, Int8Store, K8V4Store)}


def codec_class(name: str) -> type[RowStore]:
    if name not in CODECS:
        raise ValueError(f"Krul row codec {name!r} is invalid; valid: {', '.join(CODECS)}")
    return CODECS[name]
