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
    out = sparse_decode_cached(q, [fixed, ...], k_buf, v_buf, req_to_token,
                               req_pool_indices, seq_lens, recent_start, scale=...)

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
    bias: torch.Tensor  # [Hkv, 1, S] fp32: 0 for attended columns, -inf for padding
    sink_end: int  # the sink part is positions [0, sink_end)

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
    bias = torch.zeros(hkv, 1, pos.shape[1], device=dev)
    bias.masked_fill_(~valid[:, None, :], float("-inf"))
    return FixedKV(k.transpose(1, 2).contiguous(), v, bias, sink_end)


def _stack(fixed: Sequence[FixedKV]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, Hkv, D, S], [B, Hkv, S, Dv], [B, Hkv, 1, S]; narrower parts padded, masked."""
    if len(fixed) == 1:
        f = fixed[0]
        return f.k_t[None], f.v[None], f.bias[None]
    width = max(f.width for f in fixed)
    ks, vs, bs = [], [], []
    for f in fixed:
        pad = width - f.width
        ks.append(torch.nn.functional.pad(f.k_t, (0, pad)))
        vs.append(torch.nn.functional.pad(f.v, (0, 0, 0, pad)))
        bs.append(torch.nn.functional.pad(f.bias, (0, pad), value=float("-inf")))
    return torch.stack(ks), torch.stack(vs), torch.stack(bs)


def sparse_decode_cached(
    q: torch.Tensor,  # [B, Hq, D]
    fixed: Sequence[FixedKV],  # per request: its sink + selection in this layer
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    recent_start: torch.Tensor,  # [B] int64 (clamped up to each sink_end)
    *,
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, Dv], q.dtype, written if given
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    bsz, hq, d = q.shape
    hkv = k_buf.shape[1]
    if len(fixed) != bsz:
        raise ValueError(f"{len(fixed)} FixedKV for a batch of {bsz}")
    g = hq // hkv
    dev = q.device
    seq = seq_lens.long()
    sink_end = torch.tensor([f.sink_end for f in fixed], device=dev)
    recent = torch.maximum(recent_start.long(), sink_end)
    n_recent = seq - recent
    max_recent = max(1, int(n_recent.max()))  # 0 when the sink holds the whole history
    ar = torch.arange(max_recent, device=dev)
    valid = ar < n_recent[:, None]  # [B, R]
    pos = torch.where(valid, recent[:, None] + ar, (seq - 1)[:, None])
    slots = req_to_token[req_pool_indices.long()[:, None], pos].long()  # [B, R]
    rows = slots[:, None, :].expand(bsz, hkv, max_recent)
    k_r = _gather(k_buf, rows).float()  # [B, Hkv, R, D]
    v_r = _gather(v_buf, rows).float()
    k_f, v_f, bias_f = _stack(fixed)

    qg = q.reshape(bsz, hkv, g, d).float() * scale  # [B, Hkv, G, D]
    s_f = torch.matmul(qg, k_f) + bias_f  # [B, Hkv, G, S]
    s_r = torch.matmul(qg, k_r.transpose(-1, -2))  # [B, Hkv, G, R]
    s_r.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([s_f, s_r], dim=-1), dim=-1)
    width = s_f.shape[-1]
    o = torch.matmul(probs[..., :width], v_f) + torch.matmul(probs[..., width:], v_r)
    o = o.reshape(bsz, hq, v_buf.shape[2])
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
