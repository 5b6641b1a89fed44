"""Sparse decode in batched torch ops: the portable path (CPU without the C++ kernel,
any device).

Dense subsets (``DecodeSubsets.dense``) take SDPA's fused kernel: the K/V rows of all
requests are gathered with one ``index_select`` on the flat ``[slot * Hkv + h]`` rows
straight into ``[B, Hkv, L, D]`` (padded to the longest history, padding masked) and
the G query heads of a KV head become G query rows of one call.

Other subsets: all (request, KV head) pairs at once, their position lists laid out
side by side in one padded ``[B, Hkv, L]`` tensor (sink | selection | recent window),
K/V gathered with one advanced index each, attention as two batched matmuls with
padded columns masked to -inf. No Python loop over requests or heads.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from .common import DecodeSubsets, Dims


def gather_rows(
    buf: torch.Tensor,  # [num_slots, Hkv, D]
    slots: torch.Tensor,  # [B, Hkv, L] int64
) -> torch.Tensor:  # [B, Hkv, L, D]: buf[slots[b, h, l], h]
    hkv = buf.shape[1]
    heads = torch.arange(hkv, device=buf.device)[None, :, None]
    if buf.is_contiguous():
        # index_select on the flat [slot * Hkv + h] rows is several times faster
        # than two-tensor advanced indexing on CPU.
        rows = (slots * hkv + heads).reshape(-1)
        return buf.view(-1, buf.shape[2]).index_select(0, rows).view(*slots.shape, -1)
    return buf[slots, heads]


def _dense(q, k_buf, v_buf, sub: DecodeSubsets, dims, scale: float) -> torch.Tensor:
    bsz, hkv = dims.batch, dims.num_kv_heads
    seq = sub.seq_lens.long()
    width = int(seq.max())  # one host sync per call
    ar = torch.arange(width, device=q.device)
    valid = ar < seq[:, None]  # [B, L]
    pos = torch.where(valid, ar, (seq - 1)[:, None])  # padding reads the current token
    slots = sub.req_to_token[sub.rows.long()[:, None], pos].long()  # [B, L]
    slots = slots[:, None, :].expand(bsz, hkv, width)
    k = gather_rows(k_buf, slots)  # [B, Hkv, L, D]
    v = gather_rows(v_buf, slots)
    mask = None
    if not bool(valid.all()):
        mask = torch.zeros(bsz, 1, 1, width, dtype=k.dtype, device=q.device)
        mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
    qg = q.reshape(bsz, hkv, dims.group, dims.head_dim).to(k.dtype)  # [B, Hkv, G, D]
    o = scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(bsz, dims.num_q_heads, dims.v_head_dim)


def _subset(q, k_buf, v_buf, sub: DecodeSubsets, dims, scale: float) -> torch.Tensor:
    bsz, hkv, g, sink = dims.batch, dims.num_kv_heads, dims.group, sub.sink
    dev = q.device
    seq = sub.seq_lens.long()
    sink_end = seq.clamp(max=sink)  # [B]
    recent = torch.maximum(sub.recent_start.long(), sink_end)  # [B]
    n_recent = seq - recent  # [B]
    # One host sync: the padded width of the recent part.
    max_recent = int(n_recent.max()) if bsz else 0

    ar_sink = torch.arange(sink, device=dev)
    ar_sel = torch.arange(dims.max_sel, device=dev)
    ar_rec = torch.arange(max_recent, device=dev)
    pos = torch.cat(
        [
            ar_sink.expand(bsz, hkv, sink),
            sub.sel_idx.long(),
            (recent[:, None] + ar_rec).unsqueeze(1).expand(bsz, hkv, max_recent),
        ],
        dim=-1,
    )  # [B, Hkv, L]
    valid = torch.cat(
        [
            (ar_sink < sink_end[:, None]).unsqueeze(1).expand(bsz, hkv, sink),
            ar_sel < sub.sel_len.long()[..., None],
            (ar_rec < n_recent[:, None]).unsqueeze(1).expand(bsz, hkv, max_recent),
        ],
        dim=-1,
    )  # [B, Hkv, L] bool
    # Padding reads the current token's slot (always written), so that no
    # uninitialised pool slot is touched; its weight is zeroed by the mask below.
    pos = torch.where(valid, pos, (seq - 1)[:, None, None])
    slots = sub.req_to_token[sub.rows.long()[:, None, None], pos].long()  # [B, Hkv, L]
    k = gather_rows(k_buf, slots).float()  # [B, Hkv, L, D]
    v = gather_rows(v_buf, slots).float()  # [B, Hkv, L, Dv]

    qg = q.reshape(bsz, hkv, g, dims.head_dim).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L] fp32
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).reshape(bsz, dims.num_q_heads, dims.v_head_dim)


def sparse_decode_torch(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    sub: DecodeSubsets,
    dims: Dims,
    *,
    scale: float,
    out: torch.Tensor,  # [B, Hq, Dv], q.dtype, written
) -> torch.Tensor:  # out
    fn = _dense if sub.dense else _subset
    out.copy_(fn(q, k_buf, v_buf, sub, dims, scale))
    return out
