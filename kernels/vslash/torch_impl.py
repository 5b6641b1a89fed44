"""Vertical/slash prefill attention in torch ops: the fast CPU path.

Scores are computed only on the selected lines, never as a dense ``[n, N+n]``
matrix masked afterwards. Per line head and chunk of ``R`` query rows the selected
cells split into two disjoint parts, each computed the cheapest way on a CPU:

* verticals: the chunk's queries against the gathered vertical columns (those at or
  before the chunk's last query), one matmul ``[R, D] x [D, n_v]`` per chunk, a
  causal mask only on the columns past the chunk's first query;
* slashes: row ``p`` needs keys ``p - d`` for every selected offset ``d``, a
  different key per row and line, so no key is shared inside a block. A gathered
  ``[R, n_s, D]`` copy of K and V is memory-bound (measured ~7x slower); instead
  ``torch.sparse.sampled_addmm`` (SDDMM) computes exactly the ``R * n_s`` dot
  products from a fixed-width CSR pattern, and ``embedding_bag`` with
  ``per_sample_weights`` sums the probability-weighted value rows without
  materialising them. Cells that lie on a selected vertical are masked here (the
  first part owns them), so each selected cell is counted once.

The two parts share one row max and one denominator (a two-block softmax), so each
row is normalised over exactly its selected cells; the result equals the masked
reference up to rounding. Rows with no selected cell output zeros.
Cost per row: ``n_v + n_s`` scores instead of ``N + n``.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.functional import embedding_bag

from .lines import LineSet, check_inputs, line_bitmaps


def _sddmm(
    q_rows: torch.Tensor,  # [lg, R, D] fp32
    k_t: torch.Tensor,  # [D, K] fp32 contiguous
    idx: torch.Tensor,  # [R, m] int64 key per (row, slash)
) -> torch.Tensor:  # [lg, R, m] fp32: q_rows[h, r] . k[idx[r, j]]
    lg, r, _ = q_rows.shape
    m = idx.shape[1]
    crow = torch.arange(0, r * m + 1, m, device=idx.device)
    col = idx.reshape(-1)
    s = torch.zeros(lg, r, m, device=idx.device)  # beta=0 still reads it: no NaN garbage
    with warnings.catch_warnings():  # "CSR support is in beta"
        warnings.simplefilter("ignore")
        for h in range(lg):
            # The pattern's values are a view of s[h]: out= writes the dots in place
            # (3x faster than letting sampled_addmm allocate and clone).
            pattern = torch.sparse_csr_tensor(crow, col, s[h].view(-1), size=(r, k_t.shape[1]))
            res = torch.sparse.sampled_addmm(
                pattern, q_rows[h].contiguous(), k_t, beta=0.0, out=pattern
            )
            if res.values().data_ptr() != s[h].data_ptr():  # not in place: copy
                s[h].view(-1).copy_(res.values())
    return s


def vslash_attention_torch(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor,  # [N+n, Hkv, D]
    lines: LineSet,  # H_l line heads (see lines.py)
    history_len: int,
    scale: float | None = None,  # default 1/sqrt(D)
    *,
    chunk: int = 1024,  # query rows per step, at most
    max_chunk_cells: int = 1 << 22,  # rows * lines per step, at most (memory bound)
    out: torch.Tensor | None = None,  # [n, Hq, D], q.dtype, written if given
) -> torch.Tensor:  # [n, Hq, D], q.dtype
    """Softmax attention over exactly the selected cells; fp32 math on q's device."""
    dims = check_inputs(q, k, v, lines, history_len)
    if chunk < 1 or max_chunk_cells < 1:
        raise ValueError(f"chunk ({chunk}) and max_chunk_cells ({max_chunk_cells}) must be >= 1")
    scale = dims.head_dim**-0.5 if scale is None else scale
    n, lg, dev = dims.n, dims.line_group, q.device
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != dev:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)}")
    is_v_all, _ = line_bitmaps(lines, dims.num_keys, dev)  # [H_l, K]
    neg_inf = float("-inf")
    for lh in range(lines.num_heads):
        heads = slice(lh * lg, (lh + 1) * lg)  # this line head's query heads
        kvh = lh * lg // dims.group
        kh = k[:, kvh].float().contiguous()  # [K, D]
        vh = v[:, kvh].float().contiguous()  # [K, D]
        k_t = kh.t().contiguous()  # [D, K]
        is_v = is_v_all[lh]  # [K]
        vert_host = lines.vertical[lh]  # [n_v] CPU: chunk bounds without device syncs
        vert = vert_host.to(dev)
        sl_host = lines.slash[lh]  # [n_s] CPU
        sl = sl_host.to(dev)
        k_vert, v_vert = kh[vert], vh[vert]  # [n_v, D]
        rows = max(1, min(chunk, max_chunk_cells // max(1, vert.numel() + sl.numel())))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            p0, p1 = history_len + r0, history_len + r1 - 1  # first / last query position
            pos = torch.arange(p0, p1 + 1, device=dev)  # [R]
            qc = q[r0:r1, heads].float() * scale  # [R, lg, D]
            row_max = torch.full((lg, r1 - r0), neg_inf, device=dev)  # [lg, R]

            # Verticals at or before the last query; only those past p0 need a mask.
            nv = int(torch.searchsorted(vert_host, p1, right=True))
            nv_safe = int(torch.searchsorted(vert_host, p0, right=True))
            s_v = None
            if nv:
                s_v = torch.einsum("rhd,cd->hrc", qc, k_vert[:nv])  # [lg, R, nv]
                if nv > nv_safe:
                    tail = vert[nv_safe:nv][None, :] > pos[:, None]  # [R, nv - nv_safe]
                    s_v[..., nv_safe:].masked_fill_(tail, neg_inf)
                row_max = torch.maximum(row_max, s_v.amax(-1))

            # Slashes: key p - d per row, SDDMM on a fixed-width CSR pattern.
            s_s = idx = None
            ns = int(torch.searchsorted(sl_host, p1, right=True))  # offsets d <= p1 reach
            if ns:
                idx = pos[:, None] - sl[None, :ns]  # [R, ns]
                drop = idx < 0
                idx.clamp_(min=0)
                drop |= is_v[idx]  # the vertical part owns these cells
                s_s = _sddmm(qc.transpose(0, 1), k_t, idx)  # [lg, R, ns]
                s_s.masked_fill_(drop, neg_inf)
                row_max = torch.maximum(row_max, s_s.amax(-1))

            row_max = row_max.masked_fill_(torch.isinf(row_max), 0.0)[..., None]  # empty rows
            acc = denom = None  # [lg, R, D], [lg, R, 1]
            if s_v is not None:
                p_v = torch.exp_(s_v.sub_(row_max))
                denom = p_v.sum(-1, keepdim=True)
                acc = p_v @ v_vert[:nv]
            if s_s is not None:
                p_s = torch.exp_(s_s.sub_(row_max))
                d_s = p_s.sum(-1, keepdim=True)
                a_s = torch.stack(
                    [embedding_bag(idx, vh, per_sample_weights=p_s[h], mode="sum") for h in range(lg)]
                )
                denom = d_s if denom is None else denom.add_(d_s)
                acc = a_s if acc is None else acc.add_(a_s)
            if acc is None:  # no line reaches these rows
                out[r0:r1, heads] = 0
                continue
            acc /= torch.where(denom > 0, denom, torch.ones_like(denom))
            out[r0:r1, heads] = acc.transpose(0, 1).to(out.dtype)
    return out
