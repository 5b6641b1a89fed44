"""Decode attention over a KV subset: sink + selection + recent window, or everything.

``sparse_decode(q, k_buf, v_buf, subsets, scale=...)`` reads the K/V of each
request's subset (``common.DecodeSubsets``, one argument object built once per
forward pass) from the paged pool and dispatches to one implementation:

* ``cpu``: the C++ kernel (``cpu_impl``), the CPU serving path; reads pool rows in
  place, exact softmax, split over threads;
* ``torch``: batched gathers and matmuls, or SDPA's fused kernel for dense subsets
  (``torch_impl``); any device, the fallback where the C++ kernel cannot be built;
* ``triton``: one Triton program per (request, KV head), or per key split of it
  where the batch is too small to fill the GPU, then a merge (``triton_impl``); CUDA,
  or CPU under ``TRITON_INTERPRET=1``;
* ``flashinfer``: FlashInfer's paged decode with one page list per (request, KV head)
  (``flashinfer_impl``); CUDA only. A serving loop that runs many layers per batch
  keeps a ``FlashInferSparseDecode`` (plan once, run per layer) instead.

``impl=None`` picks ``cpu`` where the C++ kernel takes the call, else ``torch``.
``reference.sparse_decode_reference`` is the slow per-head oracle the tests compare
every implementation with. Implementations are imported on first use.

``copy_rows(stage_k, stage_v, pool_k, pool_v, dst, src)`` moves SpeContext's elastic
loads of one layer (K and V rows, pool -> staging) in one C++ call on CPU, in one
Triton launch on a GPU, from the device pool or a layer pinned in host memory
(``triton_copy``; ``reference.copy_rows_reference`` elsewhere, and as the tests' oracle).
``head_logits(q, keys, req_to_token, rows, n_keys, n)`` scores the retrieval head's
keys in the pool with its queries, reading them in place (SpeContext's selection;
``reference.head_logits_reference``); None where the C++ kernel cannot take the call.
``history_mass(q, keys, scale, q_pos, k_len)`` and ``select_top(scores, lo, hi, budget,
width)`` are LoopServe's and SnapKV's scoring and selection in the C++ kernel (the torch
path and reference: ``sgl_spec.sparse.scoring``); None where it cannot take the call.
"""

from __future__ import annotations

import importlib
import logging

import torch

from .common import (
    DecodeSubsets,
    check_inputs,
    check_out,
    dense_subsets,
    dims_of,
    subset_positions,
    take_rows,
)

logger = logging.getLogger(__name__)
# Where the Triton kernel could not read a pinned host pool: why (then the reference).
HOST_COPY: dict[str, str | None] = {"fallback": None}

# impl name -> (module, function)
_IMPLS = {
    "cpu": ("cpu_impl", "sparse_decode_cpu"),
    "torch": ("torch_impl", "sparse_decode_torch"),
    "triton": ("triton_impl", "sparse_decode_triton"),
    "flashinfer": ("flashinfer_impl", "sparse_decode_flashinfer"),
}
IMPLS = tuple(_IMPLS)

__all__ = ["IMPLS", "DecodeSubsets", "check_inputs", "copy_rows", "default_impl",
           "dense_subsets", "head_logits", "history_mass", "select_top", "sparse_decode",
           "subset_positions", "take_rows"]

# Every implementation is ``fn(q, k_buf, v_buf, subsets, dims, *, scale, out)``: inputs
# checked and ``out`` allocated by ``sparse_decode``, which is the entry point.


def default_impl(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> str:
    """``cpu`` where the C++ kernel takes (q, k_buf, v_buf), else ``torch``."""
    from .cpu_impl import supported

    return "cpu" if supported(q, k_buf) and v_buf.shape[-1] == q.shape[-1] else "torch"


def sparse_decode(
    q: torch.Tensor,  # [B, Hq, D], fp32 / fp16 / bf16
    k_buf: torch.Tensor,  # [num_slots, Hkv, D], one layer's K pool
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv], one layer's V pool
    subsets: DecodeSubsets,  # what each request attends (all tensors on q's device)
    *,
    scale: float,  # softmax scale (sm_scale), usually head_dim ** -0.5
    impl: str | None = None,  # None: default_impl
    out: torch.Tensor | None = None,  # [B, Hq, Dv], q.dtype, written if given
    check: bool = True,  # False: the caller checked these subsets with these tensors
) -> torch.Tensor:  # [B, Hq, Dv], q.dtype
    """Decode attention of one layer over each (request, KV head)'s subset.

    Softmax is exact over the subset (fp32). Nothing but ``out`` is written. A serving
    loop checks the first layer of a pass and passes ``check=False`` for the others
    (the checks are Python work on every call).
    """
    if impl is None:
        impl = default_impl(q, k_buf, v_buf)
    fn = _impl_fn(impl)
    dims = check_inputs(q, k_buf, v_buf, subsets) if check else dims_of(q, k_buf, v_buf, subsets)
    out = check_out(out, q, dims) if check or out is None else out
    if dims.batch == 0:
        return out
    return fn(q, k_buf, v_buf, subsets, dims, scale=scale, out=out)


