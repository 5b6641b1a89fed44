"""The sliding-window (SWA) component over the turn-tagged tree core.

sglang's SWAComponent works per node: the eviction walk tombstones one internal
node's window KV per step, the LRU refresh and the window lock cover whole nodes
until they reach the window. The tagged core cuts stock's nodes into pieces at turn
boundaries (soft cuts, ``tree_core``), so done per piece these would tombstone,
refresh and lock fewer tokens than stock. Here each of these steps takes the *unit*: the soft chain that
is one stock node. With ``--spec-cache-eviction lru`` the window KV freed and the
match lengths then equal stock's (``tests/test_turn_cache_swa.py``).

Not joined (still per piece, untested): the HiCache host-tier SWA paths (write-back
backup of a window, host hit counting in ``finalize_match_result_in_tree_core``),
session radix caches, and an insert over a tombstone whose live window starts exactly
at a soft cut (stock splits there: ``_clip_to_window``; the cut stays soft).
"""

from __future__ import annotations

from sglang.srt.mem_cache.unified_cache.components.base import (
    ComponentType,
    EvictLayer,
    LRURefreshPhase,
)
from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent


def stock_node(node) -> list:
    """The pieces (top first) of the stock node that holds ``node``: a soft
    boundary exists only as a turn cut, so it joins a piece to its parent."""
    top = node
    while top.spec.soft:
        top = top.parent
    unit = [top]
    while len(unit[-1].children) == 1:
        (child,) = unit[-1].children.values()
        if not child.spec.soft:
            break
        unit.append(child)
    return unit


def stock_window(node, root, window: int) -> int:
    """Tokens from ``node`` up that a per-node walk covering ``window`` tokens
    covers over stock's nodes: the piece that reaches the window carries on to
    the top of its stock node."""
    covered, cur = 0, node
    while cur is not root and covered < window:
        covered += len(cur.key)
        while covered >= window and cur.spec.soft:
            cur = cur.parent
            covered += len(cur.key)
        cur = cur.parent
    return covered


class SpecSWAComponent(SWAComponent):
    """SWAComponent whose per-node steps take a whole stock node (a soft unit)."""

    def refresh_lru(self, phase, node, root_node) -> None:
        if phase not in (LRURefreshPhase.MATCH_END, LRURefreshPhase.INSERT_END):
            return super().refresh_lru(phase, node, root_node)
        window = stock_window(node, root_node, self.sliding_window_size + self.tree_core.page_size)
        self.tree_core.lru_lists[self.component_type].reset_node_and_window_ancestors_mru(
            node, root_node, window, self.node_has_component_data)

    def acquire_component_lock(self, node, result, lock_host: bool = False):
        # The lock's boundary (its uuid) lands on the top piece of the stock node
        # that reaches the window, so the release, which walks to it, mirrors it.
        window = self.sliding_window_size
        self.sliding_window_size = stock_window(node, self.tree_core.root_node, window)
        try:
            return super().acquire_component_lock(node, result, lock_host)
        finally:
            self.sliding_window_size = window

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        core, ct = self.tree_core, self.component_type
        lru = core.lru_lists[ct]
        if core.enable_session_radix_cache or (core.enable_hicache and core.is_write_back):
            return super()._evict_device_next_node(tracker, device_frees, host_frees,
                                                   cache_actions)
        cursor = self._evict_device_cursor
        if cursor is not None and not lru.in_list(cursor):
            cursor = self._evict_device_cursor = lru.get_lru_no_lock()
        if cursor is None or tracker[ct] >= self._evict_device_request_cnt:
            return None
        unit = stock_node(cursor)
        if len(unit) == 1:
            return super()._evict_device_next_node(tracker, device_frees, host_frees,
                                                   cache_actions)
        # One step for the whole stock node, as stock's walk takes it.
        ids = {p.id for p in unit}
        nxt = cursor
        while nxt is not None and nxt.id in ids:
            nxt = lru.get_prev_no_lock(nxt)
        self._evict_device_cursor = nxt
        if unit[-1] in core.evictable_device_leaves:
            return unit[-1].id  # the core's evict_device_leaf frees the soft chain above
        for piece in unit:
            cd = piece.component_data[ct]
            if cd.value is None or cd.lock_ref > 0:
                continue
            core._evict_component_and_detach_lru(
                piece, self, target=EvictLayer.DEVICE, tracker=tracker,
                device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions)
            core._cascade_evict(piece, self, tracker, device_frees=device_frees,
                                host_frees=host_frees, cache_actions=cache_actions)
        return None


COMPONENTS = {ComponentType.SWA: SpecSWAComponent}
