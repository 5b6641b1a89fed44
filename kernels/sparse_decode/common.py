"""The subset contract every sparse-decode implementation shares, and its checks.

For request ``b`` and KV head ``h`` the attended positions are the union of

* the sink ``[0, S_b)`` with ``S_b = min(sink, seq_lens[b])``,
* the selection ``sel_idx[b, h, :sel_len[b, h]]``,
* the recent window ``[R_b, seq_lens[b])`` with ``R_b = max(recent_start[b], S_b)``.

The three sets are disjoint by contract: the selection is unique and lies in
``[S_b, R_b)`` (the selection policies guarantee it; ``reference`` asserts it, the
fast paths trust it). ``recent_start[b] < seq_lens[b]``, so the current token is
always attended. Clamping ``R_b`` to ``S_b`` means a window that reaches into the sink
is not counted twice: ``recent_start = 0`` with an empty selection is dense attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    sel_idx: torch.Tensor,  # [B, Hkv, max_sel] int64, padding -1
    sel_len: torch.Tensor,  # [B, Hkv] int64
    recent_start: torch.Tensor,  # [B] int64
    sink: int,
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
    if sel_idx.dim() != 3 or sel_idx.shape[:2] != (batch, hkv):
        raise ValueError(
            f"sel_idx {tuple(sel_idx.shape)} must be [B={batch}, Hkv={hkv}, max_sel]"
        )
    if tuple(sel_len.shape) != (batch, hkv):
        raise ValueError(f"sel_len {tuple(sel_len.shape)} must be [{batch}, {hkv}]")
    for name, t in (
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
        ("recent_start", recent_start),
    ):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} {tuple(t.shape)} must be [{batch}]")
    for name, t in (
        ("req_to_token", req_to_token),
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
        ("sel_idx", sel_idx),
        ("sel_len", sel_len),
        ("recent_start", recent_start),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} dtype {t.dtype} is invalid; valid: int32, int64")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token {tuple(req_to_token.shape)} must be 2-D")
    if k_buf.device != q.device or v_buf.device != q.device:
        raise ValueError(f"k_buf/v_buf on {k_buf.device}/{v_buf.device}, q on {q.device}")
    if sink < 0:
        raise ValueError(f"sink must be >= 0, got {sink}")
    return Dims(batch, hq, hkv, hq // hkv, d, v_buf.shape[2], sel_idx.shape[2])


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
