"""SpeContext's adaptive memory management on sglang's KV pool (``--spec-offload auto``):
sglang's side.

``PoolOffload`` runs Algorithm 2 (``sgl_spec.tiers.offload.Placement``) before every
forward pass, on the pool's slots in use (the allocator's), the pass's requests and the
staging rows' bytes (a reserve: sgl_spec stages every layer's selected rows, offloaded or
not). When the slots in use pass the next threshold, one more model layer (the last
first) leaves the device: its K and V buffers are copied to the host tier and the pool's
entries for that layer point at the host copies, so sglang's ``get_key_buffer`` /
``set_kv_buffer`` for it read and write the host. Sparse rows then reach the layer only
through their elastic loads (the prefetcher copies the changed selected rows into the
staging rows, on a worker thread or a CUDA side stream) and their own token's row;
extends and exact rows read it where it is. Layers come back when the pool drains (no
slot in use). The retrieval head's layer never leaves.

Bytes are the pool's: the slots in use times the row bytes of the buffers on each tier
(read from the tensors), plus the staging buffers' bytes. On this CPU host and device are
the same DRAM, so the tiers are what the budget counts, not two memories
(docs/design/offload.md). Not with HiCache (its host pool copies the device buffers by
address) or on CUDA (sglang's kernels would read a host buffer); the launcher refuses both.
"""

from __future__ import annotations

import logging

from sgl_spec.tiers.offload import Move, Placement, Shape, to_device, to_host

logger = logging.getLogger(__name__)


class PoolOffload:
    def __init__(self, pool, allocator, policy, prefetcher, model_layers: int,
                 budget_bytes: int):
        if pool.start_layer != 0:
            raise ValueError("--spec-offload auto needs the whole model on one pool "
                             f"(this pool starts at layer {pool.start_layer}: pipeline "
                             "parallel); valid: --spec-offload off")
        self.pool, self.allocator, self.policy = pool, allocator, policy
        self.prefetcher = prefetcher
        self.device = pool.k_buffer[0].device
        self.budget_bytes = budget_bytes
        shape = Shape(model_layers, pool.head_num, pool.head_dim, pool.store_dtype.itemsize,
                      head_layers=pool.layer_num - model_layers)
        # Staging rows are a reserve, so Algorithm 1's per-layer buffer term is 0 here.
        self.placement = Placement(budget_bytes, 0, 0, shape)
        self.running = 1
        self.moves = {"offloaded": 0, "reloaded": 0}
        self._clock_layers()
        limits = self.placement.limits(1, self.staging_bytes())
        logger.info("--spec-offload auto: device KV budget %d bytes; Algorithm 1 for one "
                    "request, slots in use past which layers 1..%d are on the host: %s",
                    budget_bytes, model_layers, limits[:-1])

    # ------------------------------------------------------------ bytes

    def used_slots(self) -> int:
        return int(self.allocator.size - self.allocator.available_size())

    def staging_bytes(self) -> int:
        if self.policy is None:
            return 0
        return sum(b.numel() * b.element_size()
                   for b in (self.policy.slots.buffer("k_stage"),
                             self.policy.slots.buffer("v_stage")))

    def _row_bytes(self, layers) -> int:
        p = self.pool
        return sum(p.k_buffer[j][0].numel() * p.k_buffer[j].element_size()
                   + p.v_buffer[j][0].numel() * p.v_buffer[j].element_size() for j in layers)

    def host_layers(self) -> list[int]:
        return sorted(self.placement.host())

    # ------------------------------------------------------------ Algorithm 2

    def update(self, running: int) -> Move:
        """Before a forward pass of ``running`` requests: offload or reload layers."""
        self.running = max(1, running)
        move = self.placement.update(self.used_slots(), self.running, self.staging_bytes())
        p = self.pool
        for j in move.offload:
            p.k_buffer[j], p.v_buffer[j] = to_host(p.k_buffer[j]), to_host(p.v_buffer[j])
        for j in move.reload:
            p.k_buffer[j] = to_device(p.k_buffer[j], self.device)
            p.v_buffer[j] = to_device(p.v_buffer[j], self.device)
        if move.offload or move.reload:
            if getattr(p, "k_data_ptrs", None) is not None:
                p._init_data_ptrs_and_strides()  # slot moves address the buffers by pointer
            self.moves["offloaded"] += len(move.offload)
            self.moves["reloaded"] += len(move.reload)
            self._clock_layers()
            logger.info("--spec-offload: %d slots in use, %d running: layers %s to the host, "
                        "%s back; on the host now: %s", self.used_slots(), self.running,
                        move.offload, move.reload, self.host_layers())
        return move

    def _clock_layers(self) -> None:
        """The prefetcher counts the loads of the host layers only."""
        if self.prefetcher is not None:
            self.prefetcher.clock.layers = frozenset(self.placement.host())

    # ------------------------------------------------------------ reports

    def annotate(self, rows: dict[str, dict]) -> dict[str, dict]:
        """The decoder's rows, each with the layers it reads from the host (one placement
        for the pool: every request's)."""
        host = self.host_layers()
        for r in rows.values():
            r["host_layers"] = host
        return rows

    def report(self) -> dict:
        """``GET /sgl_spec/cache`` -> ``offload``."""
        used, host = self.used_slots(), self.host_layers()
        device = [j for j in range(self.pool.layer_num) if j not in set(host)]
        layers_bytes, staging = used * self._row_bytes(device), self.staging_bytes()
        clock = self.prefetcher.clock.totals() if self.prefetcher is not None else None
        if clock is not None and not self.prefetcher.timed:
            clock = None
        return {"budget_bytes": self.budget_bytes, "used_slots": used,
                "running": self.running, "host_layers": host,
                "device_bytes": {"layers": layers_bytes, "staging": staging},
                "host_bytes": used * self._row_bytes(host),
                "over_budget": layers_bytes + staging > self.budget_bytes,
                "thresholds": self.placement.limits(self.running, staging)[:-1],
                "moves": dict(self.moves), "host_loads": clock}
