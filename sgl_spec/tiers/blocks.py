"""A round's upper-layer KV as one contiguous host block (Round Attention, Sec. 3.2:
``u_m`` moves as one tensor, never per token).

``store`` gathers a round's rows from the upper tier's buffers into one host tensor
``[layers, 2, tokens, kv_heads, head_dim]`` (K then V, the pool's dtype); ``load`` copies a
block back into given upper slots. On a GPU the block is pinned and both copies are
issued on the current stream without waiting: device work queued after ``store`` (a new
round's writes into the freed slots) runs after the copy, and a host reader of the block
calls ``wait()`` first. On a CPU both are memory copies.

Who owns what: a block owns its host tensor; the buffers belong to the pool. The caller
assigns and releases the upper slots (``working_set.UpperSlots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)  # a block is itself: hashed and compared by identity
class RoundBlock:
    data: torch.Tensor  # [layers, 2, tokens, kv_heads, head_dim], pool dtype, host
    ready: torch.cuda.Event | None = None  # recorded after the device-to-host copy
    unused: int = 0  # questions in a row whose selection did not keep it (Sec. 3.4)
    dropped: bool = False  # its rows were freed: nothing loads it again

    def drop(self) -> None:
        """Free the host rows (Sec. 3.4); the block stays a (0-byte) placeholder so the
        histories that refer to it keep their positions."""
        self.wait()
        self.data, self.ready, self.dropped = self.data[:, :, :0].clone(), None, True

    def wait(self) -> None:
        """Block the host until ``data`` holds the stored rows (a no-op on a CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def tokens(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def store(k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor],
          upper: torch.Tensor) -> RoundBlock:
    """One block holding rows ``upper`` ([n] int64) of every upper layer's buffers
    (``k_bufs[l]``, ``v_bufs[l]``: [slots, kv_heads, head_dim], one dtype and device)."""
    k = torch.stack([b.index_select(0, upper) for b in k_bufs])  # [L, n, H, D]
    v = torch.stack([b.index_select(0, upper) for b in v_bufs])
    data = torch.stack([k, v], dim=1)                             # [L, 2, n, H, D]
    if data.is_cuda:
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return RoundBlock(host, ready)
    return RoundBlock(data.contiguous())


def load(block: RoundBlock, k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor],
         upper: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Copy ``block`` (its token ``rows`` ([n] int64), all by default) into rows ``upper``
    ([n] int64) of every upper layer: one copy of the block to the device, then one
    indexed copy per layer."""
    if block.dropped:
        raise ValueError("a dropped round's block has no rows to load")
    n = block.tokens if rows is None else rows.numel()
    if upper.numel() != n or len(k_bufs) != block.data.shape[0]:
        raise ValueError(f"{n} rows of a block of {block.tokens} tokens x "
                         f"{block.data.shape[0]} layers into {upper.numel()} slots x "
                         f"{len(k_bufs)} layers")
    block.wait()
    dev = block.data.to(k_bufs[0].device, non_blocking=True)  # one copy of the round
    if rows is not None:
        dev = dev.index_select(2, rows.to(dev.device))
    for layer, (kb, vb) in enumerate(zip(k_bufs, v_bufs, strict=True)):
        kb.index_copy_(0, upper, dev[layer, 0])
        vb.index_copy_(0, upper, dev[layer, 1])
