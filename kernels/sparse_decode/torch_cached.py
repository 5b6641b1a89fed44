"""Sparse decode with the fixed part of each subset gathered once (CPU, torch).

Between two reselections a request's sink and selection do not change, only its
recent window grows. ``sparse_decode_torch`` gathers and converts all of them from
the pool at every step; here they are gathered once per (request, layer) into a
``FixedKV`` (fp32, keys pre-transposed for the score matmul), and each step only
reads the recent window ``[R_b, seq_len)`` from the pool: the "load only what
changed" of SpeContext (Sec. 4.3) on a CPU. The subset contract is ``common``'s;
the result equals ``sparse_decode_torch``'s on the same subset (the softmax over
fixed and recent columns is one softmax over their concatenation).

    fixed = gather_fixed(k_buf, v_buf, req_to_token[row], sel_idx_bh, sel_len_h, sink_end)
    recent = recent_index(req_to_token, req_pool_indices, seq_lens, recent_start,
                          sink_ends, num_kv_heads)     # once per pass: same for all layers
    out = sparse_decode_cached(q, [fixed, ...], k_buf, v_buf, recent, scale=...)

Memory: ``(sink + budget) * Hkv * (D + Dv) * 4`` bytes per request and layer
(1.6 MB for B=1024 on the default model; 47 MB per request over its 30 layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .torch_impl import _gather


class FixedKV(NamedTuple):
    """One request's sink + selection in one layer, padded across KV heads."""

    k_t: torch.Tensor  # [Hkv, D, S] fp32 keys, transposed
    v: torch.Tensor  # [Hkv, S, Dv] fp32
    bias: torch.Tensor | None  # [Hkv, 1, S] fp32: 0 attended, -inf padding; None: no padding
    sink_end: int  # the sink part is positions [0, sink_end)

    @property
    def width(self) -> int:
        return self.k_t.shape[-1]


class RecentIndex(NamedTuple):
    """Where a pass's recent windows sit in the pool: the same for every layer."""

    rows: torch.Tensor  # [B * Hkv * R] int64 rows of buf.view(-1, D): slot * Hkv + head
    valid: torch.Tensor  # [B, 1, 1, R] bool; padding reads the current token's slot
    shape: tuple[int, int, int]  # (B, Hkv, R)


def recent_index(
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    recent_start: torch.Tensor,  # [B] int64
    sink_end: torch.Tensor,  # [B] int64: each request's FixedKV.sink_end
    num_kv_heads: int,
) -> RecentIndex:
    """The recent windows ``[max(recent_start, sink_end), seq_len)`` of a pass."""
    bsz = seq_lens.shape[0]
    dev = seq_lens.device
    seq = seq_lens.long()
    recent = torch.maximum(recent_start.long(), sink_end.long())
    n_recent = seq - recent
    width = max(1, int(n_recent.max()))  # 0 when the sink holds the whole history
    ar = torch.arange(width, device=dev)
    valid = ar < n_recent[:, None]  # [B, R]
    pos = torch.where(valid, recent[:, None] + ar, (seq - 1)[:, None])
    slots = req_to_token[req_pool_indices.long()[:, None], pos].long()  # [B, R]
    heads = torch.arange(num_kv_heads, device=dev)[None, :, None]
    rows = (slots[:, None, :] * num_kv_heads + heads).reshape(-1)  # [B * Hkv * R]
    return RecentIndex(rows, valid[:, None, None, :], (bsz, num_kv_heads, width))

    @property
    def width(self) -> int:
        return self.k_t.shape[-1]


def gather_fixed(
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    token_slots: torch.Tensor,  # [>= seq_len] int: the request's req_to_token row
    sel_idx: torch.Tensor,  # [Hkv, n] int64 positions in [sink_end, R), padding -1
    sel_len: torch.Tensor | None,  # [Hkv] int64 valid prefix of sel_idx; None: all n
    sink_end: int,
) -> FixedKV:
    """Gather the sink and the selection of one (request, layer) from the pool."""
    hkv, n = sel_idx.shape
    dev = k_buf.device
    pos = torch.cat(
        [torch.arange(sink_end, device=dev).expand(hkv, sink_end), sel_idx.long()], dim=1
    )  # [Hkv, S]
    valid = torch.ones(hkv, sink_end + n, dtype=torch.bool, device=dev)
    if sel_len is not None:
        valid[:, sink_end:] = torch.arange(n, device=dev) < sel_len.long()[:, None]
        pos = torch.where(valid, pos, 0)  # padding reads position 0, masked below
    if sink_end + n == 0:
        pos = torch.zeros(hkv, 1, dtype=torch.long, device=dev)  # one masked column
        valid = torch.zeros(hkv, 1, dtype=torch.bool, device=dev)
    slots = token_slots[pos].long()[None]  # [1, Hkv, S]
    k = _gather(k_buf, slots)[0].float()  # [Hkv, S, D]
    v = _gather(v_buf, slots)[0].float()
    bias = None
    if not bool(valid.all()):
        bias = torch.zeros(hkv, 1, pos.shape[1], device=dev)
        bias.masked_fill_(~valid[:, None, :], float("-inf"))
    return FixedKV(k.transpose(1, 2).contiguous(), v, bias, sink_end)


def _stack(fixed: Sequence[FixedKV]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[B, Hkv, D, S], [B, Hkv, S, Dv], [B, Hkv, 1, S] or None; narrower parts padded."""
    if len(fixed) == 1:
        f = fixed[0]
        return f.k_t[None], f.v[None], None if f.bias is None else f.bias[None]
    width = max(f.width for f in fixed)
    ks, vs, bs = [], [], []
    for f in fixed:
        pad = width - f.width
        bias = f.bias if f.bias is not None else f.k_t.new_zeros(f.k_t.shape[0], 1, f.width)
        ks.append(torch.nn.functional.pad(f.k_t, (0, pad)))
        vs.append(torch.nn.functional.pad(f.v, (0, 0, 0, pad)))
        bs.append(torch.nn.functional.pad(bias, (0, pad), value=float("-inf")))
    return torch.stack(ks), torch.stack(vs), torch.stack(bs)


def sparse_decode_cached(
    q: torch.Tensor,  # [B, Hq, D]
    fixed: Sequence[FixedKV],  # per request: its sink + selection in this layer
    k_buf: torch.Tensor,  # [num_slots, Hkv, D] (contiguous: no copy)
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    recent: RecentIndex,  # recent_index(...) of this pass
    *,
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, Dv], q.dtype, written if given
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    bsz, hq, d = q.shape
    hkv = k_buf.shape[1]
    if len(fixed) != bsz or recent.shape[:2] != (bsz, hkv):
        raise ValueError(f"{len(fixed)} FixedKV and a recent index {recent.shape} for "
                         f"a batch of {bsz} with {hkv} KV heads")
    g = hq // hkv
    k_r = k_buf.reshape(-1, d).index_select(0, recent.rows).view(*recent.shape, d).float()
    v_r = v_buf.reshape(-1, v_buf.shape[2]).index_select(0, recent.rows).view(
        *recent.shape, -1).float()  # [B, Hkv, R, Dv]
    k_f, v_f, bias_f = _stack(fixed)

    qg = q.reshape(bsz, hkv, g, d).float() * scale  # [B, Hkv, G, D]
    s_f = torch.matmul(qg, k_f)  # [B, Hkv, G, S]
    if bias_f is not None:
        s_f += bias_f
    s_r = torch.matmul(qg, k_r.transpose(-1, -2))  # [B, Hkv, G, R]
    s_r.masked_fill_(~recent.valid, float("-inf"))
    probs = torch.softmax(torch.cat([s_f, s_r], dim=-1), dim=-1)
    width = s_f.shape[-1]
    o = torch.matmul(probs[..., :width], v_f) + torch.matmul(probs[..., width:], v_r)
    o = o.reshape(bsz, hq, v_buf.shape[2])
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
