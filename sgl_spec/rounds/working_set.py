"""What a request attends at the upper layers in round mode, as the sparse decode kernels'
``DecodeSubsets`` over the upper tier's buffers (docs/design/round-attention.md).

A request's working set is the system prompt's round (round 0), the rounds its question
selected at L_w, and its current round (the question and the answer so far). Over the upper
buffers that is: ``req_to_token`` rows translated to upper slots (``UpperSlots``), the kept
rounds' positions as the selection, and the current round as the recent window (no sink:
round 0 is a kept round). Every implementation of ``sgl_spec.kernels.sparse_decode`` then
attends it (C++ CPU, Triton, FlashInfer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_spec.kernels.sparse_decode import DecodeSubsets
from sgl_spec.tiers.working_set import UpperSlots


def kept_positions(spans: Sequence[tuple[int, int]], kept: Sequence[int]) -> torch.Tensor:
    """Positions of the rounds ``kept`` (indices into ``spans``, each [start, end)),
    ascending: [n] int64."""
    parts = [torch.arange(*spans[i], dtype=torch.int64) for i in sorted(set(kept))]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def subsets(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
            kept: Sequence[torch.Tensor], current_start: torch.Tensor, slots: UpperSlots,
            num_kv_heads: int) -> DecodeSubsets:
    """The upper layers' subsets of a decode batch.

    req_to_token: [max_reqs, max_context] int32, full-pool slots (sglang's);
    rows, seq_lens, current_start: [B] int64 (the current round runs from
    ``current_start`` to ``seq_len``); kept: B tensors of positions (``kept_positions``),
    each before ``current_start``. Every attended token must have an upper slot: a
    ValueError names the request and position otherwise (a round not loaded)."""
    bsz = rows.numel()
    if len(kept) != bsz or seq_lens.numel() != bsz or current_start.numel() != bsz:
        raise ValueError(f"{bsz} rows but {len(kept)} kept lists, {seq_lens.numel()} "
                         f"lengths, {current_start.numel()} round starts")
    upper = slots.translate(req_to_token.index_select(0, rows).long()).to(torch.int32)
    width = max((k.numel() for k in kept), default=0)
    sel = torch.full((bsz, num_kv_heads, width), -1, dtype=torch.int64)
    for b, pos in enumerate(kept):
        n, cur = int(seq_lens[b]), int(current_start[b])
        if pos.numel() and int(pos.max()) >= cur:
            raise ValueError(f"request {b}: kept position {int(pos.max())} is in its current "
                             f"round (from {cur})")
        attended = torch.cat([pos, torch.arange(cur, n)])
        missing = attended[upper[b, attended] < 0]
        if missing.numel():
            raise ValueError(f"request {b}: positions {missing.tolist()[:8]} have no upper "
                             "slot (their round is not loaded)")
        sel[b, :, : pos.numel()] = pos
    lens = torch.tensor([k.numel() for k in kept], dtype=torch.int64)
    return DecodeSubsets(upper, torch.arange(bsz, dtype=torch.int64), seq_lens.long(), sel,
                         lens[:, None].expand(bsz, num_kv_heads).contiguous(),
                         current_start.long(), 0)
