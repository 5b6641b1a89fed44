"""Dense reference for vertical/slash prefill attention: slow, explicit, obviously right.

It builds the boolean cell mask of the line set over the whole ``[n, N+n]`` extend
matrix and runs plain masked softmax attention in float64. A query row with no
selected cell (possible only for hand-made sets without offset 0) outputs zeros;
every implementation follows that convention.
"""

from __future__ import annotations

import torch

from .lines import LineSet, check_inputs, line_bitmaps


def line_mask(
    lines: LineSet,
    n: int,
    history_len: int,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:  # [H_l, r1 - r0, N+n] bool, CPU
    """Cells selected by ``lines`` for query rows ``rows = (r0, r1)`` (default: all).

    Cell ``(i, c)`` (query position ``p = N + i``) is selected iff it is causal
    (``c <= p``) and ``c`` is a selected vertical or ``p - c`` a selected slash.
    """
    num_keys = history_len + n
    r0, r1 = rows if rows is not None else (0, n)
    is_v, is_s = line_bitmaps(lines, num_keys)  # [H_l, K] each
    pos = torch.arange(history_len + r0, history_len + r1)  # [r]
    off = pos[:, None] - torch.arange(num_keys)[None, :]  # [r, K]
    causal = off >= 0
    on_slash = is_s[:, off.clamp(min=0)]  # [H_l, r, K]
    return causal & (is_v[:, None, :] | on_slash)


def vslash_attention_ref(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor,  # [N+n, Hkv, D]
    lines: LineSet,  # H_l line heads (see lines.py)
    history_len: int,
    scale: float | None = None,  # default 1/sqrt(D)
) -> torch.Tensor:  # [n, Hq, D], q.dtype, q.device
    """Softmax attention over exactly the selected causal cells, float64 math."""
    dims = check_inputs(q, k, v, lines, history_len)
    scale = dims.head_dim**-0.5 if scale is None else scale
    g = dims.group
    qf = q.detach().double().cpu()
    kf = k.detach().double().cpu().repeat_interleave(g, dim=1)  # [K, Hq, D]
    vf = v.detach().double().cpu().repeat_interleave(g, dim=1)
    mask = line_mask(lines, dims.n, history_len)  # [H_l, n, K]
    mask = mask.repeat_interleave(dims.line_group, dim=0)  # [Hq, n, K]
    scores = torch.einsum("nhd,khd->hnk", qf, kf) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
    out = torch.einsum("hnk,khd->nhd", p, vf)
    return out.to(device=q.device, dtype=q.dtype)
