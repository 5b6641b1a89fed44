"""The layer-tiered KV pool inside sglang (``--spec-rounds``): sglang's side.

sglang 0.5.23 builds its MHA KV pool from the class a platform returns for
``get_kv_pool_cls(kind="mha")``, with the in-tree arguments, at every site. sgl_spec's
platform plugin (``platform``) returns ``TieredMHAPool`` from there where round mode is on.

``TieredMHAPool`` is ``MHATokenToKVPool`` with its layers in two tiers
(docs/design/round-attention.md): layers below the split (the watershed L_w) have the
full pool's slots, as stock; layers from it up have ``upper`` slots plus one scratch row,
and ``tiers.slots`` (``sgl_spec.tiers.working_set.UpperSlots``) maps a full slot to its
upper slot. Writes to an upper layer go through the map (``_store_kv_layer``); an
unmapped slot's write lands in the scratch row, which nothing reads. Reads are the
attention backend's: it translates a request's indices itself
(``sgl_spec.rounds.runtime``). HiCache's host pool (and Krul's, built on it) is given the
lower tier's layers only (``get_device_pool_infos``): a conversation's upper layers are
in its rounds' host blocks already, and its upper slots are a working set's, not the
full slots' a host copy is made from. Everything else is the in-tree pool's.
"""

from __future__ import annotations

import logging

import msgspec
import torch
from sglang.srt.mem_cache.memory_pool import KvBufferDesc, MHATokenToKVPool

from sgl_spec.config import current
from sgl_spec.tiers.pool import Tiers

logger = logging.getLogger(__name__)


class TieredMHAPool(MHATokenToKVPool):
    """sglang's MHA pool whose layers from the watershed up hold working sets only."""

    tiers: Tiers | None = None

    def _create_buffers_normal(self):
        cfg = current().rounds
        split = cfg.watershed - self.start_layer
        if self.kv_cache_layout != "nhd" or self.use_hnd or not 0 < split < self.layer_num:
            logger.warning("--spec-rounds: layout %s, layers %d-%d, L_w %d: no tiers (every "
                           "layer keeps every token)", self.kv_cache_layout, self.start_layer,
                           self.end_layer, cfg.watershed)
            return super()._create_buffers_normal()
        rows = self.size + self.page_size
        upper = min(cfg.upper_tokens or self.size, self.size)

        def zeros(n, dim):
            return torch.zeros((n, self.head_num, dim), dtype=self.store_dtype,
                               device=self.device)

        # upper layers: ``upper`` slots and the scratch row (index -1: unmapped writes)
        self.k_buffer = [zeros(rows if i < split else upper + 1, self.head_dim)
                         for i in range(self.layer_num)]
        self.v_buffer = [zeros(rows if i < split else upper + 1, self.v_head_dim)
                         for i in range(self.layer_num)]
        self.tiers = Tiers(split, self.k_buffer, self.v_buffer, rows, upper,
                           first_layer=self.start_layer)
        logger.info("--spec-rounds: layer-tiered KV pool, layers %d-%d x %d slots, %d-%d x %d "
                    "slots (%s)", self.start_layer, self.start_layer + split - 1, rows,
                    self.start_layer + split, self.start_layer + self.layer_num - 1, upper + 1,
                    self.tiers.device_bytes())

    def _build_kv_buffer_descs(self):
        if self.tiers is None:
            return super()._build_kv_buffer_descs()
        item = self.store_dtype.itemsize
        return [KvBufferDesc(f"{p}{i}", tuple(b.shape), row_bytes=b[0].numel() * item,
                             tokens_per_row=1)
                for p, bufs in (("k", self.k_buffer), ("v", self.v_buffer))
                for i, b in enumerate(bufs)]

    def get_device_pool_infos(self):
        """The buffers a host tier mirrors (sglang's HiCache assembly reads this): the lower
        tier's layers. A host pool then copies those by full slot; its per-layer loads skip
        the upper layers (``load_to_device_per_layer`` returns past its own layers)."""
        infos = super().get_device_pool_infos()
        if self.tiers is None:
            return infos
        split = self.tiers.split
        (info,) = infos
        b = info.buffer_info.buffers
        lower = msgspec.structs.replace(
            b, k=b.k[:split], v=b.v[:split],
            k_data_ptrs=None if b.k_data_ptrs is None else b.k_data_ptrs[:split],
            v_data_ptrs=None if b.v_data_ptrs is None else b.v_data_ptrs[:split])
        return (msgspec.structs.replace(
            info, layer_ids=info.layer_ids[:split],
            buffer_info=msgspec.structs.replace(info.buffer_info, buffers=lower)),)

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        if self.tiers is not None and layer_idx >= self.tiers.split:
            loc = self.tiers.upper_rows(loc)
            self.k_buffer[layer_idx].index_copy_(0, loc, cache_k)
            self.v_buffer[layer_idx].index_copy_(0, loc, cache_v)
            return
        super()._store_kv_layer(layer_idx, loc, cache_k, cache_v)
