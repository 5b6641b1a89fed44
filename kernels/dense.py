"""Dense extend attention through the CPU's fused SDPA kernel, in parts merged by lse.

``fused_attention`` is one call of the fused kernel that also returns the rows'
log-sum-exps; ``merge_partials`` combines partial softmax attentions over disjoint
column sets; ``dense_attention_torch`` is exact causal attention of an extend over a
cached prefix as two such parts (exact mode's extend and the sparse prefill's
too-dense layers run it). The vslash line kernels build their parts the same way.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def fused_attention(
    q: torch.Tensor,  # [B, lg, r, D]
    k: torch.Tensor,  # [B, C, D] one KV head, shared by the lg query heads
    v: torch.Tensor,  # [B, C, D]
    mask: torch.Tensor | None,  # [B, r, C] additive 0/-inf, or None (every cell)
    scale: float,
    is_causal: bool = False,  # row i sees columns <= i (r == C, no mask)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, lg, r, D], lse [B, lg, r] fp32
    """Attention of each batch item over its columns, and its row log-sum-exp.

    A row whose cells are all masked has an undefined lse: callers mask it.
    """
    b, lg = q.shape[:2]
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        kk = k[:, None].expand(b, lg, -1, -1)
        vv = v[:, None].expand(b, lg, -1, -1)
        m = None if mask is None else mask.to(q.dtype)[:, None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, kk, vv, is_causal=is_causal, attn_mask=m, scale=scale
        )
        return out, lse.float()
    s = torch.einsum("bhrd,bcd->bhrc", q.float(), k.float()) * scale
    if is_causal:
        r, c = s.shape[-2:]
        s = s.masked_fill(torch.ones(r, c, dtype=torch.bool, device=s.device).triu(1), NEG_INF)
    if mask is not None:
        s = s + mask.float()[:, None]
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.einsum("bhrc,bcd->bhrd", p, v.float()), lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial softmax attentions ``(out [lg,R,D], lse [lg,R])``; empty rows -> 0."""
    lse = parts[0][1]
    for _, l in parts[1:]:
        lse = torch.logaddexp(lse, l)
    empty = torch.isinf(lse)
    lse_safe = lse.masked_fill(empty, 0.0)
    res = None
    for o, l in parts:
        term = o.float() * torch.exp(l - lse_safe)[..., None]
        res = term if res is None else res.add_(term)
    return res.masked_fill_(empty[..., None], 0.0)


def dense_attention_torch(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor,  # [N+n, Hkv, D]
    history_len: int,
    scale: float | None = None,  # default 1/sqrt(D)
) -> torch.Tensor:  # [n, Hq, D], q.dtype
    """Exact causal attention of an extend through the fused kernel, no mask tensor.

    The history columns are causal for every new query (one unmasked call) and the
    new columns are a square causal block (one ``is_causal`` call); the two merge by
    their log-sum-exps. A dense SDPA call over the whole ``[n, N+n]`` needs an offset
    causal mask, which sends SDPA on a CPU to its unfused path. Its reference is that
    masked call (``sgl_spec.attention.extend.offset_causal_mask``).
    """
    n, hq, d = q.shape
    if k.shape[0] != history_len + n or v.shape != k.shape or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not form an extend over {history_len} cached positions")
    scale = d**-0.5 if scale is None else scale
    num_kv_heads = k.shape[1]
    g = hq // num_kv_heads
    out = torch.empty_like(q)
    for kvh in range(num_kv_heads):
        heads = slice(kvh * g, (kvh + 1) * g)
        qh = q[:, heads].transpose(0, 1)[None]  # [1, g, n, D]
        kh, vh = k[:, kvh], v[:, kvh]
        parts = []
        if history_len:
            o, lse = fused_attention(qh, kh[None, :history_len], vh[None, :history_len],
                                     None, scale)
            parts.append((o[0], lse[0]))
        o, lse = fused_attention(qh, kh[None, history_len:], vh[None, history_len:],
                                 None, scale, is_causal=True)
        parts.append((o[0], lse[0]))
        out[:, heads] = merge_partials(parts).transpose(0, 1).to(out.dtype)
    return out
