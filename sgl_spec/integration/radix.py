"""sgl_spec's radix-cache backend (``--radix-cache-backend sgl_spec``): sglang's side.

Subclasses of sglang's UnifiedRadixCache, built through sglang's own
``create_unified_radix_cache`` so HiCache attachment keeps working:

* ``SpecRadixCache`` (default flags): sglang's default tree core (compiled), so the
  cache's own path costs what stock's does plus recording each insert's token ids
  (``tree_view.SlotTokens``) for ``GET /sgl_spec/cache``, which derives turns and
  rounds on demand;
* ``TaggedRadixCache`` (``SpecConfig.tagged_cache``: ``--spec-cache-eviction turn``,
  LoopServe prefill with reuse, ``--spec-krul``, or ``--spec-tree-core tagged``): the
  turn-tagged tree core
  (``tree_core``), whose nodes carry turn tags and payloads (Krul's compressed-node
  records: ``krul``). LoopServe's lines kept per turn are a payload of the
  node where the turn's extend ends; matches and checkpoints hand the deepest ones on a
  request's path to the attention path as seeds (the request hub). Krul's
  estimator works the same way: a checkpoint keeps the request's attention statistics on
  its last node (``krul_stats``), a match seeds the next turn with the deepest ones.

Both tell the request hub when the scheduler releases a request (finished, aborted,
retracted), so per-request state kept outside the tree is freed. What the cache shares
with the attention path (``CoreLinks``: the hub, the decoder's sparse-KV marks, Krul's
estimator, the model runner) comes from the scheduler's attention backend, which sglang
builds before the cache (``create_cache``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    get_tree_core_factory,
    register_tree_core_backend,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_spec.cache.metrics import CacheMetrics
from sgl_spec.tiers.restore_clock import RestoreClock
from sgl_spec.cache.summary import summary, totals
from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import SpecConfig, current
from sgl_spec.requests import Lines, RequestHub

from .invariants import InvariantLog
from .tree_core import SpecTreeCore
from .tree_view import SlotTokens, node_segments

logger = logging.getLogger(__name__)

TREE_CORE = "sgl_spec"
BACKEND_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # sglang's choice of tree core
LINES = "lines"  # the payload name of LoopServe's kept lines
KRUL_STATS = "krul_stats"  # Krul: a conversation's attention statistics (Similarity)
ROUNDS = "rounds"  # round mode: the stored rounds on the path (rounds.history.RoundHistory)


def _tree_core_factory(params, components):
    fmt, eviction = params.sgl_spec_turns
    return SpecTreeCore(params, components, fmt=fmt, eviction=eviction)


if get_tree_core_factory(TREE_CORE) is None:
    register_tree_core_backend(TREE_CORE, _tree_core_factory)


class CoreLinks(NamedTuple):
    """What the cache shares with its scheduler's attention path (built before it)."""

    hub: RequestHub
    # rid -> the first position a sparse decode step wrote (--spec-sparse-kv-cache drop)
    sparse_kv_from: Callable[[str], int | None] | None = None
    observer: object | None = None  # Krul's estimator (attention.observe.KrulObserver)
    runner: object | None = None  # the model runner, whose layers Krul's pre-pass runs
    rounds: object | None = None  # round mode (rounds.runtime.RoundRuntime)
    offload: object | None = None  # --spec-offload (integration.tiers.offload.PoolOffload)

    @classmethod
    def of(cls, runner) -> CoreLinks:
        """The links of ``runner``'s attention backend where it is sgl_spec's; a hub of
        the cache's own otherwise (another backend: nothing to share)."""
        core = getattr(getattr(runner, "attn_backend", None), "core", None)
        if core is None:
            return cls(RequestHub())
        return cls(core.hub, core.sparse_kv_from, core.observer, runner, core.rounds,
                   core.offload)


