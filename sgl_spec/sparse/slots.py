"""Per-request device state of a policy: rows of growable slot-indexed buffers.

A policy keeps, per request and layer, tensors the decode path reads for a whole
batch at once (LoopServe's query ring, every policy's selection). Each live request
owns one slot; buffer ``name`` has shape ``[num_layers, capacity, *row_shape]`` so a
layer's rows of a batch are one ``index_select`` (``rows(name, layer, slots)``); a
buffer of ``layers=1`` holds one row per request for all layers (SpeContext's one
selection per pass: read it as layer 0). Freed slots are reused lowest first, and their
stale contents are never read before being written (callers mask what they have not
written).

Capacity: when full, the table grows by a copy, doubling while that adds at most
``GROW_BYTES``, else by as many slots as fit in ``GROW_BYTES`` (SpeContext stages
~10-45 MB of KV per request on the default model: doubling 32 slots at once was a
1.4 GB step of RSS). When at most half the slots are live, trailing free slots are
cut back (a copy, and the memory goes back to the OS) down to the live slots plus one
growth step, never below the initial capacity.

Not thread-safe: the scheduler thread that runs the forward pass owns it.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch

GROW_BYTES = 256 << 20


class BufferSpec(NamedTuple):
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | int = 0
    layers: int | None = None  # None: the table's num_layers


class SlotTable:
    def __init__(
        self,
        num_layers: int,
        specs: dict[str, BufferSpec],
        device: torch.device | str = "cpu",
        capacity: int = 4,
    ):
        if num_layers < 1 or capacity < 1:
            raise ValueError(f"num_layers ({num_layers}) and capacity ({capacity}) must be >= 1")
        self.num_layers = num_layers
        self.specs = dict(specs)
        self.device = torch.device(device)
        self._slots: dict[str, int] = {}
        self._free: list[int] = []  # a min-heap
        self._buffers: dict[str, torch.Tensor] = {}
        self._capacity = 0
        self._initial = capacity
        self.slot_bytes = sum(  # bytes of one slot's rows, over every buffer and layer
            (spec.layers or num_layers) * torch.Size(spec.row_shape).numel()
            * torch.empty((), dtype=spec.dtype).element_size() for spec in self.specs.values())
        self._resize(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _step(self) -> int:
        """Slots one growth adds: double, or what ``GROW_BYTES`` holds if less."""
        return max(1, min(self._capacity, GROW_BYTES // max(1, self.slot_bytes)))

    def _resize(self, capacity: int) -> None:
        keep = min(capacity, self._capacity)
        for name, spec in self.specs.items():
            new = torch.full((spec.layers or self.num_layers, capacity, *spec.row_shape), spec.fill,
                             dtype=spec.dtype, device=self.device)
            old = self._buffers.get(name)
            if old is not None:
                new[:, :keep] = old[:, :keep]
            self._buffers[name] = new
        if capacity > self._capacity:
            for s in range(self._capacity, capacity):
                heapq.heappush(self._free, s)
        else:
            self._free = [s for s in self._free if s < capacity]
            heapq.heapify(self._free)
        self._capacity = capacity

    def acquire(self, rid: str) -> int:
        """A slot for ``rid``, the lowest free one (its rows hold stale values until
        written)."""
        if rid in self._slots:
            raise ValueError(f"request {rid!r} already holds slot {self._slots[rid]}")
        if not self._free:
            self._resize(self._capacity + self._step())
        slot = heapq.heappop(self._free)
        self._slots[rid] = slot
        return slot

    def release(self, rid: str) -> bool:
        """Free ``rid``'s slot; False if it held none. Cuts trailing free slots when at
        most half the table is live (see the module docstring)."""
        slot = self._slots.pop(rid, None)
        if slot is None:
            return False
        heapq.heappush(self._free, slot)
        step = self._step()
        half_free = 2 * len(self._slots) <= self._capacity
        if step < self._capacity and half_free and self._capacity > self._initial:
            # Only tables whose growth is capped by GROW_BYTES ever shrink.
            target = max(self._initial, max(self._slots.values(), default=-1) + 1 + step)
            if target < self._capacity:
                self._resize(target)
        return True

    def slot(self, rid: str) -> int:
        return self._slots[rid]

    def __contains__(self, rid: str) -> bool:
        return rid in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def buffer(self, name: str) -> torch.Tensor:  # [num_layers, capacity, *row_shape]
        return self._buffers[name]

    def rows(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[len(slots), *row_shape]``: the rows of ``slots`` (int64, on the device)."""
        return self._buffers[name][layer].index_select(0, slots)

    def clear(self, name: str, slot: int) -> None:
        """Reset ``slot``'s rows of ``name`` (every layer) to the buffer's fill value."""
        self._buffers[name][:, slot] = self.specs[name].fill

    def write(self, name: str, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._buffers[name][layer].index_copy_(0, slots, values.to(self.specs[name].dtype))
