"""LoopServe online prefill sparsification, kernel layer (LoopServe §5.2).

Per extend (``n`` new queries over ``N = history_len`` cached tokens) and layer:

1. ``select_lines(q, k, history_len, SelectConfig(alpha=...))`` samples queries and
   picks vertical and slash lines covering ``alpha`` of their attention (Alg. 2);
2. ``vslash_attention(q, k, v, lines, history_len, scale, impl=...)`` computes
   attention over exactly the selected cells (softmax normalised over them only).

Implementations (same contract, ``reference`` is the oracle the tests use):

* ``"reference"``: dense masked attention, float64 (``reference.py``);
* ``"torch"``: line-sparse torch ops, the CPU path (``torch_impl.py``);
* ``"triton"``: MInference-style vertical+slash Triton kernel over a host-built
  index (``index.build_index``, ``triton_impl.py``); Triton imports lazily.

``recovered_mass`` reports the fraction of the full attention the lines keep. No
server wiring here: the attention backend's extend path calls these functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .index import VSlashIndex, build_index
from .lines import LineSet, band_and_sink, density, line_cells, make_lines
from .select import SelectConfig, recovered_mass, sample_queries, select_lines

# name -> "module:function", imported on first use (triton only when asked for).
_IMPLS: dict[str, str] = {
    "reference": "reference:vslash_attention_ref",
    "torch": "torch_impl:vslash_attention_torch",
    "triton": "triton_impl:vslash_attention_triton",
}


def get_impl(impl: str) -> Callable[..., torch.Tensor]:
    """The implementation registered as ``impl``; ValueError lists the valid names."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown vslash impl {impl!r}; valid: {sorted(_IMPLS)}")
    module, fn = _IMPLS[impl].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), fn)


def vslash_attention(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor,  # [N+n, Hkv, D]
    lines: LineSet,  # H_l line heads (Hkv or Hq)
    history_len: int,  # N
    scale: float | None = None,  # default 1/sqrt(D)
    impl: str = "torch",
) -> torch.Tensor:  # [n, Hq, D], q.dtype
    """Causal attention of the new queries over the selected lines only."""
    return get_impl(impl)(q, k, v, lines, history_len, scale)


__all__ = [
    "LineSet",
    "SelectConfig",
    "VSlashIndex",
    "band_and_sink",
    "build_index",
    "density",
    "get_impl",
    "line_cells",
    "make_lines",
    "recovered_mass",
    "sample_queries",
    "select_lines",
    "vslash_attention",
]
