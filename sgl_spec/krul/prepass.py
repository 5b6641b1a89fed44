"""The recompute half of a restore (Krul Sec 6): the pyramid pre-pass.

A restored conversation of n tokens has its first D tokens' KV on the device (a prefix
that stayed hot) and, at layer l, no stored rows for positions [D, U_l). The pre-pass
runs the model's layers on tokens [D, R_0) and, at layer l, keeps only the first
R_l - D rows of the hidden state (the paper's ``tensor[:target_length]``): R is
non-increasing (``pyramid.restore_lengths``), so layer l's input for those rows is what
layer l-1 computed. Each layer writes its K/V for [D, R_l) and attends causally over
[0, R_l); the rows past R_l come from the tier (the loader), and nothing after the
pre-pass reads a hidden state.

``run`` is the loop; the model enters through ``LayerOps`` (the integration binds
sglang's modules; a test binds a transformers model), the KV pool through two
callables. Pure torch, no sglang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class LayerOps(Protocol):
    """One model's pieces, as the forward pass applies them."""

    num_layers: int

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...            # [m] -> [m, hidden]

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input-normed hidden [m, hidden] -> q [m, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv],
        RoPE applied."""

    def attn_out(self, layer: int, o: torch.Tensor) -> torch.Tensor: ...  # [m, Hq, Dv] -> [m, hidden]

    def norm(self, layer: int, which: int, h: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm ``which`` (0: before attention, 1: before the MLP) of h + residual
        (residual None: h alone); returns (normed, the new residual)."""

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor: ...

    def scale(self, layer: int) -> float: ...


# attend(layer, q [m, Hq, D], end) -> [m, Hq, Dv]: queries at positions [D, D + m) over
# the layer's keys [0, end) with a causal offset of D (the pool holds them once written).
Attend = Callable[[int, torch.Tensor, int], torch.Tensor]
# write(layer, start, k, v): the layer's K/V rows for positions [start, start + len(k)).
Write = Callable[[int, int, torch.Tensor, torch.Tensor], None]


def run(ops: LayerOps, ids: torch.Tensor, device_prefix: int, lengths: Sequence[int],
        write: Write, attend: Attend) -> int:
    """Recompute layer l's KV for positions [device_prefix, lengths[l]); ``ids`` are the
    tokens [device_prefix, lengths[0]). Returns the token-layers computed."""
    D = device_prefix
    if len(lengths) > ops.num_layers:
        raise ValueError(f"{len(lengths)} lengths for a model of {ops.num_layers} layers")
    if any(a < b for a, b in zip(lengths, lengths[1:])) or (lengths and lengths[-1] < D):
        raise ValueError(f"lengths must be non-increasing and >= the device prefix {D}: "
                         f"{list(lengths)}")
    if not lengths or lengths[0] <= D:
        return 0
    if ids.numel() != lengths[0] - D:
        raise ValueError(f"{ids.numel()} token ids for positions [{D}, {lengths[0]})")
    h = ops.embed(ids)
    residual = None
    positions = torch.arange(D, lengths[0], device=ids.device)
    done = 0
    for layer, end in enumerate(lengths):
        x, residual = ops.norm(layer, 0, h, residual)
        q, k, v = ops.qkv(layer, x, positions)
        write(layer, D, k, v)
        done += end - D
        # Only the rows the next layer recomputes go on (causal: they need keys < D + m).
        m = lengths[layer + 1] - D if layer + 1 < len(lengths) else 0
        if m <= 0:
            break
        q, residual, positions = q[:m], residual[:m], positions[:m]
        h = ops.attn_out(layer, attend(layer, q, D + m))
        x, residual = ops.norm(layer, 1, h, residual)
        h = ops.mlp(layer, x)
    return done
