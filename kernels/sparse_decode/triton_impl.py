"""Sparse decode as a Triton kernel.

One program per (request, KV head). It reads that pair's subset as one virtual list
``sink | selection | recent window`` in blocks of ``BLOCK_N`` positions, maps each
position to its pool slot through ``req_to_token``, loads each K/V row once for all
``GROUP`` query heads of the KV head (GQA), and keeps an online softmax in fp32.

The scores are a broadcast multiply-and-sum, not ``tl.dot``: decode has ``GROUP``
(1..8) query rows, below ``tl.dot``'s 16-row minimum, and is memory-bound anyway.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set before this module is
imported); the tests do that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DecodeSubsets, Dims


@triton.jit
def _kernel(
    Q,  # [B, Hq, D]
    K,  # [num_slots, Hkv, D]
    V,  # [num_slots, Hkv, Dv]
    Out,  # [B, Hq, Dv]
    ReqToToken,  # [max_reqs, max_context]
    ReqPoolIdx,  # [B]
    SeqLens,  # [B]
    SelIdx,  # [B, Hkv, max_sel]
    SelLen,  # [B, Hkv]
    RecentStart,  # [B]
    sink,
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_r2t,
    stride_sib,
    stride_sih,
    stride_slb,
    stride_slh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)

    seq_len = tl.load(SeqLens + b).to(tl.int64)
    sink_end = tl.minimum(seq_len, sink)
    recent = tl.maximum(tl.load(RecentStart + b).to(tl.int64), sink_end)
    n_sel = tl.load(SelLen + b * stride_slb + h * stride_slh).to(tl.int64)
    sel_end = sink_end + n_sel
    n_total = sel_end + (seq_len - recent)

    row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t
    sel_row = SelIdx + b * stride_sib + h * stride_sih

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < V_DIM

    heads = h * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    q = q * scale

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)

    for start in range(0, n_total, BLOCK_N):
        j = start + offs_n  # [BLOCK_N] index into the virtual list
        valid = j < n_total
        in_sink = j < sink_end
        in_sel = (j >= sink_end) & (j < sel_end)
        sel_pos = tl.load(
            sel_row + tl.where(in_sel, j - sink_end, 0), mask=in_sel, other=0
        ).to(tl.int64)
        pos = tl.where(in_sink, j, tl.where(in_sel, sel_pos, recent + (j - sel_end)))
        pos = tl.where(valid, pos, 0)
        slot = tl.load(row + pos, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]

        k = tl.load(
            K + slot[:, None] * stride_kn + h * stride_kh + offs_d[None, :],
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))

        # Every block holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(
            V + slot[:, None] * stride_vn + h * stride_vh + offs_dv[None, :],
            mask=valid[:, None] & mask_dv[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
        o.to(Out.dtype.element_ty),
        mask=mask_g[:, None] & mask_dv[None, :],
    )


def _interpreted() -> bool:
    return type(_kernel).__name__ == "InterpretedFunction"


def sparse_decode_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    sub: DecodeSubsets,
    dims: Dims,
    *,
    scale: float,
    out: torch.Tensor,  # [B, Hq, Dv], q.dtype, written
) -> torch.Tensor:  # out
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"the triton impl needs CUDA tensors (got {q.device}) or "
            "TRITON_INTERPRET=1 set before sgl_spec.kernels.sparse_decode.triton_impl "
            "is imported; valid impls on CPU: torch"
        )
    for name, t in (
        ("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("out", out),
        ("req_to_token", sub.req_to_token), ("sel_idx", sub.sel_idx),
    ):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride in its last dim, got {t.stride()}")
    sel_idx, sel_len = sub.sel_idx, sub.sel_len
    if dims.max_sel == 0:
        # A [B, Hkv, 0] tensor may carry any strides; the kernel never reads it.
        sel_idx = sel_idx.new_empty(dims.batch, dims.num_kv_heads, 1)

    block_g = triton.next_power_of_2(dims.group)
    # Keep the [BLOCK_G, BLOCK_N, BLOCK_D] score product near 8k fp32 values.
    block_n = max(16, min(64, 128 // block_g))
    grid = (dims.batch, dims.num_kv_heads)
    _kernel[grid](
        q, k_buf, v_buf, out,
        sub.req_to_token, sub.rows, sub.seq_lens, sel_idx, sel_len, sub.recent_start,
        sub.sink, scale,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        sub.req_to_token.stride(0),
        sel_idx.stride(0), sel_idx.stride(1),
        sel_len.stride(0), sel_len.stride(1),
        GROUP=dims.group,
        BLOCK_G=block_g,
        HEAD_DIM=dims.head_dim,
        BLOCK_D=triton.next_power_of_2(dims.head_dim),
        V_DIM=dims.v_head_dim,
        BLOCK_DV=triton.next_power_of_2(dims.v_head_dim),
        BLOCK_N=block_n,
    )
    return out
