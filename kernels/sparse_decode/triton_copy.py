"""SpeContext's elastic loads as one Triton kernel, from the device pool or from pinned
host memory (an offloaded layer, ``--spec-offload``).

``stage.view(-1, D)[dst] = pool.view(-1, D)[src]`` for K and V (``reference
.copy_rows_reference``). The indices are the plan's, on the GPU; an offloaded layer's
pool is a pinned host tensor (``sgl_spec.tiers.offload.to_host``), which the kernel
reads in place through unified virtual addressing (pinned memory is mapped into the
GPU's address space), so the gather needs no host sync and no host-side index copy:
each program reads its rows over the bus and writes them to the staging rows. Issued on
the prefetcher's side stream, it runs while earlier layers compute (SpeContext Sec 5,
the paper's Figure 9).

A row (one slot and KV head) is ``D`` contiguous elements; each program copies
``BLOCK_M`` rows of K and of V. On CPU the kernel runs under ``TRITON_INTERPRET=1``
(set before this module is imported; the tests do that), where both sides are CPU
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32  # rows per program


@triton.jit
def _copy_kernel(SK, SV, PK, PV, Dst, Src, M, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = rows < M
    dst = tl.load(Dst + rows, mask=in_m, other=0).to(tl.int64)
    src = tl.load(Src + rows, mask=in_m, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = in_m[:, None] & (cols < D)[None, :]
    at_src = src[:, None] * D + cols[None, :]
    at_dst = dst[:, None] * D + cols[None, :]
    tl.store(SK + at_dst, tl.load(PK + at_src, mask=mask), mask=mask)
    tl.store(SV + at_dst, tl.load(PV + at_src, mask=mask), mask=mask)


def interpreted() -> bool:
    return type(_copy_kernel).__name__ == "InterpretedFunction"


def copy_rows_triton(stage_k: torch.Tensor, stage_v: torch.Tensor, pool_k: torch.Tensor,
                     pool_v: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """The elastic loads of one layer, K and V, in one launch on the current stream.
    Staging and indices on the GPU (CPU under the interpreter); the pool there too or
    pinned in host memory. Contiguous buffers, the same dtype and row width; indices
    are not bounds-checked (the plan's, inside both buffers)."""
    d = pool_k.shape[-1]
    for name, t in (("stage_k", stage_k), ("stage_v", stage_v), ("pool_k", pool_k),
                    ("pool_v", pool_v)):
        if not t.is_contiguous() or t.shape[-1] != d or t.dtype != pool_k.dtype:
            raise ValueError(f"{name} must be contiguous with rows of {d} {pool_k.dtype} "
                             f"(got {tuple(t.shape)} {t.dtype})")
    if not interpreted():
        if stage_k.device.type != "cuda":
            raise ValueError(f"copy_rows_triton writes CUDA staging buffers (got "
                             f"{stage_k.device}); valid on CPU: copy_rows")
        if pool_k.device.type == "cpu" and not (pool_k.is_pinned() and pool_v.is_pinned()):
            raise ValueError("a host pool must be pinned for the GPU to read it "
                             "(sgl_spec.tiers.offload.to_host pins it)")
    m = int(dst.shape[0])
    if m == 0:
        return
    _copy_kernel[(triton.cdiv(m, BLOCK_M),)](
        stage_k, stage_v, pool_k, pool_v, dst, src, m, D=d, BLOCK_M=BLOCK_M,
        BLOCK_D=triton.next_power_of_2(d))
