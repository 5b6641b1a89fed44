"""Vertical/slash prefill attention in torch ops: the fast CPU path.

Work is block-granular and skips unselected cells, never a dense ``[n, N+n]``
matrix masked afterwards. Per line head and block of ``R`` query rows
(positions ``p0..p1``) the selected cells split into three disjoint parts, each
computed the cheapest way on a CPU:

* **near part**: per sub-block of ``r`` rows (``r = SUB_ROWS``, positions
  ``p0'..p1'``), the rectangle of keys ``[p0' - W + 1, p1']`` (``r + W - 1``
  columns, a strided window of K/V, no gather) holds every cell of the slashes with
  offset ``d < W`` (the local band and the slashes next to it) and of the verticals
  in that range. A 0/-inf mask keeps exactly the selected cells, and the
  sub-blocks run as the batch of one fused call;
* **far verticals**: the selected columns left of a sub-block's rectangle are
  causal and selected for all its rows: one fused call over the gathered columns
  for the whole block, unmasked but for the few columns that lie left of a later
  sub-block's rectangle and not of an earlier one's;
* **far slashes** (``d >= W``): row ``p`` needs key ``p - d``, a different key per
  row and line, so no key is shared inside a block. ``torch.sparse.sampled_addmm``
  (SDDMM) computes exactly the ``R * n_far`` dot products from a fixed-width CSR
  pattern, and ``embedding_bag`` with ``per_sample_weights`` sums the
  probability-weighted value rows without materialising them. Cells on a selected
  vertical belong to the other parts and are masked here.

With the C++ slash kernel (``cpu_kernel.py``, built on first use; the default on a
CPU where it builds) a row block has two parts only: the verticals at or before its
first row, which every row sees, in one unmasked fused call over the gathered
columns; and in the kernel every slash cell (band included) not on a selected
vertical, plus the verticals inside the block, causal per row. The three-part split
above is the path where the kernel is off or cannot be built.

The fused calls are ``_scaled_dot_product_flash_attention_for_cpu`` on the CPU
(SDPA's flash kernel: dense-SDPA speed per computed cell, and it returns the row
log-sum-exp), an fp32 masked softmax in torch ops elsewhere. The parts are merged
by their log-sum-exps, so each row is normalised over exactly its selected cells:
the result equals the masked reference up to rounding. Rows with no selected cell
output zeros.

``W`` is chosen per line head from the selected offsets by a cost model: a
rectangle column costs one cell per row, a far slash ``FAR_CELL_COST`` cells (the
SDDMM path's cost per cell relative to the fused kernel's, measured on this CPU),
so ``W`` grows while the slashes it absorbs are dense enough to pay for it.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.functional import embedding_bag

from ..dense import NEG_INF, fused_attention, merge_partials
from . import cpu_kernel
from .lines import LineSet, check_inputs, line_bitmaps

FAR_CELL_COST = 4.0  # SDDMM far-slash cell / fused rectangle cell, measured on CPU
WIDTHS = (64, 128, 256, 512, 1024)  # rectangle widths W tried (plus the local run)
SUB_ROWS = 64  # rows per near-part rectangle (r + W - 1 columns: r=64 measured best)


def _sddmm(
    q_rows: torch.Tensor,  # [lg, R, D] fp32
    k_t: torch.Tensor,  # [D, K] fp32, the transpose of a contiguous [K, D]
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
            # (instead of letting sampled_addmm allocate and clone).
            pattern = torch.sparse_csr_tensor(crow, col, s[h].view(-1), size=(r, k_t.shape[1]))
            res = torch.sparse.sampled_addmm(
                pattern, q_rows[h].contiguous(), k_t, beta=0.0, out=pattern
            )
            if res.values().data_ptr() != s[h].data_ptr():  # not in place: copy
                s[h].view(-1).copy_(res.values())
    return s


def near_width(slash: torch.Tensor, num_keys: int, sub_rows: int = SUB_ROWS) -> int:
    """Rectangle width ``W``: slashes ``d < W`` go to the fused near part.

    Minimises ``(sub_rows + W) + FAR_CELL_COST * #{d >= W}`` (cells per row) over
    the local run (the contiguous offsets from 0) and ``WIDTHS``; in ``[1, num_keys]``.
    """
    run = 0
    if slash.numel() and int(slash[0]) == 0:
        run = int((slash == torch.arange(slash.numel())).long().cumprod(0).sum())
    best_w, best_cost = 1, float("inf")
    for w in sorted({max(run, 1), *WIDTHS}):
        w = min(w, num_keys)
        far = slash.numel() - int(torch.searchsorted(slash, w))
        cost = sub_rows + w + FAR_CELL_COST * far
        if cost < best_cost:
            best_w, best_cost = w, cost
    return best_w


def _windows(x: torch.Tensor, first: int, count: int, step: int, width: int) -> torch.Tensor:
    """``count`` overlapping row windows of ``x`` [L, D] (contiguous), no copy.

    Window ``j`` is rows ``first + j*step .. + width - 1``; ``x`` must hold them.
    """
    d = x.shape[1]
    return x.as_strided((count, width, d), (step * d, d, 1), x.storage_offset() + first * d)


def _near_part(qb, k_pad, v_pad, lead, is_v, near_s, w, p0, sub, num_keys, scale):
    """Per sub-block of ``sub`` rows: its rectangle ``[p0' - w + 1, p0' + sub - 1]``.

    ``k_pad``/``v_pad``: the KV head's keys with ``lead = w - 1`` zero rows in front
    and ``sub`` behind, so every rectangle is a strided window (no gather).
    """
    lg, rows, d = qb.shape
    dev = qb.device
    nb = -(-rows // sub)
    qs = torch.nn.functional.pad(qb, (0, 0, 0, nb * sub - rows))
    qs = qs.view(lg, nb, sub, d).transpose(0, 1)  # [nb, lg, sub, D]
    width = sub + w - 1
    sub_p0 = p0 + torch.arange(nb, device=dev) * sub  # [nb]
    cols = sub_p0[:, None] - w + 1 + torch.arange(width, device=dev)  # [nb, C]
    off = torch.arange(sub, device=dev)[:, None] + w - 1 - torch.arange(width, device=dev)
    inside = (cols >= 0) & (cols < num_keys)  # [nb, C]
    on_v = is_v[cols.clamp(0, num_keys - 1)] & inside  # [nb, C]
    on_s = (off >= 0) & near_s[off.clamp(0, num_keys - 1)]  # [sub, C], same every block
    keep = (on_s[None] & inside[:, None, :]) | ((off >= 0)[None] & on_v[:, None, :])
    mask = torch.zeros(keep.shape, dtype=qb.dtype, device=dev).masked_fill_(~keep, NEG_INF)
    start = p0 - w + 1 + lead  # the first window's first row in k_pad
    ks = _windows(k_pad, start, nb, sub, width)
    vs = _windows(v_pad, start, nb, sub, width)
    o, lse = fused_attention(qs, ks, vs, mask, scale)  # [nb, lg, sub, *]
    if not bool(near_s[0]):  # no diagonal: a row may have no cell here
        lse = lse.masked_fill(~keep.any(-1)[:, None, :], NEG_INF)
    o = o.transpose(0, 1).reshape(lg, nb * sub, d)[:, :rows]
    return o, lse.transpose(0, 1).reshape(lg, nb * sub)[:, :rows]


def _far_verticals(qb, kh, vh, vert, vert_host, w, p0, sub, scale):
    """Verticals left of each row's rectangle (all causal): one call for the block.

    Sub-block ``j`` sees the verticals before its rectangle start; later columns
    are masked for the earlier sub-blocks (only verticals inside the block's span).
    """
    lg, rows, _ = qb.shape
    dev = qb.device
    nb = -(-rows // sub)
    rect_start = p0 - w + 1 + torch.arange(nb) * sub  # [nb] CPU
    counts = torch.searchsorted(vert_host, rect_start)  # [nb] verticals per sub-block
    nv = int(counts[-1])
    if nv == 0:
        return None
    keys = vert[:nv]
    mask = None
    if int(counts[0]) < nv:  # a tail some sub-blocks must not see
        row_count = counts.to(dev).repeat_interleave(sub)[:rows]  # [R]
        hide = torch.arange(nv, device=dev)[None, :] >= row_count[:, None]
        mask = torch.zeros(hide.shape, dtype=qb.dtype, device=dev).masked_fill_(hide, NEG_INF)
        mask = mask[None]
    o, lse = fused_attention(qb[None], kh[keys][None], vh[keys][None], mask, scale)
    o, lse = o[0], lse[0]
    if int(counts[0]) == 0:  # sub-blocks before the first vertical have no cell here
        empty = (counts == 0).to(dev).repeat_interleave(sub)[:rows]
        lse = lse.masked_fill(empty[None], NEG_INF)
    return o, lse


def vslash_attention_torch(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor,  # [N+n, Hkv, D]
    lines: LineSet,  # H_l line heads (see lines.py)
    history_len: int,
    scale: float | None = None,  # default 1/sqrt(D)
    *,
    chunk: int = 512,  # query rows per block, at most
    sub_rows: int = SUB_ROWS,  # rows per near-part rectangle
    max_chunk_cells: int = 1 << 22,  # rows * far slashes per block, at most (memory)
    out: torch.Tensor | None = None,  # [n, Hq, D], q.dtype, written if given
    slash_kernel: bool | None = None,  # the C++ slash kernel; None: where it is available
) -> torch.Tensor:  # [n, Hq, D], q.dtype
    """Softmax attention over exactly the selected cells, on q's device."""
    dims = check_inputs(q, k, v, lines, history_len)
    if min(chunk, sub_rows, max_chunk_cells) < 1:
        raise ValueError(
            f"chunk ({chunk}), sub_rows ({sub_rows}) and max_chunk_cells "
            f"({max_chunk_cells}) must be >= 1"
        )
    scale = dims.head_dim**-0.5 if scale is None else scale
    n, lg, dev, num_keys = dims.n, dims.line_group, q.device, dims.num_keys
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != dev:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be like q {tuple(q.shape)}")
    if slash_kernel is None:
        slash_kernel = cpu_kernel.supported(q, dims.head_dim, lg)
    elif slash_kernel and not cpu_kernel.supported(q, dims.head_dim, lg):
        raise ValueError(
            f"the CPU slash kernel takes CPU tensors, head_dim in {cpu_kernel.HEAD_DIMS} and "
            f"1..{cpu_kernel.MAX_LINE_GROUP} query heads per line head, and must build; got "
            f"{q.device.type}, head_dim {dims.head_dim}, {lg} per line head"
        )
    if slash_kernel:
        for lh in range(lines.num_heads):
            _two_parts(q, k, v, lines, lh, lg, dims.group, history_len, scale, chunk, out)
        return out
    is_v_all, is_s_all = line_bitmaps(lines, num_keys, dev)  # [H_l, K]
    for lh in range(lines.num_heads):
        heads = slice(lh * lg, (lh + 1) * lg)  # this line head's query heads
        kvh = lh * lg // dims.group
        kh, vh = k[:, kvh], v[:, kvh]  # [K, D]
        is_v = is_v_all[lh]
        vert_host, sl_host = lines.vertical[lh], lines.slash[lh]  # CPU: bounds, no syncs
        vert = vert_host.to(dev)
        w = near_width(sl_host, num_keys, sub_rows)
        near_s = is_s_all[lh].clone()
        near_s[w:] = False  # offsets the rectangles own
        far_host = sl_host[int(torch.searchsorted(sl_host, w)):]
        far = far_host.to(dev)
        vf = k_t = None
        if far.numel():  # fp32 copies for the SDDMM part only
            vf = vh.float().contiguous()
            k_t = kh.float().contiguous().t()  # sampled_addmm's layout: no copy per call
        lead = w - 1
        k_pad = torch.nn.functional.pad(kh, (0, 0, lead, sub_rows))  # rectangles' source
        v_pad = torch.nn.functional.pad(vh, (0, 0, lead, sub_rows))
        rows = max(1, min(chunk, max_chunk_cells // max(1, far.numel())))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            p0, p1 = history_len + r0, history_len + r1 - 1  # first / last query position
            qb = q[r0:r1, heads].transpose(0, 1)  # [lg, R, D]
            parts = [_near_part(qb, k_pad, v_pad, lead, is_v, near_s, w, p0, sub_rows,
                                num_keys, scale)]
            part_v = _far_verticals(qb, kh, vh, vert, vert_host, w, p0, sub_rows, scale)
            if part_v is not None:
                parts.append(part_v)

            ns = int(torch.searchsorted(far_host, p1, right=True))  # offsets d <= p1 reach
            if ns:
                pos = torch.arange(p0, p1 + 1, device=dev)
                idx = pos[:, None] - far[None, :ns]  # [R, ns]
                drop = idx < 0
                idx.clamp_(min=0)
                drop |= is_v[idx]  # the other parts own cells on verticals
                s_f = _sddmm(qb.float() * scale, k_t, idx).masked_fill_(drop, NEG_INF)
                lse_f = torch.logsumexp(s_f, -1)  # [lg, R]
                p_f = torch.exp_(s_f.sub_(lse_f.masked_fill(torch.isinf(lse_f), 0.0)[..., None]))
                o_f = torch.stack(
                    [embedding_bag(idx, vf, per_sample_weights=p_f[h], mode="sum") for h in range(lg)]
                )
                parts.append((o_f, lse_f))
            out[r0:r1, heads] = merge_partials(parts).transpose(0, 1).to(out.dtype)
    return out


def _two_parts(q, k, v, lines, lh, lg, group, history_len, scale, chunk, out):
    """One line head with the C++ slash kernel, per row block ``p0..p1``: the kernel
    takes the slashes and the verticals inside the block (causal per row); one
    unmasked fused call takes the verticals ``<= p0``, which every row sees."""
    n = q.shape[0]
    heads = slice(lh * lg, (lh + 1) * lg)
    kvh = lh * lg // group
    kh, vh = k[:, kvh], v[:, kvh]
    slash, vert = lines.slash[lh], lines.vertical[lh]
    owned = torch.zeros(k.shape[0], dtype=torch.bool)  # the verticals: the other part's
    owned[vert] = True
    inputs = cpu_kernel.SlashInputs(kh, vh, owned)
    k_v, v_v = kh[vert][None], vh[vert][None]  # [1, n_v, D]: a block uses a prefix
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        p0, p1 = history_len + r0, history_len + r1 - 1
        qb = q[r0:r1, heads].transpose(0, 1)  # [lg, R, D]
        parts = []
        nv = int(torch.searchsorted(vert, p0, right=True))  # columns every row sees
        if nv:
            o, lse = fused_attention(qb[None], k_v[:, :nv], v_v[:, :nv], None, scale)
            parts.append((o[0], lse[0]))
        ns = int(torch.searchsorted(slash, p1, right=True))  # offsets some row reaches
        tail = vert[nv:int(torch.searchsorted(vert, p1, right=True))]
        if ns or tail.numel():
            parts.append(cpu_kernel.slash_attention(qb, inputs, slash[:ns], tail, p0, scale))
        if parts:
            out[r0:r1, heads] = merge_partials(parts).transpose(0, 1).to(out.dtype)
        else:  # no selected cell in any row of the block
            out[r0:r1, heads] = 0
