"""Exact extend (prefill) attention: only the new queries attend, per request.

sglang's torch_native backend pads each request's query to the whole sequence, so a
cached prefix still costs full quadratic attention. Here the new queries attend prefix
+ new keys.
Without a prefix the call is the one torch_native makes, bit for bit. Over a prefix,
one SDPA call needs a causal mask offset by the prefix length, which sends SDPA on a
CPU to its unfused path; from ``SPLIT_MIN_QUERIES`` new queries on, the CPU instead
runs the fused kernel twice (prefix columns unmasked, new columns ``is_causal``) and
merges the two by log-sum-exp (``sgl_spec.kernels.dense``), which is the faster one
for many queries and the slower for a few (``SPLIT_MIN_QUERIES``: docs/cpu.md). Same
attention, rounded differently. Prefill is compute-bound, so a Python loop over the requests of a pass
costs nothing that matters; the spans are computed once per pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_spec.kernels.dense import dense_attention_torch

from .batch import BatchView

SPLIT_MIN_QUERIES = 256  # new queries over a prefix from which the CPU runs the split
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # the CPU's fused SDPA kernel takes these


class Span(NamedTuple):
    """One request of an extend pass."""

    q_start: int  # its new queries: rows [q_start, q_end) of the pass
    q_end: int
    prefix: int  # cached tokens before them
    slots: torch.Tensor  # [prefix + new] int64 its KV slots (from req_to_token, once a pass)


def spans(batch: BatchView) -> list[Span]:
    out, q_end = [], 0
    for row, n, e in zip(batch.pool_rows, batch.seq_lens, batch.extend_lens):
        q_start, q_end = q_end, q_end + e
        out.append(Span(q_start, q_end, n - e, batch.req_to_token[row, :n].long()))
    return out


def offset_causal_mask(prefix_len: int, q_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask [q_len, prefix_len + q_len]: query i sees keys 0..prefix_len+i."""
    q_pos = torch.arange(prefix_len, prefix_len + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(prefix_len + q_len, device=device).unsqueeze(0)
    return k_pos <= q_pos


def exact_extend(
    q: torch.Tensor,  # [n, Hq, D] one request's new queries
    k: torch.Tensor,  # [prefix + n, Hkv, D] its keys
    v: torch.Tensor,  # [prefix + n, Hkv, Dv]
    prefix: int,
    scale: float | None,
) -> torch.Tensor:  # [n, Hq, Dv], q.dtype
    """Dense causal attention of the new queries over prefix + new keys."""
    if (prefix and q.device.type == "cpu" and q.shape[0] >= SPLIT_MIN_QUERIES
            and q.dtype == k.dtype == v.dtype and q.dtype in FUSED_DTYPES
            and v.shape == k.shape):
        return dense_attention_torch(q, k, v, prefix, scale)
    qh = q.movedim(0, 1)  # [Hq, n, D]
    kh, vh = k.movedim(0, 1), v.movedim(0, 1)
    if not (qh.dtype == kh.dtype == vh.dtype):
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    mask = None if prefix == 0 else offset_causal_mask(prefix, q.shape[0], q.device)
    out = scaled_dot_product_attention(
        qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask,
        enable_gqa=qh.shape[0] != kh.shape[0], scale=scale, is_causal=prefix == 0,
    )
    return out.squeeze(0).movedim(1, 0)
