"""Sparse decode on the C++ CPU kernel (``csrc/decode_cpu.cpp``): loader and wrapper.

The kernel reads each attended K/V row straight from the paged pool (no gather, no
copy), converting bf16/fp16 rows in registers, splits long lists across threads and
merges the parts by their maxima (against torch_native's per-request SDPA:
``python -m sgl_spec.bench.decode_kernels``; docs/cpu.md). Built on first use
(``kernels.cpu_build``; ``SGLSPEC_CPU_KERNELS=0`` turns it off), instantiated for
head dims 32 / 64 / 128, 1-8 query heads per KV head, fp32 / bf16 / fp16 K/V.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from ..cpu_build import load_cpu_kernel
from .common import DecodeSubsets, Dims

SOURCE = Path(__file__).with_name("csrc") / "decode_cpu.cpp"


def load_kernel() -> ModuleType | None:
    """The compiled module, or None where it is off or cannot be built (warned once)."""
    return load_cpu_kernel("decode_cpu", SOURCE)


_supported: dict[tuple, bool] = {}


def supported(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether the kernel takes this call (CPU tensors and an instantiated shape)."""
    if q.device.type != "cpu" or q.dim() != 3 or k_buf.dim() != 3 or k_buf.shape[1] == 0:
        return False
    mod = load_kernel()
    if mod is None:
        return False
    key = (k_buf.dtype, q.shape[1], k_buf.shape[1], q.shape[2])
    hit = _supported.get(key)
    if hit is None:
        group, rem = divmod(q.shape[1], k_buf.shape[1])
        hit = _supported[key] = not rem and mod.supported(k_buf.dtype, q.shape[2], group)
    return hit


def sparse_decode_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D], rows contiguous
    v_buf: torch.Tensor,  # [num_slots, Hkv, D]
    sub: DecodeSubsets,
    dims: Dims,
    *,
    scale: float,
    out: torch.Tensor,  # [B, Hq, D], q.dtype, written
) -> torch.Tensor:  # out
    if not supported(q, k_buf) or dims.v_head_dim != dims.head_dim:
        raise ValueError(
            f"the cpu sparse-decode impl takes CPU tensors with head_dim 32/64/128, 1-8 "
            f"query heads per KV head and fp32/bf16/fp16 K/V (got {q.device}, head_dim "
            f"{dims.head_dim}, group {dims.group}, {k_buf.dtype}; built: "
            f"{load_kernel() is not None}); valid impls otherwise: torch"
        )
    qs = (q.float() * scale).contiguous()
    res = load_kernel().decode(
        qs, k_buf, v_buf, sub.req_to_token.int(), sub.rows.long().contiguous(),
        sub.seq_lens.long().contiguous(), sub.sel_idx.long().contiguous(),
        sub.sel_len.long().contiguous(), sub.recent_start.long().contiguous(), sub.sink,
    )
    out.copy_(res)
    return out
