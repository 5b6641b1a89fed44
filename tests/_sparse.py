"""Shared pieces of the sparse-decode tests: an attention shape the C++ kernel is
instantiated for, a NaN-poisoned fake KV pool, and a policy driven the way the
decoder drives it."""

from __future__ import annotations

import torch

from sgl_spec.sparse import AttnShape, Kind

SHAPE = AttnShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=32)


class FakePool:
    """A KV pool of one layer per ``SHAPE.num_layers``, rows of req_to_token per request."""

    def __init__(self, slots: int = 2048, max_ctx: int = 512, seed: int = 0,
                 contiguous: bool = False, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.gen = torch.Generator().manual_seed(seed)  # draws on the CPU, on any device
        hkv, d = SHAPE.num_kv_heads, SHAPE.head_dim
        nan = float("nan")
        kw = dict(device=device, dtype=dtype)
        self.k = [torch.full((slots, hkv, d), nan, **kw) for _ in range(SHAPE.num_layers)]
        self.v = [torch.full((slots, hkv, d), nan, **kw) for _ in range(SHAPE.num_layers)]
        self.req_to_token = torch.zeros(8, max_ctx, dtype=torch.int32, device=device)
        # Scattered slots by default; contiguous: each request's run is one block.
        order = torch.arange(slots) if contiguous else torch.randperm(slots, generator=self.gen)
        self.free = order.flip(0).tolist()
        self.lens: dict[int, int] = {}

    def append(self, row: int, n: int = 1, keys=None) -> None:
        """Write K/V of ``n`` new positions of request ``row``; keys(layer, pos) -> [Hkv, D]."""
        start = self.lens.get(row, 0)
        for pos in range(start, start + n):
            slot = self.free.pop()
            self.req_to_token[row, pos] = slot
            for layer in range(SHAPE.num_layers):
                k = keys(layer, pos) if keys else 0.5 * torch.randn(
                    SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen)
                self.k[layer][slot] = k
                self.v[layer][slot] = torch.randn(
                    SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen)
        self.lens[row] = start + n

    def history(self, layer: int, row: int) -> torch.Tensor:  # [seq_len, Hkv, D]
        return self.k[layer][self.req_to_token[row, : self.lens[row]].long()]


def decode_step(pol, rid, seq_len, q_of, keys_of, num_layers: int = SHAPE.num_layers):
    """One decode step of one request, as the decoder drives it. Returns the RowStep
    and, for a sparse row, each layer's selection [Hkv, width]."""
    row = pol.step(rid, seq_len)
    slot = torch.tensor([pol.state(rid).slot])
    sels = []
    for layer in range(num_layers):
        if row.observe >= 0:
            pol.observe(layer, q_of(layer)[None], slot, torch.tensor([row.observe]))
        if row.reselect:
            pol.reselect(layer, keys_of(layer)[:seq_len][None], pol.reselect_batch([rid], "cpu"))
        if row.kind == Kind.SPARSE:
            sels.append(pol.selection(layer, slot)[0])
    return row, sels