def copy_rows(stage_k: torch.Tensor, stage_v: torch.Tensor, pool_k: torch.Tensor,
              pool_v: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``stage.view(-1, D)[dst] = pool.view(-1, D)[src]`` for K and V: the C++ kernel
    for contiguous CPU buffers where it builds (indices checked); on a GPU the Triton
    kernel (``triton_copy``: one launch for K and V), which also reads a pool pinned in
    host memory (an offloaded layer) in place, with no host sync; else the reference."""
    from .cpu_impl import load_kernel
    from .reference import copy_rows_reference

    bufs = (stage_k, stage_v, pool_k, pool_v, dst, src)
    if all(t.device.type == "cpu" and t.is_contiguous() for t in bufs):
        mod = load_kernel()
        if mod is not None:
            mod.copy_rows(*bufs)
            return
    elif (stage_k.is_cuda and all(t.is_contiguous() for t in bufs)
          and (pool_k.is_cuda or (pool_k.is_pinned() and pool_v.is_pinned()
                                  and HOST_COPY["fallback"] is None))):
        from .triton_copy import copy_rows_triton

        try:
            copy_rows_triton(*bufs)
            return
        except (ValueError, RuntimeError) as exc:  # e.g. a driver that maps no host memory
            if pool_k.is_cuda:
                raise
            HOST_COPY["fallback"] = f"{type(exc).__name__}: {exc}"
            logger.warning("sgl_spec: the GPU cannot read the pinned host pool in place "
                           "(%s); host-pool loads gather on the host (a sync per layer)",
                           HOST_COPY["fallback"])
    copy_rows_reference(*bufs)


def head_logits(q: torch.Tensor, keys: torch.Tensor, req_to_token: torch.Tensor,
                rows: torch.Tensor, n_keys: torch.Tensor, n: int) -> torch.Tensor | None:
    """``[R, Hkv, G, n]`` fp32 logits ``q . k`` of each row's keys (positions
    ``[0, n_keys)`` through ``req_to_token``, ``-inf`` after) by the C++ kernel, read in
    place from the pool; None where it cannot take the call (the caller gathers)."""
    from .cpu_impl import load_kernel

    if q.device.type != "cpu" or keys.device.type != "cpu" or keys.stride(-1) != 1:
        return None
    mod = load_kernel()
    if mod is None or not mod.supported(keys.dtype, q.shape[-1], q.shape[1] // keys.shape[1]):
        return None
    return mod.head_scores(q.float().contiguous(), keys, req_to_token.int(),
                           rows.long().contiguous(), n_keys.long().contiguous(), n)


def history_mass(q: torch.Tensor, keys: torch.Tensor, scale: float,
                 q_pos: torch.Tensor | None, k_len: torch.Tensor | None) -> torch.Tensor | None:
    """``[R, Hkv, N]`` fp32: the attention each key of ``keys`` ``[R, N, Hkv, D]`` gets
    from the queries ``q`` ``[R, n, Hq, D]`` (``sgl_spec.sparse.scoring.score_history``'s
    contract), by the C++ kernel, which reads each key once; None where it cannot take
    the call."""
    from .cpu_impl import load_kernel

    rows, n, hq, d = q.shape
    big_n, hkv = keys.shape[1], keys.shape[2]
    if (q.device.type != "cpu" or keys.device.type != "cpu" or keys.stride(-1) != 1
            or d not in (32, 64, 128) or hq % hkv
            or keys.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    mod = load_kernel()
    if mod is None or not hasattr(mod, "history_mass"):
        return None
    g = hq // hkv
    # Slots (query, head of the group) per KV head, padded to a multiple of 8 with slots
    # that see nothing; each sees the keys up to its query's position and the row's end.
    slots = n * g
    pad = -slots % 8
    qg = (q.float() * scale).reshape(rows, n, hkv, g, d).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(rows, hkv, slots, d)
    if pad:
        qg = torch.cat([qg, qg.new_zeros(rows, hkv, pad, d)], dim=2)
    lim = torch.full((rows, n), big_n, dtype=torch.int64)
    if q_pos is not None:
        lim = torch.where(q_pos.cpu() >= 0, q_pos.cpu() + 1, 0).clamp_(max=big_n)
    if k_len is not None:
        lim = lim.minimum(k_len.cpu()[:, None])
    lim = lim.repeat_interleave(g, dim=1)
    if pad:
        lim = torch.cat([lim, lim.new_zeros(rows, pad)], dim=1)
    return mod.history_mass(qg.contiguous(), keys, lim.contiguous(), big_n)


def select_top(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: int,
               width: int) -> torch.Tensor | None:
    """``[R, Hkv, budget]`` int64 ascending: ``sgl_spec.sparse.scoring``'s ``look_ahead``
    (``width``) then ``select_topk(first_of_ties=True)`` in one C++ call; None where the
    kernel cannot take it."""
    from .cpu_impl import load_kernel

    if scores.device.type != "cpu" or scores.dtype != torch.float32:
        return None
    mod = load_kernel()
    if mod is None or not hasattr(mod, "select_top"):
        return None
    return mod.select_top(scores.contiguous(), lo.cpu().long().contiguous(),
                          hi.cpu().long().contiguous(), budget, width)


_FNS: dict[str, object] = {}


def _impl_fn(impl: str):
    fn = _FNS.get(impl)
    if fn is None:
        if impl not in _IMPLS:
            raise ValueError(f"sparse decode impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
        module, name = _IMPLS[impl]
        fn = _FNS[impl] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return fn
