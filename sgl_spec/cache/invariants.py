"""KV-slot ownership: every slot of the device pool has exactly one owner.

The owners of a slot are the allocator's free list, the radix tree (a node's device
value) and the running requests (the part of their KV row past the prefix the tree
holds for them, ``[cache_protected_len, kv_allocated_len)``). A request's cached prefix
``[0, cache_protected_len)`` is the tree's: those slots must be in the tree. A slot
with two owners is KV that one of them will overwrite while the other still reads it
(a wrong answer, not a crash); a slot with none is a leak.

``slot_violations`` states the check on plain tensors, free of sglang; the integration
(``sgl_spec.integration.invariants``) gathers them from a scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

SHOWN = 8  # slots named per violation


class Owner(NamedTuple):
    """A running request's view of its KV row."""

    name: str  # the request id
    shared: torch.Tensor  # [cache_protected_len] int64, its prefix's slots (the tree's)
    own: torch.Tensor  # [kv_allocated_len - cache_protected_len] int64, its own slots


def slot_violations(
    num_slots: int,  # slots 1..num_slots are allocatable (0 is sglang's padding slot)
    free: torch.Tensor,  # [F] int64 the allocator's free slots (free and release lists)
    tree: torch.Tensor,  # [T] int64 device slots of every tree node
    owners: Sequence[Owner],
) -> list[str]:
    """What breaks single ownership, one line per kind (empty: none). Host tensors or
    device ones; one pass of ``bincount`` over the pool, cheap enough for every step."""
    free, tree = free.long().flatten(), tree.long().flatten()
    own = [o.own.long().flatten() for o in owners]
    out = []
    counts = torch.bincount(torch.cat([free, tree, *own]), minlength=num_slots + 1)
    for label, slots in (("free", free), ("tree", tree)):
        dup = _repeated(slots, num_slots)
        if dup.numel():
            out.append(f"{dup.numel()} slot(s) twice in the {label} list: {_show(dup)}")
    in_tree = _member(tree, num_slots)
    in_free = _member(free, num_slots)
    both = free[in_tree[free]]
    if both.numel():
        out.append(f"{both.numel()} free slot(s) still in the radix tree: {_show(both)}")
    for o, slots in zip(owners, own, strict=True):
        for label, member in (("free", in_free), ("tree", in_tree)):
            hit = slots[member[slots]]
            if hit.numel():
                out.append(f"request {o.name}: {hit.numel()} of its own slot(s) are "
                           f"also {label}: {_show(hit)}")
        shared = o.shared.long().flatten()
        lost = shared[~in_tree[shared]]
        if lost.numel():
            out.append(f"request {o.name}: {lost.numel()} slot(s) of its cached prefix "
                       f"are no longer in the radix tree: {_show(lost)}")
    if own:
        every = torch.cat(own)
        dup = _repeated(every, num_slots)
        if dup.numel():
            out.append(f"{dup.numel()} slot(s) owned by two requests: {_show(dup)}")
    leaked = (counts[1:] == 0).nonzero().flatten() + 1
    if leaked.numel():
        out.append(f"{leaked.numel()} slot(s) owned by nobody (leaked): {_show(leaked)}")
    if counts[0]:
        out.append("the padding slot 0 is owned")
    return out


def _member(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    m = torch.zeros(num_slots + 1, dtype=torch.bool, device=slots.device)
    m[slots] = True
    return m


def _repeated(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    return (torch.bincount(slots, minlength=num_slots + 1) > 1).nonzero().flatten()


def _show(slots: torch.Tensor) -> str:
    shown = slots.unique()[:SHOWN].tolist()
    return f"{shown}{' ...' if slots.unique().numel() > SHOWN else ''}"
