"""Exact extend (prefill) attention: only the new queries attend, per request.

sglang's torch_native backend pads each request's query to the whole sequence, so a
cached prefix still costs full quadratic attention. Here the new queries attend prefix
+ new keys, by one of three calls (``extend_call`` picks, by the shape alone):

- ``padded``: torch_native's own call, one fused ``is_causal`` SDPA over the query padded
  to the whole sequence. Without a prefix it is bit for bit stock's; over a short prefix
  (at most a quarter of the new tokens: a document's first read after the cached chat
  template) its extra work is under the split's, and it runs one kernel, not two + a merge.
- ``split`` (a CPU, from ``SPLIT_MIN_QUERIES`` new queries over a longer prefix): the fused
  kernel twice (prefix columns unmasked, new columns ``is_causal``) merged by log-sum-exp
  (``sgl_spec.kernels.dense``). One call with a causal mask offset by the prefix would send
  SDPA on a CPU to its unfused path.
- ``masked``: that one masked call, the cheaper for a few queries over a long prefix.

Same attention, rounded differently (``python -m sgl_spec.bench.extend`` times the three;
docs/cpu.md). Prefill is compute-bound, so a Python loop over the requests of a pass
costs nothing that matters; the spans are computed once per pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_spec.kernels.dense import dense_attention_torch

from .batch import BatchView

SPLIT_MIN_QUERIES = 256  # new queries over a prefix from which the CPU runs the split
CALLS = ("padded", "split", "masked")
PAD_MAX_PREFIX_SHARE = 0.25  # the padded call while prefix <= this share of the new tokens
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


def extend_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> str:
    """Which call ``exact_extend`` makes: ``padded``, ``split`` or ``masked``.

    Padded costs (prefix + n)^2 / 2 query-key cells, the split n^2 / 2 + n * prefix and a
    merge: at a prefix of n / 4 the two are within 4% of cells, below it padded is less.
    """
    n = q.shape[0]
    if prefix <= PAD_MAX_PREFIX_SHARE * n:
        return "padded"
    if (q.device.type == "cpu" and n >= SPLIT_MIN_QUERIES
            and q.dtype == k.dtype == v.dtype and q.dtype in FUSED_DTYPES
            and v.shape == k.shape):
        return "split"
    return "masked"


def exact_extend(
    q: torch.Tensor,  # [n, Hq, D] one request's new queries
    k: torch.Tensor,  # [prefix + n, Hkv, D] its keys
    v: torch.Tensor,  # [prefix + n, Hkv, Dv]
    prefix: int,
    scale: float | None,
    call: str | None = None,  # force one of CALLS (benchmarks); default extend_call's pick
) -> torch.Tensor:  # [n, Hq, Dv], q.dtype
    """Dense causal attention of the new queries over prefix + new keys."""
    call = call or extend_call(q, k, v, prefix)
    if call not in CALLS:
        raise ValueError(f"call must be one of {CALLS}, got {call!r}")
    if call == "split":
        return dense_attention_torch(q, k, v, prefix, scale)
    if call == "padded" and prefix:
        # torch_native's layout: the prefix's query rows are never read back.
        padded = q.new_empty((prefix + q.shape[0], *q.shape[1:]))
        padded[prefix:] = q
        return _sdpa(padded, k, v, None, scale)[prefix:]
    mask = None if prefix == 0 else offset_causal_mask(prefix, q.shape[0], q.device)
    return _sdpa(q, k, v, mask, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None) -> torch.Tensor:
    """One SDPA call in the [tokens, heads, dim] layout; causal when ``mask`` is None."""
    qh = q.movedim(0, 1)  # [Hq, n, D]
    kh, vh = k.movedim(0, 1), v.movedim(0, 1)
    if not (qh.dtype == kh.dtype == vh.dtype):
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    out = scaled_dot_product_attention(
        qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask,
        enable_gqa=qh.shape[0] != kh.shape[0], scale=scale, is_causal=mask is None,
    )
    return out.squeeze(0).movedim(1, 0)
