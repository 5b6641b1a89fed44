"""Per-request device state of a policy: rows of growable slot-indexed buffers.

A policy keeps, per request and layer, tensors the decode path reads for a whole
batch at once (LoopServe's query ring, every policy's selection). Each live request
owns one slot; buffer ``name`` has shape ``[num_layers, capacity, *row_shape]`` so a
layer's rows of a batch are one ``index_select`` (``rows(name, layer, slots)``); a
buffer of ``layers=1`` holds one row per request for all layers (SpeContext's one
selection per pass: read it as layer 0). The
capacity doubles when full (a copy); freed slots are reused, and their stale contents
are never read before being written (callers mask what they have not written).

Not thread-safe: the scheduler thread that runs the forward pass owns it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
        self._free: list[int] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._capacity = 0
        self._grow(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _grow(self, capacity: int) -> None:
        for name, spec in self.specs.items():
            new = torch.full((spec.layers or self.num_layers, capacity, *spec.row_shape), spec.fill,
                             dtype=spec.dtype, device=self.device)
            old = self._buffers.get(name)
            if old is not None:
                new[:, : old.shape[1]] = old
            self._buffers[name] = new
        self._free.extend(range(capacity - 1, self._capacity - 1, -1))  # lowest first
        self._capacity = capacity

    def acquire(self, rid: str) -> int:
        """A slot for ``rid`` (its rows hold stale values until written)."""
        if rid in self._slots:
            raise ValueError(f"request {rid!r} already holds slot {self._slots[rid]}")
        if not self._free:
            self._grow(2 * self._capacity)
        slot = self._free.pop()
        self._slots[rid] = slot
        return slot

    def release(self, rid: str) -> bool:
        """Free ``rid``'s slot; False if it held none."""
        slot = self._slots.pop(rid, None)
        if slot is None:
            return False
        self._free.append(slot)
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
