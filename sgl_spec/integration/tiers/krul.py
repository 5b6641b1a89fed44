"""Krul inside sglang (issue 17): the host pool over Krul's arena, and compression of
the host tier's copies.

* ``KrulHostPool`` (``patch_host_pool``, an import hook on sglang's
  ``hybrid_pool_assembler``, only with ``--spec-krul``): sglang's MHA host pool whose
  token slots are logical, backed by ``sgl_spec.tiers.arena.Arena`` rows shared by every
  layer, in the same byte budget as stock's pool. Backup and load go through the
  arena; a merged row is loaded as direction x the layer's magnitude.
* ``Compressor``: once a node's host copy is complete (its write-through acknowledged;
  under a write-back policy, its demotion), its host slots are compressed in place with
  the strategy, and a ``KrulMeta`` payload (bytes and an xxh3 checksum) goes on the
  node. The host copy is read only after the device copy is dropped, so compressing it
  early changes nothing served, and sglang's L3 backup, written right after, holds the
  compressed pages. A load-back first verifies the checksums of the nodes it would
  load: a mismatch refuses the load, so sglang recomputes; corrupt KV is never served.

With a restore profile (``--spec-krul-profile``) whose host tier chooses a share > 0,
a compressed node also leaves its part of the restore pyramid unstored, and a load-back
recomputes it (``krul_restore``); without one every stored row is loaded. A node's
layer pairs come from the attention statistics of the conversations through it
(``conversation_stats``: the ``krul_stats`` payloads the attention path's estimator,
``sgl_spec.attention.observe``, leaves at checkpoints), or, where none was observed
(or with ``--spec-krul-strategy model``), from the model's ("Krul (Fix)",
``sgl_spec.krul.calibrate``). An L3 storage backend on sglang's generic page path (``file``) stores
the compressed rows as they are (``Arena.export``, with a checksum per page and a mask
of the unstored rows); zero-copy backends are refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.pool_host.base import synchronized
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.unified_cache.unified_tree_core import BASE_COMPONENT_TYPE

from sgl_spec import envs
from sgl_spec.config import KrulConfig, current
from sgl_spec.tiers.arena import Arena, Compressed
from sgl_spec.krul.codec import codec_class
from sgl_spec.krul.merge import MergeParams
from sgl_spec.krul.pyramid import pyramid
from sgl_spec.krul.select import Strategy

logger = logging.getLogger(__name__)

KRUL = "krul"  # the payload name on a compressed node


class KrulHostPool(MHATokenToKVPoolHost):
    """MHATokenToKVPoolHost with logical slots over a shared row arena (layer_first
    layout, direct I/O: the CPU pair). ``available_size`` is in full-size tokens."""

    def init_kv_buffer(self):
        if self.layout != "layer_first":
            raise ValueError(f"--spec-krul needs --hicache-mem-layout layer_first, got "
                             f"{self.layout!r}")
        budget = self.size * self.size_per_token
        codec = current().krul.codec
        # logical slots per full-size token of budget: as many as the codec's rows fit
        full = codec_class("full").row_bytes_for(self.head_num, self.head_dim, self.dtype)
        packed = codec_class(codec).row_bytes_for(self.head_num, self.head_dim, self.dtype)
        self.slot_factor = max(2, -(-full // packed))
        slots = self.slot_factor * self.size
        rows = Arena.rows_for_budget(budget, slots, self.layer_num, self.head_num,
                                     self.head_dim, self.dtype, codec)
        self.arena = Arena(slots, self.layer_num, rows, self.head_num, self.head_dim,
                           self.dtype, codec=codec)
        self.bad_pages = 0  # storage pages that failed their checksum (logged at 1, 2, 4, ...)
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        logger.info("sgl_spec krul: host arena of %d %s rows (%d tokens at every layer) and "
                    "%d slots in %.2f GB", rows, codec, rows // self.layer_num, slots,
                    budget / 1e9)
        # Stock's per-layer transfer views need a buffer; the arena holds the data.
        return torch.zeros(2, self.layer_num, 1, self.head_num, self.head_dim,
                           dtype=self.dtype)

    @synchronized
    def clear(self):
        super().clear()
        if hasattr(self, "arena"):
            self.arena.clear()

    def available_size(self):
        return self.arena.available()

    @synchronized
    def alloc(self, need_size: int):
        return self.arena.alloc(need_size)

    @synchronized
    def free(self, indices: torch.Tensor) -> int:
        return self.arena.free(indices)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend):
        dev = device_indices.to(self.device_k_buffers[0].device)
        with self.lock:
            for layer in range(self.layer_num):
                self.arena.write(layer, host_indices, self.device_k_buffers[layer][dev],
                                 self.device_v_buffers[layer][dev])

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                 io_backend, *, is_draft: bool = False):
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        # Decoded into the pool's rows (one pass on a CPU pool); rows the restore's
        # pre-pass recomputed are unstored and left as it wrote them.
        k_buf, v_buf = self.device_k_buffers[layer_id], self.device_v_buffers[layer_id]
        with self.lock:
            self.arena.read_into(layer_id, host_indices, k_buf, v_buf,
                                 device_indices.to(k_buf.device))

    @synchronized
    def compress(self, slots: torch.Tensor, strategy: Strategy, unstored: list[int],
                 params: MergeParams) -> Compressed:
        return self.arena.compress(slots, strategy, unstored, params)

    # Storage pages (sglang's generic page path: the ``file`` backend): a page is the
    # slots' rows as the codec stores them, every layer, and a checksum (Arena.export).
    def _page_slots(self, index: int) -> torch.Tensor:
        return torch.arange(int(index), int(index) + self.page_size)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        with self.lock:
            return self.arena.export(self._page_slots(index))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.arena.page_bytes(self.page_size), dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        with self.lock:
            ok = self.arena.load(self._page_slots(index), data_page)
        if not ok:
            # One line for the first damaged page, then at 2, 4, 8, ... (a damaged file
            # tier fails every page of a conversation).
            self.bad_pages += 1
            if self.bad_pages & (self.bad_pages - 1) == 0:
                logger.warning("sgl_spec krul: a storage page at host slot %d failed its "
                               "checksum (%d so far); a load that reaches a damaged page is "
                               "refused and its tokens recomputed", index, self.bad_pages)

    def _no_zero_copy(self, *args, **kwargs):
        raise NotImplementedError("--spec-krul pages are compressed rows that zero-copy "
                                  "storage backends cannot address; valid: "
                                  "--hicache-storage-backend file")

    get_page_buffer_meta = get_split_heads_page_buffer_meta = _no_zero_copy


def patch_host_pool(module) -> None:
    """After ``hybrid_pool_assembler`` executes: with ``--spec-krul`` its MHA host pool
    class is ``KrulHostPool`` (stock's otherwise)."""
    cfg = current()
    if cfg.disable or not cfg.krul.enable or getattr(module, "_sgl_spec_krul", False):
        return
    stock = module.get_mha_host_pool_cls

    def get_mha_host_pool_cls(info):
        cls = stock(info)
        if cls is not MHATokenToKVPoolHost:
            raise ValueError(f"--spec-krul supports sglang's MHA host pool, not "
                             f"{cls.__name__} (MXFP8 or asymmetric K/V); valid: drop "
                             "--spec-krul")
        return KrulHostPool

    module.get_mha_host_pool_cls = get_mha_host_pool_cls
    module._sgl_spec_krul = True
    logger.info("sgl_spec: Krul host pool")


@dataclass(frozen=True)
class KrulMeta:
    """A compressed node's record: its bytes in the host tier and their checksum."""

    tokens: int
    stored_bytes: int
    full_bytes: int
    checksum: int
    merged: int      # (token, pair)s sharing a direction
    retained: int    # (token, pair)s kept unmerged
    strategy: str = "model"  # whose layer pairs: "conversation" (its own attention) or "model"


def model_layers(pool_layers: int) -> int:
    """The pool's layers that are the model's (SpeContext adds its head's after them)."""
    from ..head import HEAD_LAYERS

    return pool_layers - (HEAD_LAYERS if current().decode.retrieval_head else 0)


def strategy_for(cfg: KrulConfig, num_model_layers: int, pool_layers: int) -> Strategy:
    """The model's pairs (from its calibration statistics) over the pool's layers; pool
    layers past the model's (SpeContext's head layer) are never paired."""
    from sgl_spec.krul import calibrate

    sim = calibrate.load(cfg.stats_path)
    if not holds(sim.num_layers, num_model_layers):
        raise ValueError(f"Krul statistics {cfg.stats_path!r} are for {sim.num_layers} "
                         f"layers, the model has {num_model_layers}")
    return pairs_over(sim, num_model_layers, pool_layers, cfg)


def holds(stats_layers: int, held: int) -> bool:
    """Whether statistics of ``stats_layers`` layers describe a host pool holding the
    model's first ``held``: all of them, or under round mode the lower tier (layers from
    L_w up live in the rounds' host blocks, not in the pool)."""
    return held == stats_layers or (current().rounds.enable and 0 < held < stats_layers)


def pairs_over(sim, held: int, pool_layers: int, cfg: KrulConfig) -> Strategy:
    """Algorithm 1 over the first ``held`` layers of ``sim`` (those the host pool holds)."""
    from sgl_spec.krul.select import select_pairs

    s = select_pairs(sim.ir_share()[:held], sim.distances()[:held, :held], gamma=cfg.gamma,
                     ratio=cfg.ratio)
    return Strategy(pool_layers, s.pairs, s.input_sensitive)


MIN_OBSERVED = 32  # (row, query head)s per layer before a conversation's own pairs are used
STATS_WALK = 256  # nodes of a subtree read for its conversations' statistics, at most


def conversation_stats(node):
    """The attention statistics (``krul_stats`` payloads) of the conversations through
    ``node``: the deepest payload on each branch below it (a payload holds its
    conversation's sums so far, earlier turns included), summed over branches; if none is
    below (within ``STATS_WALK`` nodes), the deepest above. None if there is none."""
    from sgl_spec.krul.similarity import Similarity

    from ..radix import KRUL_STATS

    def stats(n):
        return ((getattr(n, "spec", None) and n.spec.payloads) or {}).get(KRUL_STATS)

    found, budget = [], [STATS_WALK]

    def below(n) -> bool:  # whether n's subtree holds a payload; collects the deepest
        budget[0] -= 1
        deeper = False
        for c in list(n.children.values()):
            if budget[0] <= 0:
                break
            deeper = below(c) or deeper
        hit = stats(n)
        if hit is not None and not deeper:
            found.append(hit[1])
        return deeper or hit is not None

    below(node)
    n = node.parent
    while not found and n is not None:
        hit = stats(n)
        if hit is not None:
            found.append(hit[1])
        n = n.parent
    if not found:
        return None
    total = Similarity(found[0].num_layers)
    for sim in found:
        total.merge(sim.copy())
    return total


class Compressor:
    """Compresses host copies and checks them before a load. Driven by the scheduler
    thread (the tree's write-through acknowledgements and demotions, the cache's
    load-backs)."""

    def __init__(self, cache, cfg: KrulConfig, runner=None, observer=None):
        """``runner``: the model runner whose layers a restore's pre-pass runs, and
        ``observer``: Krul's estimator, both from the attention path (``radix.CoreLinks``;
        None where the attention backend is not sgl_spec's)."""
        self.cache, self.cfg = cache, cfg
        self.observer = observer
        self.params = MergeParams(retain=cfg.retain, max_error=cfg.max_error)
        self._strategy: Strategy | None = None
        self.refused_loads = 0
        self.pairs_skipped = 0  # pairs left exact (their merge erred over max_error)
        self.corrupt = envs.krul_corrupt()
        self._share: float | None = None  # of each demoted history left for a recompute
        from .krul_restore import Recompute

        self.recompute = Recompute(runner, cfg.restore)

    def pool(self) -> KrulHostPool | None:
        ctl = getattr(self.cache, "cache_controller", None)
        pool = getattr(ctl, "mem_pool_host", None)
        anchor = getattr(pool, "anchor_entry", None)  # a pool group: the KV pool anchors it
        pool = anchor.host_pool if anchor is not None else pool
        return pool if isinstance(pool, KrulHostPool) else None

    def model_strategy(self, pool: KrulHostPool) -> Strategy:
        if self._strategy is None:
            self._strategy = strategy_for(self.cfg, model_layers(pool.layer_num),
                                          pool.layer_num)
            logger.info("sgl_spec krul: the model's pairs %s (input-sensitive layers %s)",
                        self._strategy.pairs, self._strategy.input_sensitive)
        return self._strategy

    def strategy(self, pool: KrulHostPool, node) -> tuple[Strategy, str]:
        """``node``'s pairs and whose they are: Algorithm 1 on the attention statistics of
        the conversations through it (``--spec-krul-strategy conversation``), else, or
        before any was observed, the model's."""
        sim = conversation_stats(node) if self.cfg.strategy == "conversation" else None
        if sim is None or sim.observed() < MIN_OBSERVED:
            return self.model_strategy(pool), "model"
        L = model_layers(pool.layer_num)
        if not holds(sim.num_layers, L):  # not with one model; never stop the scheduler
            logger.error("sgl_spec krul: a conversation's statistics cover %d layers, the "
                         "pool %d: the model's pairs instead", sim.num_layers, L)
            return self.model_strategy(pool), "model"
        return pairs_over(sim, L, pool.layer_num, self.cfg), "conversation"

    def share(self, pool: KrulHostPool) -> float:
        """The recompute share of a restore: the restore profile's host tier (0 without
        one, or where this process cannot run the pre-pass)."""
        if self._share is None:
            self._share = 0.0
            from . import krul_restore
            from sgl_spec.krul.restore_cost import host_share, read_profile

            why = krul_restore.unsupported(self.recompute.runner)
            if not self.cfg.profile_path:
                logger.info("sgl_spec krul: no --spec-krul-profile: restores load every "
                            "stored row (python -m sgl_spec.calibrate restore measures "
                            "whether recomputing a share pays on this host)")
            elif why is not None:
                logger.warning("sgl_spec krul: --spec-krul-profile ignored, restores load "
                               "every row: %s", why)
            else:
                # Every row weighs a full load: a chosen pair merges only where its KV
                # are alike (--spec-krul-max-error), which is not known up front.
                L = model_layers(pool.layer_num)
                try:
                    self._share = host_share(read_profile(self.cfg.profile_path), L,
                                             pipelined=self.recompute.pipelined)
                except (OSError, ValueError) as exc:  # the launcher checked it; moved since
                    logger.error("sgl_spec krul: --spec-krul-profile %s: %s; restores load "
                                 "every row", self.cfg.profile_path, exc)
                    return self._share
                logger.info("sgl_spec krul: restore profile %s: recompute share %.3f of "
                            "each demoted history (a %s restore)", self.cfg.profile_path,
                            self._share,
                            "pipelined" if self.recompute.pipelined else "serial")
        return self._share

    def unstored(self, pool: KrulHostPool, node) -> list[int]:
        """Rows per pool layer that ``node`` leaves unstored: its part of the pyramid of
        the history it ends (model layers only; SpeContext's head layer keeps all)."""
        share = self.share(pool)
        L = model_layers(pool.layer_num)
        out = [0] * pool.layer_num
        if share <= 0:
            return out
        from .krul_restore import path

        start = sum(len(p.key) for p in path(node.parent, self.cache.tree_core.root_node))
        n = len(node.key)
        for layer, u in enumerate(pyramid(start + n, L, share)):
            out[layer] = min(max(u - start, 0), n)
        return out

    def compress(self, node) -> None:
        """``node``'s host copy is complete (its write-through was acknowledged, or the
        tree dropped its device copy): it is compressed in place, before sglang writes
        its storage pages, so the host tier and L3 hold only the compressed form."""
        pool = self.pool()
        host = node.component_data[BASE_COMPONENT_TYPE].host_value
        if pool is None or host is None or KRUL in (node.spec.payloads or {}):
            return
        strategy, whose = self.strategy(pool, node)
        c = pool.compress(host, strategy, self.unstored(pool, node), self.params)
        self.pairs_skipped += c.pairs_skipped
        self._record(node, pool, c.tokens_merged, c.tokens_retained, whose)
        if self.corrupt:  # test-only fault injection (SGLSPEC_KRUL_CORRUPT nodes)
            self.corrupt -= 1
            with pool.lock:
                m = pool.arena.map[:, host.cpu().long()]
                row = int(m[m >= 0][0]) if bool((m >= 0).any()) else int(-2 - m[m <= -2][0])
                pool.arena.k[row].view(torch.uint8).view(-1)[0] ^= 1

    def _record(self, node, pool: KrulHostPool, merged: int, retained: int,
                whose: str) -> None:
        host = node.component_data[BASE_COMPONENT_TYPE].host_value
        with pool.lock:
            meta = KrulMeta(len(host), pool.arena.stored_bytes(host),
                            pool.arena.full_bytes(len(host)), pool.arena.checksum(host),
                            merged, retained, whose)
        node.spec.payloads = {**(node.spec.payloads or {}), KRUL: (len(node.key), meta)}

    def on_split(self, upper, lower, meta: KrulMeta) -> None:
        """A compressed node was split: both parts get their own record, if the whole
        still matched its checksum (else neither does, and a load refuses them)."""
        pool = self.pool()
        if pool is None:
            return
        ok = self._matches(pool, torch.cat([upper.component_data[BASE_COMPONENT_TYPE].host_value,
                                            lower.component_data[BASE_COMPONENT_TYPE].host_value]),
                           meta)
        for part in (upper, lower):
            if ok:
                self._record(part, pool, 0, 0, meta.strategy)
            else:
                bad = KrulMeta(len(part.key), 0, 0, -1, 0, 0)
                part.spec.payloads = {**(part.spec.payloads or {}), KRUL: (len(part.key), bad)}

    @staticmethod
    def _matches(pool: KrulHostPool, host: torch.Tensor, meta: KrulMeta) -> bool:
        with pool.lock:
            return meta.checksum >= 0 and pool.arena.checksum(host) == meta.checksum

    def verify_path(self, node) -> bool:
        """Whether every compressed node on the path to ``node`` that only the host
        holds still matches its checksum."""
        pool = self.pool()
        if pool is None:
            return True
        root = self.cache.tree_core.root_node
        while node is not None and node is not root:
            cd = node.component_data[BASE_COMPONENT_TYPE]
            hit = (node.spec.payloads or {}).get(KRUL)
            host_only = cd.value is None and cd.host_value is not None
            if host_only and bool(pool.arena.damaged[cd.host_value.cpu().long()].any()):
                logger.warning("sgl_spec krul: node %s came from a storage page that failed "
                               "its checksum; its tokens are recomputed", node.id)
                self.refused_loads += 1
                return False
            if host_only and hit is not None:
                if not self._matches(pool, cd.host_value, hit[1]):
                    logger.warning("sgl_spec krul: node %s failed its checksum; its "
                                   "tokens are recomputed", node.id)
                    self.refused_loads += 1
                    return False
            node = node.parent
        return True

    def can_recompute(self) -> bool:
        """Whether a restore with unstored rows can run here (else it is recomputed
        whole, as a load that is refused)."""
        from .krul_restore import unsupported

        why = unsupported(self.recompute.runner)
        if why is not None:
            self.refused_loads += 1
            logger.warning("sgl_spec krul: a restore needs a recompute pre-pass that cannot "
                           "run here (%s); its tokens are recomputed", why)
        return why is None

    def restore_plan(self, node):
        """What a load-back of ``node`` must recompute (``krul_restore.plan``), or None."""
        pool = self.pool()
        if pool is None:
            return None
        from .krul_restore import plan

        with pool.lock:
            return plan(node, self.cache.tree_core.root_node, pool.arena,
                        model_layers(pool.layer_num))

    def totals(self) -> dict:
        """Compressed nodes in the tree and their bytes (for ``GET /sgl_spec/cache``)."""
        out = {"nodes": 0, "tokens": 0, "stored_bytes": 0, "full_bytes": 0,
               "refused_loads": self.refused_loads, "pairs_skipped": self.pairs_skipped,
               "conversation_strategy_nodes": 0, "model_strategy_nodes": 0}
        core = self.cache.tree_core
        stack = [core.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            hit = (getattr(node, "spec", None) and node.spec.payloads or {}).get(KRUL)
            if hit is not None and node.component_data[BASE_COMPONENT_TYPE].host_value is not None:
                meta = hit[1]
                out["nodes"] += 1
                out["tokens"] += meta.tokens
                out["stored_bytes"] += meta.stored_bytes
                out["full_bytes"] += meta.full_bytes
                out[f"{meta.strategy}_strategy_nodes"] += 1
        if self.observer is not None:
            out.update(self.observer.totals())
        pool = self.pool()
        if pool is not None:
            out["host_available_tokens"] = pool.available_size()
        out["recompute_share"] = self._share or 0.0
        out.update(self.recompute.totals())
        return out
