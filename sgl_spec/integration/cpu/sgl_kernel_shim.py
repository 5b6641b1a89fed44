"""Pure-torch stand-in for the two ``sgl_kernel`` CPU helpers sglang 0.5.23 calls.

Loaded under the name ``sgl_kernel`` by :mod:`.hooks` on hosts
where no real ``sgl_kernel`` is installed. It registers no ``torch.ops.sgl_kernel``
ops, so sglang's AMX detection stays False and its plain-torch CPU paths are used.
sglang imports many other names at module level on CPU (speculative-decoding tree
kernels, for instance) without calling them on this path, so any other name
resolves to a stub that raises :class:`MissingCpuKernel` (a NotImplementedError)
when called, naming the kernel.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+sgl_spec.cpu"


class MissingCpuKernel(NotImplementedError):
    pass


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [bs] int, rows of req_to_token
    req_to_token: torch.Tensor,  # [max_reqs, pool_len] int32, mutated in place
    start_offset: torch.Tensor,  # [bs] int
    end_offset: torch.Tensor,  # [bs] int
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int, new KV slot ids
    pool_len: int,
) -> None:
    """``req_to_token[row_i, start_i:end_i] = next (end_i - start_i) slots``."""
    lens = (end_offset - start_offset).to(torch.int64)
    total = int(lens.sum())
    if total == 0:
        return
    if int(end_offset.max()) > pool_len:
        raise ValueError(
            f"end_offset {int(end_offset.max())} exceeds req_to_token width {pool_len}"
        )
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    seg_start = torch.cumsum(lens, 0) - lens  # exclusive prefix sum
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        seg_start, lens
    )
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lens) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _byte_rows(ptr: int, stride: int, num_rows: int) -> torch.Tensor:
    """A [num_rows, stride] uint8 view of memory owned by someone else."""
    buf = (ctypes.c_uint8 * (stride * num_rows)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, stride)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [num_buffers] int64 raw data pointers (CPU memory)
    strides: torch.Tensor,  # [num_buffers] int64 row stride in bytes
    tgt_loc: torch.Tensor,  # [n] int row ids
    src_loc: torch.Tensor,  # [n] int row ids
) -> None:
    """For every KV buffer, copy row ``src_loc[i]`` onto row ``tgt_loc[i]``."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _byte_rows(int(ptr), int(stride), num_rows)
        rows[tgt] = rows[src]  # the gather copies src first, so overlaps are safe


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise MissingCpuKernel(
            f"sgl_kernel.{name} is not available on this CPU host: sgl_spec's CPU "
            "support provides only assign_req_to_token_pool_cpu and "
            "copy_all_layer_kv_cache_cpu"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing
