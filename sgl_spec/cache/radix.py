"""sgl_spec's radix-cache backend (``--radix-cache-backend sgl_spec``).

A subclass of sglang's UnifiedRadixCache, built through sglang's own
``create_unified_radix_cache`` so HiCache attachment keeps working. Its tree core
is :class:`~sgl_spec.cache.tree_core.SpecTreeCore` (the turn-aware tree), plugged
in through sglang's tree-core registry. The turn format comes from the served
model's chat template and ``--reasoning-parser``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sgl_spec.sglang_compat import check_version

check_version()

from sglang.srt.mem_cache.registry import (  # noqa: E402
    TreeCacheBuildContext,
    create_unified_radix_cache,
)
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (  # noqa: E402
    get_tree_core_factory,
    register_tree_core_backend,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402

from sgl_spec.cache.rounds import RequestRounds, set_registry  # noqa: E402
from sgl_spec.cache.summary import summary  # noqa: E402
from sgl_spec.cache.tree_core import SpecTreeCore  # noqa: E402
from sgl_spec.cache.turn_format import TurnFormat  # noqa: E402

logger = logging.getLogger(__name__)

TREE_CORE = "sgl_spec"

# Called with the rid of every request whose KV row the scheduler releases
# (finished, aborted, retracted), in the scheduler thread. Process-wide: the
# attention backend registers here to free per-request state kept outside the tree.
_RELEASE_LISTENERS: list[Callable[[str], None]] = []


def add_release_listener(fn: Callable[[str], None]) -> None:
    if fn not in _RELEASE_LISTENERS:
        _RELEASE_LISTENERS.append(fn)


def remove_release_listener(fn: Callable[[str], None]) -> None:
    if fn in _RELEASE_LISTENERS:
        _RELEASE_LISTENERS.remove(fn)


def _tree_core_factory(params, components):
    fmt, eviction = getattr(params, "sgl_spec_turns", (None, "lru"))
    return SpecTreeCore(params, components, fmt=fmt, eviction=eviction)


if get_tree_core_factory(TREE_CORE) is None:
    register_tree_core_backend(TREE_CORE, _tree_core_factory)


class SpecRadixCache(UnifiedRadixCache):
    """UnifiedRadixCache over the turn-aware tree core.

    ``params.sgl_spec_turns = (TurnFormat | None, eviction)`` selects the format
    and the eviction policy ("lru" or "turn"); without it the cache tags
    nothing and evicts like stock.
    """

    def __init__(self, params):
        params.tree_core_backend = TREE_CORE
        fmt, _ = getattr(params, "sgl_spec_turns", (None, "lru"))
        self.turn_format: TurnFormat | None = fmt
        self.rounds = RequestRounds(fmt)
        super().__init__(params)
        self.spec_metrics = None
        if params.enable_metrics:
            from sgl_spec.cache.metrics import CacheMetrics

            self.spec_metrics = CacheMetrics()

    def insert(self, params):
        result = super().insert(params)
        core = self.tree_core
        if self.disable or params.key is None or len(params.key) == 0:
            return result
        node = core._node_arena.get(result.last_device_node)
        if node is not None:
            core.harden_below(node)  # stock splits where an insert ends
        if self.turn_format is not None and not core.precuts:
            key = params.key.page_aligned(core.page_size)
            self._apply_cache_actions(core.cut_path(key))
        if self.spec_metrics is not None:
            self.spec_metrics.maybe_update(core)
        return result

    def match_prefix(self, params):
        req = params.req
        if req is not None:
            self.rounds.observe(req.rid, req.origin_input_ids)
        return super().match_prefix(params)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if not checkpointed:
            self.rounds.release(req.rid)
        for fn in _RELEASE_LISTENERS:
            fn(req.rid)

    def summary(self) -> dict:
        """The tree summary served at ``GET /sgl_spec/cache``."""
        if self.spec_metrics is not None:
            self.spec_metrics.maybe_update(self.tree_core, force=True)
        return summary(self.tree_core)


def create_cache(ctx: TreeCacheBuildContext):
    """Factory registered with sglang's radix-cache registry."""
    from sgl_spec import config as spec_config
    from sgl_spec.cache.server_format import turn_format_for

    ctx.params.sgl_spec_turns = (
        turn_format_for(ctx.server_args),
        spec_config.current().cache_eviction,
    )
    cache = create_unified_radix_cache(ctx, cache_class=SpecRadixCache)
    if isinstance(cache, SpecRadixCache):
        set_registry(cache.rounds)
    return cache
