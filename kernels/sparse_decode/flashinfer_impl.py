"""Sparse decode on FlashInfer's paged decode kernel (CUDA only).

Trick: page_size 1 and one "request" per (request, KV head) pair. The pool
``k_buf [num_slots, Hkv, D]`` is viewed as ``[num_slots * Hkv, 1, 1, D]`` pages, so
page ``slot * Hkv + h`` holds KV head h of one slot; pair (b, h) gets its own page
list (its subset) and the G query heads of its group as query heads, with one KV
head. FlashInfer then does exact softmax over each pair's list.

``plan()`` does the host-side work once per batch: page counts, indptr, and the page
ids of the sink and recent window (the same in every layer). ``run()`` per layer
only scatters that layer's selected pages into the index buffer and launches.
Because of that split, ``sel_len`` is fixed at ``plan()``: every layer's selection
must have the same lengths (the policies guarantee it: a request's selection is
``min(budget, recent_start - sink)`` long in every layer and head).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import DecodeSubsets, Dims

# Group sizes FlashInfer's CUDA-core decode kernel is compiled for; others go
# through its tensor-core (prefill) kernel.
_CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8)
_WORKSPACE_BYTES = 128 << 20
_workspaces: dict[torch.device, torch.Tensor] = {}


def _import_flashinfer():
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the flashinfer sparse-decode impl needs a CUDA GPU; valid impls "
            "without one: torch, triton (TRITON_INTERPRET=1)"
        )
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(
            "the flashinfer sparse-decode impl needs the flashinfer package "
            "(flashinfer-python, as pinned by sglang); valid impls without it: "
            "torch, triton"
        ) from exc
    return flashinfer


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class PagePlan(NamedTuple):
    """Page lists of all (request, KV head) pairs, pair p = b * Hkv + h."""

    indptr: torch.Tensor  # [B * Hkv + 1] int32
    indices: torch.Tensor  # [nnz] int32 page ids slot * Hkv + h; selection filled per layer
    sel_at: torch.Tensor  # [n] int64: entries of `indices` that hold selected pages
    sel_src: torch.Tensor  # [n] int64: their element of sel_idx (flat, width `sel_width`)
    sel_base: torch.Tensor  # [n] int64: their req_to_token row's first element (flat)
    sel_head: torch.Tensor  # [n] int32: their KV head
    sel_width: int  # sel_idx.shape[2] the flat indices were made for


def build_pages(sub: DecodeSubsets, num_kv_heads: int) -> PagePlan:
    """The layer-independent part of the page lists (pure torch, any device).

    Each pair's list is its virtual list ``sink | selection | recent window``; the
    selection entries hold a placeholder (the current token's page) until
    ``fill_selected`` writes a layer's selection.
    """
    dev, hkv = sub.seq_lens.device, num_kv_heads
    bsz = len(sub.seq_lens)
    seq = sub.seq_lens.long()
    sink_end = seq.clamp(max=sub.sink)  # [B]
    recent = torch.maximum(sub.recent_start.long(), sink_end)  # [B]
    n_sel = sub.sel_len.long()  # [B, Hkv]
    counts = ((sink_end + seq - recent)[:, None] + n_sel).reshape(-1)  # [B * Hkv]
    indptr = torch.zeros(bsz * hkv + 1, dtype=torch.int32, device=dev)
    indptr[1:] = counts.cumsum(0)
    nnz = int(indptr[-1])  # host sync, once per batch

    pair = torch.repeat_interleave(
        torch.arange(bsz * hkv, device=dev), counts, output_size=nnz
    )  # [nnz] pair of each entry
    j = torch.arange(nnz, device=dev) - indptr[:-1].long()[pair]  # offset in its list
    b, h = pair // hkv, pair % hkv
    s_end = sink_end[b]
    sel_end = s_end + n_sel.reshape(-1)[pair]
    is_sel = (j >= s_end) & (j < sel_end)
    pos = torch.where(j < s_end, j, recent[b] + (j - sel_end))
    pos = torch.where(is_sel, seq[b] - 1, pos)
    rows = sub.rows.long()[b]
    indices = (sub.req_to_token[rows, pos].long() * hkv + h).to(torch.int32)
    sel_at = is_sel.nonzero().squeeze(1)
    width = sub.sel_idx.shape[2]
    return PagePlan(
        indptr, indices, sel_at, pair[sel_at] * width + (j - s_end)[sel_at],
        rows[sel_at] * sub.req_to_token.shape[1], h[sel_at].to(torch.int32), width,
    )


def fill_selected(
    pages: PagePlan,
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    sel_idx: torch.Tensor,  # [B, Hkv, sel_width] int64
    num_kv_heads: int,
) -> None:
    """Write one layer's selected pages into ``pages.indices`` (in place, no sync).

    Six small kernels over flat indices made at plan time: per layer this runs 30+
    times a step, where launches, not bytes, are the cost (docs/specontext.md, GPU).
    """
    if len(pages.sel_at):
        if sel_idx.shape[2] != pages.sel_width:
            raise ValueError(f"sel_idx width {sel_idx.shape[2]} is not the planned "
                             f"{pages.sel_width}")
        pos = sel_idx.reshape(-1).index_select(0, pages.sel_src)
        slots = req_to_token.view(-1).index_select(0, pos.add_(pages.sel_base))
        pages.indices.index_copy_(0, pages.sel_at,
                                  slots.mul_(num_kv_heads).add_(pages.sel_head))


class FlashInferSparseDecode:
    """Plan once per batch, run once per layer. Not thread-safe; owns its buffers.

    The workspace buffer (128 MiB, per device) is shared by all instances on a
    device, as FlashInfer's wrappers share theirs; run one at a time per stream.
    """

    def __init__(self, device: torch.device | str = "cuda", use_tensor_cores: bool | None = None):
        self._fi = _import_flashinfer()
        self.device = torch.device(device)
        self._use_tensor_cores = use_tensor_cores
        self._wrappers: dict[bool, object] = {}
        self._planned = False

    def _wrapper(self, tensor_cores: bool):
        if tensor_cores not in self._wrappers:
            self._wrappers[tensor_cores] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(self.device), "NHD", use_tensor_cores=tensor_cores
            )
        return self._wrappers[tensor_cores]

    def plan(
        self,
        sub: DecodeSubsets,  # cuda; its sel_len is fixed for every layer's run()
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of {num_kv_heads}")
        bsz, hkv = len(sub.seq_lens), num_kv_heads
        group = num_q_heads // hkv
        self._pages = build_pages(sub, hkv)
        self._tensor_cores = (
            self._use_tensor_cores
            if self._use_tensor_cores is not None
            else group not in _CUDA_CORE_GROUPS
        )
        self._plan_args = (
            self._pages.indptr,
            self._pages.indices,
            torch.ones(bsz * hkv, dtype=torch.int32, device=self.device),
        )
        self._plan_kwargs = dict(
            num_qo_heads=group,
            num_kv_heads=1,
            head_dim=head_dim,
            page_size=1,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
        )
        wrapper = self._wrapper(self._tensor_cores)
        wrapper.plan(*self._plan_args, **self._plan_kwargs)
        # Without CUDA graphs the wrapper keeps a reference to our index tensor, so
        # run() can update it in place; if a FlashInfer version copies it, re-plan.
        self._aliased = getattr(wrapper, "_paged_kv_indices_buf", None) is self._pages.indices
        self._req_to_token = sub.req_to_token
        self._shape = (bsz, num_q_heads, hkv, head_dim)
        self._planned = True

    def run(
        self,
        q: torch.Tensor,  # [B, Hq, D], q_dtype
        k_buf: torch.Tensor,  # [num_slots, Hkv, D], kv_dtype, contiguous
        v_buf: torch.Tensor,  # [num_slots, Hkv, D], kv_dtype, contiguous
        sel_idx: torch.Tensor,  # [B, Hkv, max_sel] int64; lengths as planned
        out: torch.Tensor | None = None,  # [B, Hq, D], q.dtype, written if given
    ) -> torch.Tensor:  # [B, Hq, D], q.dtype
        if not self._planned:
            raise RuntimeError("FlashInferSparseDecode.run() before plan()")
        bsz, hq, hkv, d = self._shape
        if tuple(q.shape) != (bsz, hq, d):
            raise ValueError(f"q {tuple(q.shape)} does not match the plan [{bsz}, {hq}, {d}]")
        if k_buf.shape[1:] != (hkv, d) or v_buf.shape[1:] != (hkv, d):
            raise ValueError(
                f"k_buf {tuple(k_buf.shape)} / v_buf {tuple(v_buf.shape)} must be "
                f"[slots, {hkv}, {d}] (FlashInfer needs equal K and V head dims)"
            )
        if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("k_buf and v_buf must be contiguous to be viewed as pages")
        fill_selected(self._pages, self._req_to_token, sel_idx, hkv)
        wrapper = self._wrapper(self._tensor_cores)
        if not self._aliased:
            wrapper.plan(*self._plan_args, **self._plan_kwargs)
        group = hq // hkv
        pages_k = k_buf.view(-1, 1, 1, d)  # [num_slots * Hkv, page 1, 1 head, D]
        pages_v = v_buf.view(-1, 1, 1, d)
        q_pairs = q.reshape(bsz * hkv, group, d)
        if out is not None and (tuple(out.shape) != (bsz, hq, d) or not out.is_contiguous()):
            raise ValueError(f"out {tuple(out.shape)} must be a contiguous [{bsz}, {hq}, {d}]")
        o = wrapper.run(
            q_pairs,
            (pages_k, pages_v),
            out=None if out is None else out.view(bsz * hkv, group, d),
        )  # [B * Hkv, G, D]
        return o.view(bsz, hq, d) if out is None else out


def sparse_decode_flashinfer(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, D]
    sub: DecodeSubsets,
    dims: Dims,
    *,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:  # [B, Hq, D], q.dtype
    """One-shot plan + run; a serving loop keeps a ``FlashInferSparseDecode`` instead."""
    runner = FlashInferSparseDecode(q.device)
    runner.plan(
        sub, num_q_heads=dims.num_q_heads, num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim, scale=scale, q_dtype=q.dtype, kv_dtype=k_buf.dtype,
    )
    return runner.run(q, k_buf, v_buf, sub.sel_idx, out=out)


def _warm(dtype: str, head_dim: int, group: int) -> None:
    """Build (JIT) and check the kernel variant for one dtype, head_dim and GQA group:
    a dense decode over random data against the float64 reference."""
    import time

    from .common import dense_subsets
    from .reference import sparse_decode_reference

    dt, hkv, bsz, n = getattr(torch, dtype), 2, 2, 96
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(4 * n, hkv, head_dim, generator=g) for _ in range(2))
    q = torch.randn(bsz, hkv * group, head_dim, generator=g)
    r2t = torch.randperm(4 * n, generator=g)[: bsz * n].view(bsz, n).int()
    sub = dense_subsets(r2t, torch.arange(bsz), torch.full((bsz,), n), hkv)
    # the reference of the values the kernel sees (rounded to dtype), in float32
    ref = sparse_decode_reference(*(t.to(dt).float() for t in (q, k, v)), sub,
                                  scale=head_dim**-0.5).double()
    cuda = lambda t: t.to("cuda", dt)  # noqa: E731
    sub_c = sub._replace(**{f: getattr(sub, f).cuda() for f in
                            ("req_to_token", "rows", "seq_lens", "sel_idx", "sel_len",
                             "recent_start")})
    t0 = time.perf_counter()
    runner = FlashInferSparseDecode("cuda")
    runner.plan(sub_c, num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=head_dim,
                scale=head_dim**-0.5, q_dtype=dt, kv_dtype=dt)
    out = runner.run(cuda(q), cuda(k), cuda(v), sub_c.sel_idx)
    torch.cuda.synchronize()
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    print(f"built {dtype} head_dim {head_dim} group {group} "
          f"(tensor cores: {runner._tensor_cores}) in {time.perf_counter() - t0:.1f} s; "
          f"rel. err {err:.1e}")
    if not err <= 2e-2:
        raise SystemExit(f"rel. err {err} over 2e-2")


if __name__ == "__main__":  # python -m ...flashinfer_impl --warm DTYPE HEAD_DIM GROUP
    import argparse

    ap = argparse.ArgumentParser(description=_warm.__doc__)
    ap.add_argument("--warm", nargs=3, metavar=("DTYPE", "HEAD_DIM", "GROUP"), required=True)
    a = ap.parse_args()
    _warm(a.warm[0], int(a.warm[1]), int(a.warm[2]))
