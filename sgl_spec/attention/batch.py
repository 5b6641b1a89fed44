"""One forward pass as sgl_spec's attention path sees it.

The integration builds a ``BatchView`` from sglang's ForwardBatch once per pass
(``init_forward_metadata``); the planners (``decode.Decoder``, ``prefill``) read only
this. Host-side lists are for per-request bookkeeping, device tensors for kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("decode", "extend", "other")


@dataclass(frozen=True)
class BatchView:
    mode: str  # "decode", "extend" (prefill chunks, mixed batches) or "other" (idle, ...)
    rids: tuple[str, ...] = ()
    seq_lens: tuple[int, ...] = ()  # per request: prefix + this pass's tokens
    pool_rows: tuple[int, ...] = ()  # per request: its req_to_token row
    extend_lens: tuple[int, ...] = ()  # extend: this pass's new tokens per request
    final_chunk: bool = True  # extend: some request's prompt ends in this pass
    req_to_token: torch.Tensor | None = None  # [max_reqs, max_context] int32, device
    rows: torch.Tensor | None = None  # [B] int64 device: pool_rows
    seq_lens_t: torch.Tensor | None = None  # [B] int64 device: seq_lens
    input_ids: torch.Tensor | None = None  # [T] device: the pass's tokens (decode: T = B)
    out_cache_loc: torch.Tensor | None = None  # [T] device: their KV pool slots

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is invalid; valid: {', '.join(MODES)}")
        n = len(self.rids)
        if len(self.seq_lens) != n or len(self.pool_rows) != n:
            raise ValueError(f"{n} rids, {len(self.seq_lens)} seq_lens and "
                             f"{len(self.pool_rows)} pool rows must match")
        if self.mode == "extend" and len(self.extend_lens) != n:
            raise ValueError(f"an extend pass of {n} requests has {len(self.extend_lens)} "
                             "extend lengths")

    @property
    def size(self) -> int:
        return len(self.rids)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(s - e for s, e in zip(self.seq_lens, self.extend_lens))
