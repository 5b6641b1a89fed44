"""Elastic loading of the selected KV into a compact per-request buffer (SpeContext Sec 5.4).

A request whose decode attends a selection keeps, per layer, a staging buffer of
``S = sink + budget + window`` rows per KV head holding the K/V of the positions it
attends (sink + selection + recent window). Each step only the positions that
entered the attended set (``S_now - S_last``, per KV head) are copied from the pool,
into the rows of the positions that left it; rows that stay are not touched.
Attention then reads the ``S`` staged rows as a dense, contiguous history. The set
is order-free, so the result is attention over exactly the subset the in-place
kernel would read (``tests``: the buffer equals a fresh gather of ``S_now``).

Because a SpeContext selection is known before the layers run (the retrieval head
runs first) and is the same for every layer, the loads of every layer are planned
once per pass (``plan``) and can be copied ahead of the compute (``prefetch``):
only the row of the token being decoded, whose K/V its own layer writes, is copied
in line (``ElasticPass.current``).

Staging rows live in the policy's slot table (buffers ``k_stage``/``v_stage``:
``[layers, capacity, S, Hkv, D]``, viewed per layer as a pool of ``capacity * S``
slots; ``staged``: ``[1, capacity, Hkv, S]`` positions, -1 empty). A request's rows
are its policy slot's, freed with it. Not thread-safe except as ``prefetch`` says.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_spec.kernels.sparse_decode import DecodeSubsets, copy_rows, dense_subsets


class Loads(NamedTuple):
    """Row copies of one pass, the same for every layer: flat ``[slot * Hkv + h]``
    rows of a layer's staging buffer <- of its pool buffer."""

    dst: torch.Tensor  # [M] int64 staging rows
    src: torch.Tensor  # [M] int64 pool rows

    @property
    def size(self) -> int:
        return int(self.dst.shape[0])

    def copy(self, stage_k: torch.Tensor, stage_v: torch.Tensor, pool_k: torch.Tensor,
             pool_v: torch.Tensor) -> None:
        """staging [cap * S, Hkv, D] <- pool [num_slots, Hkv, D], K and V (contiguous)."""
        if self.size:
            copy_rows(stage_k, stage_v, pool_k, pool_v, self.dst, self.src)

    def join(self, other: Loads) -> Loads:
        """These copies and ``other``'s as one set (for a prefetcher that copies both at
        once, after the layer has written its token)."""
        return Loads(torch.cat([self.dst, other.dst]), torch.cat([self.src, other.src]))


class ElasticPass(NamedTuple):
    idx: torch.Tensor  # [R] int64 rows of the batch that attend their staging rows
    subsets: DecodeSubsets  # dense over each row's S staged rows (req_to_token: the map)
    ahead: Loads  # copies that need no K/V of this pass (prefetchable)
    current: Loads  # the decoded token's own row, copied after its layer writes it
    loaded: int  # positions loaded this pass, summed over rows and KV heads
    first: int  # rows whose staging was empty (a full gather)


def pair_loads(
    staged: torch.Tensor,  # [G, S] int64 positions held per row (-1 empty)
    want: torch.Tensor,  # [G, S] int64 positions to hold, unique per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which rows to overwrite with which positions so that each row of ``staged``
    holds the set ``want`` (Sec 5.4: load ``S_now - S_last`` only).

    Returns ``(group [M], dst_row [M], src_pos [M])``; the k-th new position of a
    group goes to its k-th row that holds nothing wanted (the counts are equal).
    """
    g, s = staged.shape
    want_sorted = want.sort(dim=1).values
    at = torch.searchsorted(want_sorted, staged.clamp(min=0)).clamp(max=s - 1)
    keep = (staged >= 0) & (want_sorted.gather(1, at) == staged)
    held = staged.masked_fill(~keep, -1).sort(dim=1).values
    at = torch.searchsorted(held, want).clamp(max=s - 1)
    new = held.gather(1, at) != want  # [G, S] wanted, not held
    # Stable sorts put each row's True entries first, in order.
    new_first = torch.argsort((~new).to(torch.int8), dim=1, stable=True)
    free_first = torch.argsort(keep.to(torch.int8), dim=1, stable=True)
    take = torch.arange(s, device=want.device)[None, :] < new.sum(1, keepdim=True)
    group = torch.arange(g, device=want.device)[:, None].expand(g, s)[take]
    return group, free_first[take], want.gather(1, new_first)[take]


class ElasticKV:
    """Plans a pass's loads over the policy's staging buffers; see the module doc."""

    def __init__(self, sink: int, budget: int, window: int, num_kv_heads: int):
        self.sink, self.budget, self.window = sink, budget, window
        self.rows = sink + budget + window  # S
        self.hkv = num_kv_heads
        self._map: torch.Tensor | None = None  # [capacity, S] int32: slot -> staging slots

    def stage_map(self, capacity: int, device: torch.device) -> torch.Tensor:
        if self._map is None or self._map.shape[0] < capacity:
            self._map = torch.arange(capacity * self.rows, dtype=torch.int32,
                                     device=device).view(capacity, self.rows)
        return self._map

    def want(
        self,
        sel: torch.Tensor,  # [R, Hkv, budget] int64 selected positions
        seq: torch.Tensor,  # [R] int64 history incl. the decoded token
    ) -> torch.Tensor:  # [R, Hkv, S]: sink | selection | recent window
        r, dev = sel.shape[0], sel.device
        sink = torch.arange(self.sink, device=dev)[None, :].expand(r, -1)
        recent = (seq[:, None] - self.window) + torch.arange(self.window, device=dev)[None, :]
        ends = torch.cat([sink, recent], dim=1)[:, None, :].expand(-1, self.hkv, -1)
        return torch.cat([ends[..., : self.sink], sel, ends[..., self.sink :]], dim=-1)

    def plan(
        self,
        staged: torch.Tensor,  # [cap, Hkv, S] int64 the policy's staged positions (updated)
        slots: torch.Tensor,  # [R] int64 the rows' policy slots
        sel: torch.Tensor,  # [R, Hkv, budget] int64 this pass's selections
        seq: torch.Tensor,  # [R] int64 histories incl. the decoded token
        req_to_token: torch.Tensor,  # [max_reqs, max_context] int32 position -> pool slot
        pool_rows: torch.Tensor,  # [R] int64 the rows' req_to_token rows
        idx: torch.Tensor,  # [R] int64 the rows' batch indices
    ) -> ElasticPass:
        r, hkv, s = sel.shape[0], self.hkv, self.rows
        old = staged.index_select(0, slots)  # [R, Hkv, S]
        want = self.want(sel, seq)
        group, dst_row, src_pos = pair_loads(old.view(r * hkv, s), want.view(r * hkv, s))
        new = old.view(r * hkv, s).clone()
        new[group, dst_row] = src_pos
        staged.index_copy_(0, slots, new.view(r, hkv, s))
        row, head = group // hkv, group % hkv
        dst = (slots[row] * s + dst_row) * hkv + head
        src = req_to_token[pool_rows[row], src_pos].long() * hkv + head
        cur = src_pos == seq[row] - 1
        dev = sel.device
        sub = dense_subsets(self.stage_map(staged.shape[0], dev), slots,
                            torch.full((r,), s, dtype=torch.int64, device=dev), hkv)
        return ElasticPass(idx, sub, Loads(dst[~cur], src[~cur]), Loads(dst[cur], src[cur]),
                           int(group.shape[0]), int((old[:, 0, 0] < 0).sum()))
