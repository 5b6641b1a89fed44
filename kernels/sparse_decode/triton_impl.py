"""Sparse decode as a Triton kernel, split over the keys where the batch is too small.

The subset of a (request, KV head) is read as one virtual list ``sink | selection |
recent window`` in blocks of ``BLOCK_N`` positions; each position maps to its pool slot
through ``req_to_token``, each K/V row is loaded once for all ``GROUP`` query heads of
the KV head (GQA), and the softmax is online in fp32.

Grid ``(B, Hkv, num_splits)``: flash-decoding's split-K (Dao, Haziza, Massa, Sizov,
"Flash-Decoding for long-context inference", 2023). Program ``(b, h, s)`` reads the
``s``-th chunk of the list, ``chunk = max(ceil(n / num_splits) rounded up to whole
blocks, min_chunk)`` positions, so a list shorter than ``num_splits`` chunks leaves
the trailing splits empty.

* ``num_splits == 1``: the one-pass kernel; one program per (request, KV head) writes
  the normalised output straight into ``out``; no scratch.
* ``num_splits > 1``: each program writes its chunk's normalised output and
  log-sum-exp into fp32 scratch (``[B, Hq, splits, Dv]`` and ``[B, Hq, splits]``; an
  empty chunk writes zeros and ``-inf``), then ``_merge_kernel``, one program per
  (request, query head), weighs the splits by ``exp(lse_s - max_s lse_s)`` and writes
  ``out``. ``reference.merge_splits_reference`` is the merge's torch oracle.

How many splits (``num_splits=None``, ``auto_num_splits``): enough that
``B * Hkv * splits`` reaches ``PROGRAMS_PER_SM`` programs per SM, but no more than
the longest possible list fills at ``MIN_SPLIT_BLOCKS`` blocks a split (its bound is
``req_to_token``'s width: the lengths live on the device and are not synced), and at
most ``MAX_SPLITS``. A batch that fills the GPU with ``B * Hkv`` programs gets 1 split.
Auto splits also keep ``min_chunk = MIN_SPLIT_BLOCKS`` blocks of the actual list, so a
short selection in a long context runs on a few working splits, not many tiny ones; a
forced ``num_splits`` splits down to single blocks (the tests use that). The constants
are first guesses for a 132-SM H100/H200, not tuned on one.

The scores are a broadcast multiply-and-sum, not ``tl.dot``: decode has ``GROUP``
(1..8) query rows, below ``tl.dot``'s 16-row minimum, and is memory-bound anyway.

A list with no positions (``seq_len`` 0: outside ``common``'s contract, e.g. a padded
batch row) writes zeros, not NaN, on either path.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set before this module is
imported); the tests do that.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import DecodeSubsets, Dims

PROGRAMS_PER_SM = 2  # auto splits aim at B * Hkv * splits >= this many per SM
MIN_SPLIT_BLOCKS = 4  # an auto split takes at least this many BLOCK_N blocks
MAX_SPLITS = 128
DEFAULT_SMS = 132  # H100 / H200; used where no CUDA device answers (interpreter)


@triton.jit
def _kernel(
    Q,  # [B, Hq, D]
    K,  # [num_slots, Hkv, D]
    V,  # [num_slots, Hkv, Dv]
    Out,  # [B, Hq, Dv]; SPLIT: partial outputs [B, Hq, splits, Dv] fp32
    Lse,  # SPLIT: [B, Hq, splits] fp32; else unused
    ReqToToken,  # [max_reqs, max_context]
    ReqPoolIdx,  # [B]
    SeqLens,  # [B]
    SelIdx,  # [B, Hkv, max_sel]
    SelLen,  # [B, Hkv]
    RecentStart,  # [B]
    sink,
    scale,
    min_chunk,  # SPLIT: positions a working split takes at least (a BLOCK_N multiple)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,  # SPLIT: partial outputs' split stride
    stride_lb,
    stride_lh,
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
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)

    seq_len = tl.load(SeqLens + b).to(tl.int64)
    sink_end = tl.minimum(seq_len, sink)
    recent = tl.maximum(tl.load(RecentStart + b).to(tl.int64), sink_end)
    n_sel = tl.load(SelLen + b * stride_slb + h * stride_slh).to(tl.int64)
    sel_end = sink_end + n_sel
    n_total = sel_end + (seq_len - recent)
    lo = 0
    hi = n_total
    if SPLIT:
        # This program's share [lo, hi) of the virtual list, in whole blocks.
        split = tl.program_id(2)
        per_split = tl.cdiv(n_total, tl.num_programs(2))
        chunk = tl.maximum(tl.cdiv(per_split, BLOCK_N) * BLOCK_N, min_chunk)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_total)

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

    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n  # [BLOCK_N] index into the virtual list
        valid = j < hi
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

    # No positions: l_i = 0 and acc = 0, so the output is 0 and the lse -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    if SPLIT:
        split = tl.program_id(2)
        tl.store(out_ptrs + split * stride_os, o, mask=mask_g[:, None] & mask_dv[None, :])
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_safe),
                 mask=mask_g)
    else:
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=mask_g[:, None] & mask_dv[None, :])


@triton.jit
def _merge_kernel(
    Part,  # [B, Hq, splits, Dv] fp32, each split's normalised output
    Lse,  # [B, Hq, splits] fp32, -inf for a split with no positions
    Out,  # [B, Hq, Dv]
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    lse_row = Lse + b * stride_lb + hq * stride_lh
    part_row = Part + b * stride_pb + hq * stride_ph

    m_s = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sl = s0 + offs_s
        m_s = tl.maximum(m_s, tl.load(lse_row + sl, mask=sl < num_splits, other=float("-inf")))
    m = tl.max(m_s, axis=0)
    # Every split empty: weigh by exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
    m = tl.where(m == float("-inf"), 0.0, m)

    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sl = s0 + offs_s
        mask_s = sl < num_splits
        w = tl.exp(tl.load(lse_row + sl, mask=mask_s, other=float("-inf")) - m)  # [BLOCK_S]
        part = tl.load(
            part_row + sl[:, None] * stride_ps + offs_dv[None, :],
            mask=mask_s[:, None] & mask_dv[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_DV]
        den += w
        acc += tl.sum(w[:, None] * part, axis=0)
    total = tl.sum(den, axis=0)
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + hq * stride_oh + offs_dv, o.to(Out.dtype.element_ty),
             mask=mask_dv)


def _interpreted() -> bool:
    return type(_kernel).__name__ == "InterpretedFunction"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_n_for(group: int) -> int:
    """Positions per block: the [BLOCK_G, BLOCK_N, BLOCK_D] score product near 8k fp32."""
    return max(16, min(64, 128 // triton.next_power_of_2(group)))


def auto_num_splits(pairs: int, max_len: int, block_n: int, num_sms: int = DEFAULT_SMS) -> int:
    """Splits per (request, KV head) for ``pairs = B * Hkv`` programs whose subsets hold
    at most ``max_len`` positions (module docstring)."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(pairs, 1))
    fill = max_len // (MIN_SPLIT_BLOCKS * block_n)
    return max(1, min(want, fill, MAX_SPLITS))