class SpecRadixCache(UnifiedRadixCache):
    """UnifiedRadixCache on sglang's default tree core, with turns derived on demand."""

    tree_core_name = "compiled"

    def __init__(self, params, fmt: TurnFormat | None, cfg: SpecConfig,
                 links: CoreLinks | None = None):
        self.turn_format = fmt
        self.spec_cfg = cfg
        self.links = links if links is not None else CoreLinks(RequestHub())
        self.hub = self.links.hub
        self._evicted_lru = 0  # tokens evicted (the compiled core has no per-rule count)
        super().__init__(params)
        # sglang falls back to its Python core where the compiled one cannot serve;
        # that one's nodes are walked directly.
        self._slots = None
        if not _walkable(self.tree_core):
            alloc = params.token_to_kv_pool_allocator
            self._slots = SlotTokens(4 * (alloc.size if alloc is not None else 1 << 16))
        self.restore_clock = RestoreClock()
        # --spec-check-invariants: what the scheduler's checks found (integration.invariants)
        self.invariant_log = InvariantLog() if cfg.check_invariants else None
        d = cfg.decode
        self.spec_metrics = (CacheMetrics(krul=cfg.krul.enable, sparse_from=None
                                          if d.mode == "exact" else d.min_context,
                                          rounds=self.links.rounds is not None,
                                          offload=self.links.offload is not None)
                             if params.enable_metrics else None)

    def insert(self, params):
        # On the compiled core's hot path: keep this to a reference append.
        result = super().insert(params)
        slots = self._slots
        if slots is not None and params.value is not None and not params.key.is_bigram:
            slots.record(params.key.token_ids, params.value)
        if self.spec_metrics is not None and self.spec_metrics.due():
            self._update_metrics()
        return result

    def evict(self, params):
        result = super().evict(params)
        self._evicted_lru += result.num_tokens_evicted
        return result

    def evict_for_alloc(self, params, *args, **kwargs):
        result = super().evict_for_alloc(params, *args, **kwargs)
        self._evicted_lru += result.num_tokens_evicted
        return result

    def load_back(self, node_id, mem_quota=None, req=None) -> bool:
        # The host-tier restore stage (``restore_clock``): the same clock on stock's
        # full copy and on Krul's compressed rows.
        with self.restore_clock.admitting() as ok:
            ok[0] = self._load_back(node_id, mem_quota, req)
        return ok[0]

    def _load_back(self, node_id, mem_quota=None, req=None) -> bool:
        return super().load_back(node_id, mem_quota, req)

    def ready_to_load_host_cache(self) -> int:
        cc = self.cache_controller
        if cc is None or not cc.load_queue:
            out = super().ready_to_load_host_cache()
            self._join_restores(0.0)
            return out
        tokens = sum(len(op.device_indices) for op in cc.load_queue)
        with self.restore_clock.transferring(tokens):
            t0 = time.perf_counter()
            out = super().ready_to_load_host_cache()
            self._join_restores(time.perf_counter() - t0)
            return out

    def _join_restores(self, load_s: float) -> None:
        """Krul: wait for the restore pre-passes issued by this batch's load-backs, which
        ran while the load (``load_s``) did, before the batch reads their rows."""
        krul = getattr(self, "krul", None)  # the turn-tagged core's
        if krul is not None:
            own, wall = krul.recompute.join()
            self.restore_clock.pipeline(own, load_s, wall)

    def reset(self):
        if getattr(self, "krul", None) is not None:
            self.krul.recompute.join()  # no pre-pass writes into a pool being emptied
        super().reset()
        if getattr(self, "_slots", None) is not None:
            self._slots.reset()

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        up_to = self.dense_kv_end(req, up_to, self.links.sparse_kv_from)
        super().checkpoint(req, up_to=up_to, **kwargs)
        self._checkpointed(req, up_to)

    def _checkpointed(self, req, up_to: int) -> None:
        """After the tree took ``[0, up_to)`` of ``req``: payloads for that span."""

    @staticmethod
    def dense_kv_end(req, up_to: int, sparse_kv_from) -> int:
        """``up_to``, or under ``--spec-sparse-kv-cache drop`` (``sparse_kv_from``: the
        decoder's marks) where the request's sparse decode steps began writing KV: the
        tree keeps only dense passes' KV, and the request frees the rest as its own (never
        below what the tree already holds)."""
        start = sparse_kv_from(req.rid) if sparse_kv_from is not None else None
        if start is None or start >= up_to:
            return up_to
        return max(start, req.kv.cache_protected_len)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self.hub.release(req.rid)

    def segments(self):
        if self._slots is not None:
            return self._slots.segments(self.tree_core)
        return node_segments(self.tree_core)

    def _freed(self) -> dict[str, int]:
        return getattr(self.tree_core, "freed_by_rule", {"lru": self._evicted_lru})

    def _update_metrics(self) -> None:
        self.spec_metrics.update(totals(self.segments(), self.turn_format), self._freed(),
                                 self.hub.live(), self._restore(), self.hub.rows())
        if self.links.offload is not None:
            self.spec_metrics.update_offload(self.links.offload.report())

    def _restore(self) -> dict | None:
        return self.restore_clock.totals() if self.cache_controller is not None else None

    def summary(self) -> dict:
        """The tree summary served at ``GET /sgl_spec/cache``."""
        segs = self.segments()
        out = summary(segs, self.turn_format, tree_core=self.tree_core_name,
                      eviction=self.spec_cfg.cache.eviction, freed_by_rule=self._freed(),
                      dead=self._dead())
        out["live_requests"] = self.hub.live()
        d = self.spec_cfg.decode
        out["decode"] = {"mode": d.mode, "min_context": d.min_context,
                         "profile": d.profile_path, "decision": d.decision,
                         "rows": self.hub.rows()}
        out["restore"] = self._restore()
        out["pool"] = self._pool()
        if self.links.offload is not None:
            out["offload"] = self.links.offload.report()
            if self.spec_metrics is not None:
                self.spec_metrics.update_offload(out["offload"])
        if self.invariant_log is not None:
            out["invariants"] = self.invariant_log.as_dict()
        if self.spec_metrics is not None and self.spec_metrics.due(force=True):
            self.spec_metrics.update(out["totals"], self._freed(), out["live_requests"],
                                     out["restore"], out["decode"]["rows"])
        return out

    def _dead(self) -> dict[int, int] | None:
        return None

    def _pool(self) -> dict | None:
        """The device KV pool's slots and bytes, read from its buffers."""
        alloc = self.token_to_kv_pool_allocator
        pool = alloc.get_kvcache() if alloc is not None else None
        if pool is None or not hasattr(pool, "get_kv_size_bytes"):
            return None
        k, v = pool.get_kv_size_bytes()
        return {"slots": int(pool.size), "used_slots": int(alloc.size - alloc.available_size()),
                "device_bytes": int(k) + int(v)}


