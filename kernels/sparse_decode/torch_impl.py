"""Sparse decode in batched torch ops: the fast CPU path.

All (request, KV head) pairs are handled at once: their position lists are laid out
side by side in one padded ``[B, Hkv, L]`` tensor (sink | selection | recent window),
K/V are gathered with one advanced index each, and attention is two batched matmuls
with padded columns masked to -inf. No Python loop over requests or heads.
"""

from __future__ import annotations

import torch

from .common import check_inputs


def _gather(
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


def sparse_decode_torch(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    sel_idx: torch.Tensor,  # [B, Hkv, max_sel] int64, padding -1
    sel_len: torch.Tensor,  # [B, Hkv] int64
    recent_start: torch.Tensor,  # [B] int64
    *,
    sink: int,
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, Dv], q.dtype, written if given
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    dims = check_inputs(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
        sel_idx, sel_len, recent_start, sink,
    )
    bsz, hkv, g = dims.batch, dims.num_kv_heads, dims.group
    dev = q.device
    seq = seq_lens.long()
    sink_end = seq.clamp(max=sink)  # [B]
    recent = torch.maximum(recent_start.long(), sink_end)  # [B]
    n_recent = seq - recent  # [B]
    # One host sync: the padded width of the recent part.
    max_recent = int(n_recent.max()) if bsz else 0

    ar_sink = torch.arange(sink, device=dev)
    ar_sel = torch.arange(dims.max_sel, device=dev)
    ar_rec = torch.arange(max_recent, device=dev)
    pos = torch.cat(
        [
            ar_sink.expand(bsz, hkv, sink),
            sel_idx.long(),
            (recent[:, None] + ar_rec).unsqueeze(1).expand(bsz, hkv, max_recent),
        ],
        dim=-1,
    )  # [B, Hkv, L]
    valid = torch.cat(
        [
            (ar_sink < sink_end[:, None]).unsqueeze(1).expand(bsz, hkv, sink),
            ar_sel < sel_len.long()[..., None],
            (ar_rec < n_recent[:, None]).unsqueeze(1).expand(bsz, hkv, max_recent),
        ],
        dim=-1,
    )  # [B, Hkv, L] bool
    # Padding reads the current token's slot (always written), so that no
    # uninitialised pool slot is touched; its weight is zeroed by the mask below.
    pos = torch.where(valid, pos, (seq - 1)[:, None, None])
    slots = req_to_token[req_pool_indices.long()[:, None, None], pos].long()  # [B, Hkv, L]
    k = _gather(k_buf, slots).float()  # [B, Hkv, L, D]
    v = _gather(v_buf, slots).float()  # [B, Hkv, L, Dv]

    qg = q.reshape(bsz, hkv, g, dims.head_dim).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L] fp32
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v).reshape(bsz, dims.num_q_heads, dims.v_head_dim)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