def sparse_decode_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    sub: DecodeSubsets,
    dims: Dims,
    *,
    scale: float,
    out: torch.Tensor,  # [B, Hq, Dv], q.dtype, written
    num_splits: int | None = None,  # None: auto_num_splits; 1: the one-pass kernel
) -> torch.Tensor:  # out
    """Writes ``out`` and nothing else the caller owns. A split call allocates its fp32
    scratch (``B * Hq * num_splits * (Dv + 1)`` values) on q's device per call. The
    split count comes from shapes only: no host sync."""
    if q.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"the triton impl needs CUDA tensors (got {q.device}) or "
            "TRITON_INTERPRET=1 set before sgl_spec.kernels.sparse_decode.triton_impl "
            "is imported; valid impls on CPU: torch"
        )
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be None (auto) or in [1, {MAX_SPLITS}], "
                         f"got {num_splits}")
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

    block_n = block_n_for(dims.group)
    min_chunk = block_n  # a forced split count splits down to single blocks
    if num_splits is None:
        num_splits = auto_num_splits(dims.batch * dims.num_kv_heads,
                                     sub.req_to_token.shape[1], block_n, _num_sms(q.device))
        min_chunk = MIN_SPLIT_BLOCKS * block_n
    split = num_splits > 1
    bsz, hq, dv = dims.batch, dims.num_q_heads, dims.v_head_dim
    if split:
        target = torch.empty(bsz, hq, num_splits, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
        stride_os, stride_lb, stride_lh = target.stride(2), lse.stride(0), lse.stride(1)
    else:
        target, lse = out, out  # lse: a placeholder pointer, never read
        stride_os = stride_lb = stride_lh = 0
    block_dv = triton.next_power_of_2(dv)
    _kernel[(bsz, dims.num_kv_heads, num_splits)](
        q, k_buf, v_buf, target, lse,
        sub.req_to_token, sub.rows, sub.seq_lens, sel_idx, sel_len, sub.recent_start,
        sub.sink, scale, min_chunk,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        target.stride(0), target.stride(1), stride_os,
        stride_lb, stride_lh,
        sub.req_to_token.stride(0),
        sel_idx.stride(0), sel_idx.stride(1),
        sel_len.stride(0), sel_len.stride(1),
        GROUP=dims.group,
        BLOCK_G=triton.next_power_of_2(dims.group),
        HEAD_DIM=dims.head_dim,
        BLOCK_D=triton.next_power_of_2(dims.head_dim),
        V_DIM=dv,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        SPLIT=split,
    )
    if split:
        merge_splits(target, lse, out)
    return out


def merge_splits(
    part: torch.Tensor,  # [B, Hq, splits, Dv] fp32, each split's normalised output
    lse: torch.Tensor,  # [B, Hq, splits] fp32, -inf for an empty split
    out: torch.Tensor,  # [B, Hq, Dv], written
) -> torch.Tensor:  # out
    """The splits' LSE-weighted sum (``reference.merge_splits_reference``); a row whose
    splits are all empty gets zeros."""
    bsz, hq, num_splits, dv = part.shape
    if part.stride(-1) != 1 or lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"part {part.stride()}, lse {lse.stride()} and out {out.stride()} "
                         "need a unit stride in their last dim")
    _merge_kernel[(bsz, hq)](
        part, lse, out, num_splits,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=dv,
        BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_S=min(16, triton.next_power_of_2(num_splits)),
    )
    return out
