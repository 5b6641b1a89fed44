"""Dense reference for sparse decode: slow, explicit, obviously right.

Per request and KV head it lists the attended positions in Python (asserting the
subset contract of ``common``), maps them to pool slots, and runs plain softmax
attention in float64 for the query heads of that KV head's group.
``merge_splits_reference`` is the oracle of the Triton kernel's split merge.
"""

from __future__ import annotations

import torch

from .common import DecodeSubsets, check_inputs, subset_positions


def sparse_decode_reference(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    sub: DecodeSubsets,
    *,
    scale: float,
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    dims = check_inputs(q, k_buf, v_buf, sub)
    g = dims.group
    out = torch.empty(dims.batch, dims.num_q_heads, dims.v_head_dim, dtype=torch.float64)
    for b in range(dims.batch):
        n = int(sub.seq_lens[b])
        row = sub.req_to_token[int(sub.rows[b])]
        for h in range(dims.num_kv_heads):
            m = int(sub.sel_len[b, h])
            if not 0 <= m <= dims.max_sel:
                raise AssertionError(f"sel_len[{b}, {h}] = {m} not in [0, {dims.max_sel}]")
            sel = [int(p) for p in sub.sel_idx[b, h, :m]]
            pos = subset_positions(n, int(sub.recent_start[b]), sub.sink, sel)
            slots = torch.tensor([int(row[p]) for p in pos], dtype=torch.long)
            k = k_buf[slots.to(k_buf.device), h].double().cpu()  # [L, D]
            v = v_buf[slots.to(v_buf.device), h].double().cpu()  # [L, Dv]
            qh = q[b, h * g : (h + 1) * g].double().cpu()  # [G, D]
            p = torch.softmax(qh @ k.T * scale, dim=-1)  # [G, L]
            out[b, h * g : (h + 1) * g] = p @ v
    return out.to(device=q.device, dtype=q.dtype)


def merge_splits_reference(
    part: torch.Tensor,  # [B, Hq, splits, Dv], each split's normalised attention output
    lse: torch.Tensor,  # [B, Hq, splits], each split's log-sum-exp; -inf: no positions
) -> torch.Tensor:  # [B, Hq, Dv] float64; zeros where every split is empty
    """Flash-decoding's merge of key splits: ``sum_s exp(lse_s) o_s / sum_s exp(lse_s)``."""
    part, lse = part.double(), lse.double()
    m = lse.amax(dim=-1, keepdim=True)  # [B, Hq, 1]
    w = torch.exp(lse - m.nan_to_num(neginf=0.0))  # [B, Hq, splits], 0 for empty splits
    den = w.sum(-1, keepdim=True)
    return (w[..., None] * part).sum(-2) / den.where(den > 0, 1.0)


def copy_rows_reference(
    stage_k: torch.Tensor,  # [..., D] staging K, written
    stage_v: torch.Tensor,  # [..., D] staging V, written
    pool_k: torch.Tensor,  # [..., D] pool K
    pool_v: torch.Tensor,  # [..., D] pool V
    dst: torch.Tensor,  # [M] int64 flat rows of the staging buffers
    src: torch.Tensor,  # [M] int64 flat rows of the pool
) -> None:
    """Elastic loads: ``stage.view(-1, D)[dst] = pool.view(-1, D)[src]`` for K and V.
    The pool may live on another device than the staging rows (an offloaded layer in
    host memory): the rows are gathered where the pool is, then copied (a host sync)."""
    for stage, pool in ((stage_k, pool_k), (stage_v, pool_v)):
        d = pool.shape[-1]
        rows = pool.reshape(-1, d).index_select(0, src.to(pool.device))
        stage.view(-1, d).index_copy_(0, dst, rows.to(stage.device))


def head_logits_reference(
    q: torch.Tensor,  # [R, Hq, D] (scaled)
    keys: torch.Tensor,  # [slots, Hkv, D] the head's keys in the pool
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    rows: torch.Tensor,  # [R] int64
    n_keys: torch.Tensor,  # [R] int64 keys per row (positions [0, n_keys))
    n: int,  # N >= max(n_keys)
) -> torch.Tensor:  # [R, Hkv, G, N] fp32: q_g . k_j, -inf for j >= n_keys
    r, hq, d = q.shape
    hkv = keys.shape[1]
    out = torch.full((r, hkv, hq // hkv, n), float("-inf"))
    for i in range(r):
        m = int(n_keys[i])
        k = keys[req_to_token[int(rows[i]), :m].long()].double()  # [m, Hkv, D]
        qg = q[i].double().view(hkv, hq // hkv, d)
        out[i, :, :, :m] = torch.einsum("hgd,mhd->hgm", qg, k).float()
    return out
