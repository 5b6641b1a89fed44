"""Sparse decode attention with a KV budget: attend to sink + selection + recent window.

``sparse_decode(...)`` dispatches to one implementation:

* ``torch``: batched gathers and matmuls, the CPU path (``torch_impl``);
* ``triton``: one Triton program per (request, KV head) (``triton_impl``); CUDA, or
  CPU under ``TRITON_INTERPRET=1``;
* ``flashinfer``: FlashInfer's paged decode with one page list per (request, KV head)
  (``flashinfer_impl``); CUDA only. A serving loop that runs many layers per batch
  keeps a ``FlashInferSparseDecode`` (plan once, run per layer) instead.

``reference.sparse_decode_reference`` is the slow per-head oracle the tests compare
every implementation with. The subset contract (what is attended, what may overlap)
is in ``common``. Implementations are imported on first use (triton, flashinfer are
heavy and optional).
"""

from __future__ import annotations

import importlib

import torch

from .common import check_inputs, subset_positions

# impl name -> (module, function)
_IMPLS = {
    "torch": ("torch_impl", "sparse_decode_torch"),
    "triton": ("triton_impl", "sparse_decode_triton"),
    "flashinfer": ("flashinfer_impl", "sparse_decode_flashinfer"),
}
IMPLS = tuple(_IMPLS)

__all__ = ["IMPLS", "check_inputs", "sparse_decode", "subset_positions"]


def sparse_decode(
    q: torch.Tensor,  # [B, Hq, D], fp32 / fp16 / bf16
    k_buf: torch.Tensor,  # [num_slots, Hkv, D], one layer's K pool
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv], one layer's V pool
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32: (req row, position) -> slot
    req_pool_indices: torch.Tensor,  # [B] int64: each request's req_to_token row
    seq_lens: torch.Tensor,  # [B] int64: history incl. the current token (K/V written)
    sel_idx: torch.Tensor,  # [B, Hkv, max_sel] int64 positions, padding -1
    sel_len: torch.Tensor,  # [B, Hkv] int64: valid prefix length of sel_idx
    recent_start: torch.Tensor,  # [B] int64: first position of the recent window
    *,
    sink: int,  # positions [0, sink) are always attended
    scale: float,  # softmax scale (sm_scale), usually head_dim ** -0.5
    impl: str = "torch",
    out: torch.Tensor | None = None,  # [B, Hq, Dv], q.dtype, written if given
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    """Decode attention of one layer over each (request, KV head)'s subset.

    All tensors live on q's device. Softmax is exact over the subset (fp32). The
    subset is sink ∪ selection ∪ recent window, disjoint by contract (``common``).
    Nothing but ``out`` is written.
    """
    if impl not in _IMPLS:
        raise ValueError(f"sparse decode impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
    module, name = _IMPLS[impl]
    fn = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return fn(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
        sel_idx, sel_len, recent_start, sink=sink, scale=scale, out=out,
    )