class TaggedRadixCache(SpecRadixCache):
    """UnifiedRadixCache over the turn-tagged tree core (``tree_core``)."""

    tree_core_name = "tagged"

    def __init__(self, params, fmt: TurnFormat | None, cfg: SpecConfig,
                 links: CoreLinks | None = None):
        asked = os.environ.get(BACKEND_ENV, "")
        if asked and asked != TREE_CORE:
            logger.warning("%s=%s is ignored: turn eviction, LoopServe's kept lines and Krul "
                           "need sgl_spec's turn-tagged tree core (%r)", BACKEND_ENV, asked,
                           TREE_CORE)
        params.tree_core_backend = TREE_CORE
        params.sgl_spec_turns = (fmt, cfg.cache.eviction)
        if ComponentType.SWA in params.tree_components:
            from .swa import COMPONENTS  # window steps over stock's node boundaries

            params.component_registry_override = {
                **(params.component_registry_override or {}), **COMPONENTS}
        self.keep_lines = cfg.prefill.mode == "loopserve" and cfg.prefill.reuse
        super().__init__(params, fmt, cfg, links)
        self.krul = None
        if cfg.krul.enable:
            from .tiers.krul import KRUL, Compressor

            self.krul = self.tree_core.krul = Compressor(self, cfg.krul, self.links.runner,
                                                         self.links.observer)
            self.tree_core.whole_node_payloads[KRUL] = self.krul.on_split
        self.rounds = self.links.rounds
        if self.rounds is not None:
            self.tree_core.prefix_payloads.add(ROUNDS)

    def insert(self, params):
        result = UnifiedRadixCache.insert(self, params)
        if self.disable or params.key is None or not len(params.key):
            return result
        core = self.tree_core
        node = core._node_arena.get(result.last_device_node)
        if node is not None:
            core.harden_below(node)  # stock splits where an insert ends
        if self.turn_format is not None and not core.precuts:
            self._apply_cache_actions(core.cut_path(params.key.page_aligned(core.page_size)))
        if self.spec_metrics is not None and self.spec_metrics.due():
            self._update_metrics()
        return result

    def match_prefix(self, params):
        result = super().match_prefix(params)
        if self.rounds is not None and params.req is not None:
            result = self._match_stored_rounds(params, result)
        if self.keep_lines and params.req is not None:
            hit = self.tree_core.deepest(result.last_device_node, LINES)
            self.hub.set_seeds(params.req.rid, None if hit is None else Lines(*hit))
        obs = self.links.observer
        if self.krul is not None and obs is not None and params.req is not None:
            # Krul's estimator carries on the conversation's sums (its earlier turns').
            node = getattr(result, "best_match_node", None) or result.last_device_node
            hit = self.tree_core.deepest(node, KRUL_STATS)
            obs.seed(params.req.rid, None if hit is None else hit[1])
        return result

    def _match_stored_rounds(self, params, result):
        """Round mode: a match reaches no further than the rounds stored on its path (the
        upper layers of tokens past them are nowhere: they are computed again); the
        request's attention path is seeded with those rounds."""
        import dataclasses

        # HiCache: the deepest node matched may be on the host only (its rounds' blocks
        # stay with it), and a load-back brings its lower layers
        node = getattr(result, "best_match_node", None) or result.last_device_node
        hit = self.tree_core.deepest(node, ROUNDS)
        end = 0 if hit is None else hit[0]
        if end < result.device_prefix_len + getattr(result, "host_hit_length", 0):
            result = super().match_prefix(dataclasses.replace(params, key=params.key[:end]))
        self.rounds.seed(params.req.rid, None if hit is None else hit[1].upto(end))
        return result

    def _checkpointed(self, req, up_to: int) -> None:
        if self.rounds is not None:
            ids = req.full_untruncated_fill_ids
            self.rounds.rekey(req.rid, self.req_to_token_pool.req_to_token[req.kv.req_pool_idx],
                              up_to)
            for end, hist in self.rounds.store(req.rid, ids, up_to, self.turn_format):
                self.tree_core.attach(self._key(req, end), end, ROUNDS, hist)
        obs = self.links.observer
        sim = obs.stats(req.rid) if self.krul is not None and obs is not None else None
        if sim is not None:
            # The conversation's statistics so far (the accumulator itself: folds still
            # queued land in it) on the node of its last token; Krul reads them there.
            end = up_to - up_to % self.tree_core.page_size
            if end:
                self.tree_core.attach(self._key(req, end), end, KRUL_STATS, sim)
        if not self.keep_lines:
            return
        lines = self.hub.take_lines(req.rid, up_to)
        if lines is not None:
            if self.tree_core.attach(self._key(req, lines.end), lines.end, LINES, lines.layers):
                self.hub.set_seeds(req.rid, lines)  # the next chunk of this request continues it

    @staticmethod
    def _key(req, end: int):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(req.full_untruncated_fill_ids[:end], req.extra_key,
                        cache_salt=req.cache_salt)

    def _load_back(self, node_id, mem_quota=None, req=None) -> bool:
        # Krul: a compressed node that fails its checksum is never loaded (recomputed).
        if self.krul is None:
            return super()._load_back(node_id, mem_quota, req)
        node = self.tree_core.node_by_id(node_id)
        if not self.krul.verify_path(node):
            return False
        # Rows a restore recomputes (the profile's pyramid): read before the load commits
        # the device slots, run once it has (sglang's loader then brings the rest).
        restore = self.krul.restore_plan(node)
        if restore is not None and not self.krul.can_recompute():
            return False
        if not super()._load_back(node_id, mem_quota, req):
            return False
        if restore is not None:  # joined in ready_to_load_host_cache, after the load
            self.krul.recompute.start(restore, self.tree_core.root_node)
        return True

    def evict_host(self, num_tokens: int, component_type=ComponentType.FULL) -> int:
        # Krul: compressed nodes free fewer bytes than their tokens take at full size, so
        # evict until the host pool can take ``num_tokens`` full-size tokens.
        pool = self.krul.pool() if self.krul is not None else None
        if pool is None or component_type != ComponentType.FULL:
            return super().evict_host(num_tokens, component_type)
        from sgl_spec.tiers.arena import evict_for_bytes

        stock = super().evict_host
        return evict_for_bytes(pool.available_size, lambda n: stock(n, component_type),
                               num_tokens)

    def _update_metrics(self) -> None:
        super()._update_metrics()
        if self.rounds is not None:
            self.spec_metrics.update_tiers(self.rounds.totals())
        if self.krul is not None:
            self.spec_metrics.update_krul(self.krul.totals())

    def summary(self) -> dict:
        out = super().summary()
        if self.rounds is not None:
            out["tiers"] = self.rounds.totals()
            if self.spec_metrics is not None:
                self.spec_metrics.update_tiers(out["tiers"])
        if self.krul is not None:
            out["krul"] = self.krul.totals()
            if self.spec_metrics is not None:
                self.spec_metrics.update_krul(out["krul"])
        return out

    def _dead(self) -> dict[int, int] | None:
        core = self.tree_core
        if not core.turn_eviction:
            return None
        out = {}
        for seg in node_segments(core):
            node = core.node_by_id(seg.id)
            if not node.children and core.eviction_strategy.is_dead(node):
                out[seg.id] = core.dead_tokens(node)
        return out


def _walkable(core) -> bool:
    try:
        core.root_node  # noqa: B018  (the compiled core raises NotImplementedError)
        return True
    except NotImplementedError:
        return False


def create_cache(ctx: TreeCacheBuildContext):
    """Factory registered with sglang's radix-cache registry."""
    from .server_format import turn_format_for

    cfg = current()
    fmt = turn_format_for(ctx.server_args)
    cls = TaggedRadixCache if cfg.tagged_cache else SpecRadixCache
    links = CoreLinks.of(getattr(ctx.tp_worker, "model_runner", None))
    logger.info("sgl_spec radix cache: %s tree core (eviction %s)", cls.tree_core_name,
                cfg.cache.eviction)
    return create_unified_radix_cache(ctx, cache_class=lambda p: cls(p, fmt, cfg, links))
