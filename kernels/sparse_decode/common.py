"""The subset contract every sparse-decode implementation shares: its argument object
and its checks.

For request ``b`` and KV head ``h`` the attended positions are the union of

* the sink ``[0, S_b)`` with ``S_b = min(sink, seq_lens[b])``,
* the selection ``sel_idx[b, h, :sel_len[b, h]]``,
* the recent window ``[R_b, seq_lens[b])`` with ``R_b = max(recent_start[b], S_b)``.

The three sets are disjoint by contract: the selection is unique and lies in
``[S_b, R_b)`` (the selection policies guarantee it; ``reference`` asserts it, the
fast paths trust it). ``recent_start[b] < seq_lens[b]``, so the current token is
always attended. Clamping ``R_b`` to ``S_b`` means a window that reaches into the sink
is not counted twice: ``recent_start = 0`` with an empty selection is dense attention
(``dense_subsets``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class DecodeSubsets(NamedTuple):
    """What each request of a decode batch attends, and where its K/V sit in the pool.

    Built once per forward pass and shared by the layers (a reselecting layer writes
    its rows of ``sel_idx`` / ``sel_len`` in place). All tensors on the device of q.
    """

    req_to_token: torch.Tensor  # [max_reqs, max_context] int32: (row, position) -> slot
    rows: torch.Tensor  # [B] int64: each request's req_to_token row
    seq_lens: torch.Tensor  # [B] int64: history incl. the current token (K/V written)
    sel_idx: torch.Tensor  # [B, Hkv, S] int64 positions, padding -1
    sel_len: torch.Tensor  # [B, Hkv] int64: valid prefix length of sel_idx
    recent_start: torch.Tensor  # [B] int64: first position of the recent window
    sink: int  # positions [0, sink) are always attended
    dense: bool = False  # every row attends its whole history (host-side flag)


def dense_subsets(
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    rows: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    num_kv_heads: int,
) -> DecodeSubsets:
    """Every row attends positions ``[0, seq_len)``: exact attention."""
    bsz, dev = rows.shape[0], rows.device
    zeros = torch.zeros(bsz, dtype=torch.int64, device=dev)
    return DecodeSubsets(
        req_to_token, rows, seq_lens,
        torch.empty(bsz, num_kv_heads, 0, dtype=torch.int64, device=dev),
        torch.zeros(bsz, num_kv_heads, dtype=torch.int64, device=dev), zeros, 0, True,
    )


def take_rows(sub: DecodeSubsets, idx: torch.Tensor) -> DecodeSubsets:
    """The subsets of the batch rows ``idx`` ([R] int64), in that order."""
    return sub._replace(rows=sub.rows.index_select(0, idx),
                        seq_lens=sub.seq_lens.index_select(0, idx),
                        sel_idx=sub.sel_idx.index_select(0, idx),
                        sel_len=sub.sel_len.index_select(0, idx),
                        recent_start=sub.recent_start.index_select(0, idx))


class Dims(NamedTuple):
    batch: int
    num_q_heads: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    v_head_dim: int
    max_sel: int


def check_inputs(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    sub: DecodeSubsets,
) -> Dims:
    """Shape, dtype and device checks (no device sync). Returns the dimensions."""
    if q.dim() != 3 or k_buf.dim() != 3 or v_buf.dim() != 3:
        raise ValueError(
            f"q, k_buf, v_buf must be 3-D, got {tuple(q.shape)}, "
            f"{tuple(k_buf.shape)}, {tuple(v_buf.shape)}"
        )
    batch, hq, d = q.shape
    slots, hkv, dk = k_buf.shape
    if dk != d or v_buf.shape[:2] != (slots, hkv):
        raise ValueError(
            f"k_buf {tuple(k_buf.shape)} / v_buf {tuple(v_buf.shape)} do not match "
            f"q {tuple(q.shape)}: need k_buf [slots, Hkv, {d}], v_buf [slots, Hkv, Dv]"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is invalid; valid: {FLOAT_DTYPES}")
    if k_buf.dtype != v_buf.dtype:
        raise ValueError(f"k_buf {k_buf.dtype} and v_buf {v_buf.dtype} differ")
    if k_buf.device != q.device or v_buf.device != q.device:
        raise ValueError(f"k_buf/v_buf on {k_buf.device}/{v_buf.device}, q on {q.device}")
    if sub.sel_idx.dim() != 3 or sub.sel_idx.shape[:2] != (batch, hkv):
        raise ValueError(
            f"sel_idx {tuple(sub.sel_idx.shape)} must be [B={batch}, Hkv={hkv}, max_sel]"
        )
    if tuple(sub.sel_len.shape) != (batch, hkv):
        raise ValueError(f"sel_len {tuple(sub.sel_len.shape)} must be [{batch}, {hkv}]")
    for name in ("rows", "seq_lens", "recent_start"):
        t = getattr(sub, name)
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} {tuple(t.shape)} must be [{batch}]")
    for name in ("req_to_token", "rows", "seq_lens", "sel_idx", "sel_len", "recent_start"):
        t = getattr(sub, name)
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is invalid; valid: int32, int64")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if sub.req_to_token.dim() != 2:
        raise ValueError(f"req_to_token {tuple(sub.req_to_token.shape)} must be 2-D")
    if sub.sink < 0:
        raise ValueError(f"sink must be >= 0, got {sub.sink}")
    return Dims(batch, hq, hkv, hq // hkv, d, v_buf.shape[2], sub.sel_idx.shape[2])


def dims_of(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
            sub: DecodeSubsets) -> Dims:
    """The dimensions ``check_inputs`` returns, without its checks."""
    batch, hq, d = q.shape
    hkv = k_buf.shape[1]
    return Dims(batch, hq, hkv, hq // hkv, d, v_buf.shape[2], sub.sel_idx.shape[2])


def check_out(out: torch.Tensor | None, q: torch.Tensor, dims: Dims) -> torch.Tensor:
    """``out`` (checked), or a new ``[B, Hq, Dv]`` tensor of q's dtype."""
    shape = (dims.batch, dims.num_q_heads, dims.v_head_dim)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must be "
                         f"{list(shape)} {q.dtype} on {q.device}")
    return out


def subset_positions(
    seq_len: int, recent_start: int, sink: int, sel: list[int]
) -> list[int]:
    """The attended positions of one (request, KV head), in ascending order.

    Asserts the contract of the module docstring (used by ``reference`` and tests).
    """
    if not 0 <= recent_start < seq_len:
        raise AssertionError(f"recent_start {recent_start} not in [0, seq_len={seq_len})")
    sink_end = min(sink, seq_len)
    recent = max(recent_start, sink_end)
    if len(set(sel)) != len(sel):
        raise AssertionError(f"selected positions are not unique: {sorted(sel)}")
    bad = [p for p in sel if not sink_end <= p < recent]
    if bad:
        raise AssertionError(
            f"selected positions {bad} overlap the sink [0, {sink_end}) or the "
            f"recent window [{recent}, {seq_len})"
        )
    return sorted([*range(sink_end), *sel, *range(recent, seq_len)])
