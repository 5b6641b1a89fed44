"""Vertical/slash prefill attention as a Triton kernel (MInference-style, exact mask).

One program per (query block, query head). It walks the block's key tiles (those
the selected slashes touch) and then its leftover vertical columns, both listed by
``index.build_index``, with an online softmax. Tiles are computed densely on the
tensor cores but masked to the selected cells (bitmap lookups of the offset and
the column), so, unlike MInference, rows are normalised over exactly the selected
cells: the result matches ``reference.vslash_attention_ref``. Reference path for
the tests: ``reference.py`` (dense, masked) and ``index.visit_counts`` (the index).

Importing this module imports Triton; ``sgl_spec.kernels.vslash`` does so only on
``impl="triton"``. On CPU it runs under ``TRITON_INTERPRET=1`` (tests, small sizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .index import VSlashIndex, build_index
from .lines import LineSet, check_inputs

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _online_update(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold a [BLOCK_M, BLOCK_N] score tile (-inf where dropped) into the softmax state."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept yet
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kernel(
    Q, K, V, Out,  # [n, Hq, D], [N+n, Hkv, D], [N+n, Hkv, D], [n, Hq, D]
    BlockCount, BlockOffset, ColCount, ColIndex, VertMask, SlashMask,  # see VSlashIndex
    sm_scale, n, history_len, num_keys,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_cnt_h, stride_off_h, stride_off_m, stride_col_h, stride_col_m, stride_mask_h,
    GROUP: tl.constexpr,  # query heads per KV head
    LINE_GROUP: tl.constexpr,  # query heads per line head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding), else None
):
    start_m = tl.program_id(0)
    qh = tl.program_id(1)
    kvh = qh // GROUP
    lh = qh // LINE_GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n
    d_ok = offs_d < HEAD_DIM
    pos = history_len + offs_m  # absolute query positions

    q = tl.load(
        Q + offs_m[:, None] * stride_qn + qh * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    vmask = VertMask + lh * stride_mask_h
    smask = SlashMask + lh * stride_mask_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key tiles touched by slashes: dense dot, exact mask.
    num_tiles = tl.load(BlockCount + lh * stride_cnt_h + start_m)
    tile_ptr = BlockOffset + lh * stride_off_h + start_m * stride_off_m
    for b in range(0, num_tiles):
        cols = tl.load(tile_ptr + b) + offs_n
        col_ok = cols < num_keys
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        off = pos[:, None] - cols[None, :]
        causal = (off >= 0) & col_ok[None, :] & row_ok[:, None]
        on_s = tl.load(smask + off, mask=causal, other=0)
        on_v = tl.load(vmask + cols, mask=col_ok, other=0)
        keep = causal & ((on_s != 0) | (on_v[None, :] != 0))
        qk = tl.where(keep, qk, float("-inf"))
        m_i, l_i, acc = _online_update(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # Leftover vertical columns, gathered BLOCK_N at a time.
    num_cols = tl.load(ColCount + lh * stride_cnt_h + start_m)
    col_ptr = ColIndex + lh * stride_col_h + start_m * stride_col_m
    for c0 in range(0, num_cols, BLOCK_N):
        j_ok = c0 + offs_n < num_cols
        cols = tl.load(col_ptr + c0 + offs_n, mask=j_ok, other=0)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        keep = j_ok[None, :] & (cols[None, :] <= pos[:, None]) & row_ok[:, None]
        qk = tl.where(keep, qk, float("-inf"))
        m_i, l_i, acc = _online_update(qk, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty rows -> 0
    tl.store(
        Out + offs_m[:, None] * stride_on + qh * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernel, InterpretedFunction)


def vslash_attention_triton(
    q: torch.Tensor,  # [n, Hq, D], fp32/fp16/bf16, cuda (cpu under TRITON_INTERPRET=1)
    k: torch.Tensor,  # [N+n, Hkv, D], q.dtype
    v: torch.Tensor,  # [N+n, Hkv, D], q.dtype
    lines: LineSet | None,  # H_l line heads; may be None when index is given
    history_len: int,
    scale: float | None = None,  # default 1/sqrt(D)
    *,
    index: VSlashIndex | None = None,  # from build_index; built here if None
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,  # [n, Hq, D], q.dtype, written if given
) -> torch.Tensor:  # [n, Hq, D], q.dtype
    """Launch ``_kernel`` over ``(cdiv(n, block_m), Hq)`` programs."""
    dims = check_inputs(q, k, v, lines, history_len)
    if q.dtype != k.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"q {q.dtype} and k/v {k.dtype} must share a dtype, one of {_DTYPES}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"triton impl needs CUDA tensors (got {q.device}); on CPU set "
            "TRITON_INTERPRET=1 before importing triton, or use impl='torch'"
        )
    if index is None:
        if lines is None:
            raise ValueError("pass lines or a prebuilt index")
        index = build_index(lines, dims.n, history_len, block_m, block_n)
    num_lh = index.block_count.shape[0]
    if (
        (index.n, index.history_len) != (dims.n, history_len)
        or dims.num_q_heads % num_lh
        or num_lh % dims.num_kv_heads
    ):
        raise ValueError(
            f"index built for n={index.n}, history_len={index.history_len}, {num_lh} "
            f"line heads; called with n={dims.n}, history_len={history_len}, "
            f"{dims.num_q_heads} q heads, {dims.num_kv_heads} KV heads (line heads must "
            "divide the q heads and be a multiple of the KV heads)"
        )
    line_group = dims.num_q_heads // num_lh
    bm, bn = index.block_m, index.block_n
    if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"block_m {bm} / block_n {bn} must be powers of two >= 16 (tl.dot)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last-dim stride, got strides {t.stride()}")
    idx = index.to(q.device)
    for name in ("block_offset", "column_index"):
        t = getattr(idx, name)
        if not t.is_contiguous() or t.dtype != torch.int32:
            raise ValueError(f"index.{name} must be contiguous int32, got {t.dtype}")
    scale = dims.head_dim**-0.5 if scale is None else scale
    grid = (triton.cdiv(dims.n, bm), dims.num_q_heads)
    if dims.n == 0:
        return out
    _kernel[grid](
        q, k, v, out,
        idx.block_count, idx.block_offset, idx.column_count, idx.column_index,
        idx.vert_mask, idx.slash_mask,
        float(scale), dims.n, history_len, dims.num_keys,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        idx.block_count.stride(0), idx.block_offset.stride(0), idx.block_offset.stride(1),
        idx.column_index.stride(0), idx.column_index.stride(1), idx.vert_mask.stride(0),
        GROUP=dims.group,
        LINE_GROUP=line_group,
        HEAD_DIM=dims.head_dim,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=max(16, triton.next_power_of_2(dims.head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: default
    )
    return out
