"""The turn-aware radix tree: sglang's Python TreeCore with nodes cut at turns.

Every node carries a :class:`NodeData` (``node.spec``): the turn it belongs to
(:class:`~sgl_spec.cache.segment.TurnTag`: turn index, role, round index,
reasoning or not), whether that turn is closed at the node's end, and a payload
dict that later features fill per node (selected attention lines, host-resident
round KV, compressed cross-layer KV).

After each insert, the inserted path is cut at turn and reasoning boundaries so
no node spans two. Those cuts are *soft*: stock sglang would not have made them.
A soft boundary becomes hard as soon as stock would split there too (a branch,
an insert or a match that ends at it). Under LRU eviction, a leaf whose
boundary with its parent is soft is evicted together with that parent, so the
tree frees exactly the tokens stock's coarser node would have: match lengths and
evicted-token counts stay identical to the stock cache (tested side by side).

Payloads: ``node.spec.payloads`` maps a name to ``(off, value)``: ``value`` belongs to
the node's tokens ``[0, off)`` from the node's start (LoopServe's kept lines: those of
an extend ending at the node's ``off``-th token). A split hands it to the upper part
when ``off`` falls there (and to both parts for ``prefix_payloads``, whose value serves
any prefix: round mode's stored rounds); the payload leaves the tree with its node.

The cache uses this core only where a feature reads tags (``SpecConfig.tagged_cache``);
otherwise it runs sglang's compiled core.

With ``--spec-cache-eviction turn`` the eviction order is: leaves of finished
turns' reasoning spans that the chat template drops from later history (dead
branches: never matched again), then the least recently active conversations,
oldest rounds first; locked nodes are never evicted (sglang's leaf sets already
exclude them). Tokens freed are counted per rule.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV
from sglang.srt.mem_cache.unified_cache.unified_tree_core import (
    BASE_COMPONENT_TYPE,
    UnifiedTreeCore,
    get_and_increase_time_counter,
)

from sgl_spec.cache.metrics import RULES
from sgl_spec.cache.segment import Span, TurnTag, as_numpy, segment
from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import CACHE_EVICTIONS

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import RadixKey

logger = logging.getLogger(__name__)


class NodeData:
    """sgl_spec's per-node record (``node.spec``); ``payloads``: see the module docstring."""

    __slots__ = ("tag", "soft", "close_off", "atime", "payloads")

    def __init__(self):
        self.tag: TurnTag | None = None
        self.soft = False  # boundary with the parent exists only as a turn cut
        # Offset in the node after which its turn is closed (0: closed before the
        # node starts); None while the turn is open at the node's end.
        self.close_off: int | None = None
        self.atime = time.time()
        self.payloads: dict[str, tuple[int, object]] | None = None


def is_closed(node) -> bool:
    """Whether the node's turn has ended at or before the node's end."""
    return node.spec.close_off is not None


class SpecTreeCore(UnifiedTreeCore):
    """UnifiedTreeCore whose nodes never span two turns. Not thread-safe: like
    the stock core, it is driven by the scheduler thread only."""

    def __init__(self, params, components, fmt: TurnFormat | None, eviction: str):
        if eviction not in CACHE_EVICTIONS:
            raise ValueError(
                f"--spec-cache-eviction {eviction!r} is invalid; valid values: "
                f"{', '.join(CACHE_EVICTIONS)}"
            )
        self.fmt = fmt
        self.turn_eviction = eviction == "turn"
        self.krul = None  # krul.Compressor, set by the cache with --spec-krul
        # Payloads recorded per whole node (not per token offset): a split drops them from
        # both parts and calls name -> fn(upper, lower, value) to make them again.
        self.whole_node_payloads: dict[str, object] = {}
        # Payloads whose value serves any prefix of its tokens (round mode's stored
        # rounds): a split inside their span leaves them on both parts.
        self.prefix_payloads: set[str] = set()
        self.freed_by_rule = {r: 0 for r in RULES}
        # Write-back victims awaiting their demote: leaf id -> (rule, unit above it).
        self._write_back_units: dict[int, tuple[str, list[int]]] = {}
        self._cutting = False
        super().__init__(params, components)
        # Cut the new tail while inserting it (FULL-only trees, page size 1);
        # otherwise cut_path() cuts after the insert.
        self.precuts = fmt is not None and self.component_types == (
            BASE_COMPONENT_TYPE,) and self.page_size == 1
        if self.turn_eviction:
            from .eviction import TurnAwareStrategy

            policy = params.eviction_policy.lower()
            if policy not in ("lru", "priority"):
                logger.warning("--spec-cache-eviction turn orders eviction by turns and "
                               "conversations; --radix-eviction-policy %s is not applied "
                               "(lru and priority are)", policy)
            self.eviction_strategy = TurnAwareStrategy(self, by_priority=policy == "priority")

    # ---- node records -------------------------------------------------------
    def _new_node(self, priority: int = 0):
        node = super()._new_node(priority)
        node.spec = NodeData()
        return node

    def _touch_node(self, node):
        super()._touch_node(node)
        node.spec.atime = time.time()

    def _split_node(self, key, child, split_len):
        old_soft = child.spec.soft
        new_node, action = super()._split_node(key, child, split_len)
        data = new_node.spec
        data.tag, data.soft, data.atime = child.spec.tag, old_soft, child.spec.atime
        off = child.spec.close_off
        data.close_off = off if off is not None and off <= split_len else None
        child.spec.close_off = None if off is None else max(0, off - split_len)
        payloads = child.spec.payloads
        if payloads:
            whole = self.whole_node_payloads
            upper = {name: (min(p[0], split_len), p[1]) for name, p in payloads.items()
                     if (p[0] <= split_len or name in self.prefix_payloads)
                     and name not in whole}
            lower = {name: (off - split_len, v) for name, (off, v) in payloads.items()
                     if off > split_len and name not in whole}
            data.payloads, child.spec.payloads = upper or None, lower or None
            for name, remake in whole.items():
                if name in payloads:
                    remake(new_node, child, payloads[name][1])
        child.spec.soft = self._cutting
        if not self._cutting:
            # Stock split: the lower part is a new node in stock too, with a fresh
            # access time; the soft chain below it is the same stock node.
            self._refresh_soft_chain(child)
        return new_node, action

    def _add_new_node(self, parent, key, value, *args, **kwargs):
        # Stock splits where a second child branches off: the boundary is hard.
        self.harden_below(parent)
        state = self._ongoing_insert_walk_state
        if not self.precuts or state is None:
            return super()._add_new_node(parent, key, value, *args, **kwargs)
        # Insert the new tail already cut at turn boundaries: a chain of nodes,
        # soft-joined, instead of one node split afterwards (cheaper).
        start = state.total_prefix_length
        anchors, back = [], 0
        node = parent
        while node is not self.root_node and back < self.fmt.longest:
            anchors.append(node)
            back += len(node.key)
            node = node.parent
        anchors.reverse()
        tokens = np.concatenate(
            [as_numpy(a.key.raw_token_ids()) for a in anchors]
            + [as_numpy(key.raw_token_ids())]
        )
        spans = self._segment_after(node, tokens, start - back)
        # Re-tag the nodes just above (a marker may start in them, or a pending
        # opener's role become known); a cut there is a split like any other.
        state.pending_actions.extend(self._cut(anchors, start - back, spans))
        leaf, pos, cur = None, start, parent
        for span in spans:
            if span.end <= start:
                continue
            a, b = max(span.start, pos) - start, span.end - start
            leaf = super()._add_new_node(cur, key[a:b], value[a:b], *args, **kwargs)
            leaf.spec.soft = cur is not parent
            self._tag(leaf, span, span.end)
            cur, pos = leaf, span.end
        return leaf

    def _refresh_soft_chain(self, node) -> None:
        t = node.last_access_time
        while len(node.children) == 1:
            (c,) = node.children.values()
            if not c.spec.soft:
                break
            t += 1e-7
            c.last_access_time = t
            node = c

    def harden_below(self, node) -> None:
        """Stock would split at ``node``'s end: its soft children become hard, and
        get the fresh access time stock gives the lower part of a split."""
        for c in node.children.values():
            if c.spec.soft:
                c.spec.soft = False
                c.last_access_time = get_and_increase_time_counter()
                self._refresh_soft_chain(c)

    # ---- payloads -------------------------------------------------------------
    def attach(self, key: RadixKey, end: int, name: str, value) -> bool:
        """Keep ``value`` on the node holding token ``end - 1`` of ``key``'s path
        (tokens ``[0, end)``); False if the tree does not hold them."""
        node, pos = self.root_node, 0
        while pos < end:
            child = node.children.get(key.child_key_at(pos, self.page_size))
            if child is None:
                return False
            node, pos = child, pos + len(child.key)
        data = node.spec
        data.payloads = {**(data.payloads or {}), name: (end - (pos - len(node.key)), value)}
        return True

    def deepest(self, node_id, name: str) -> tuple[int, object] | None:
        """``(end, value)`` of the deepest ``name`` payload on the path to ``node_id``
        (every node of a matched path is wholly matched: ``end`` <= the match)."""
        path, node = [], self._node_arena.get(node_id)
        while node is not None and node is not self.root_node:
            path.append(node)
            node = node.parent
        depth = sum(len(n.key) for n in path)
        for n in path:  # deepest first
            depth -= len(n.key)
            hit = (n.spec.payloads or {}).get(name)
            if hit is not None:
                return depth + hit[0], hit[1]
        return None

    # ---- turn cuts ----------------------------------------------------------
    def cut_path(self, key: RadixKey) -> list:
        """Split the nodes on ``key``'s path at turn and reasoning boundaries and
        tag them. Only the untagged tail (the new leaf) is segmented, resuming
        from the tag of the node before it, a few tokens early so a marker that
        straddles the old end is seen. Returns split actions for the cache."""
        path, starts = [], []
        node, pos, n = self.root_node, 0, len(key)
        first_new = None
        while pos < n:
            child = node.children.get(key.child_key_at(pos, self.page_size))
            if child is None:
                break
            if first_new is None and child.spec.tag is None:
                first_new = len(path)
            path.append(child)
            starts.append(pos)
            node, pos = child, pos + len(child.key)
        if first_new is None or self.fmt is None:
            return []
        j = first_new
        while j > 0 and starts[first_new] - starts[j] < self.fmt.longest:
            j -= 1
        prev = path[j - 1] if j > 0 else self.root_node
        tokens = as_numpy(key.raw_token_ids()[:pos])[starts[j]:]
        return self._cut(path[j:], starts[j], self._segment_after(prev, tokens, starts[j]))

    def _segment_after(self, prev, tokens, base: int) -> list[Span]:
        """Spans of ``tokens`` (sequence positions from ``base``), which follow
        node ``prev`` on their path: segmentation resumes from prev's tag."""
        state = None
        if prev is not self.root_node:
            off = prev.spec.close_off
            closed = None if off is None else base - len(prev.key) + off
            state = (prev.spec.tag, closed)
        return segment(tokens, self.fmt, 0, state, base=base)

    def _cut(self, nodes, pos: int, spans: list[Span]) -> list:
        actions = []
        si = 0
        ps = self.page_size
        for child in nodes:
            end = pos + len(child.key)
            while spans[si].end <= pos:
                si += 1
            while spans[si].end < end:
                boundary = spans[si].end // ps * ps  # a cut falls on a page edge
                if boundary > pos:
                    self._cutting = True
                    try:
                        upper, action = self._split_node(child.key, child, boundary - pos)
                    finally:
                        self._cutting = False
                    if action is not None:
                        actions.append(action)
                    self._tag(upper, spans[si], boundary)
                    pos = boundary
                si += 1
            self._tag(child, spans[si], end)
            pos = end
        return actions

    @staticmethod
    def _tag(node, span: Span, node_end: int) -> None:
        data = node.spec
        data.tag = span.tag
        closed = span.closed_at
        data.close_off = (
            max(0, closed - (node_end - len(node.key)))
            if closed is not None and closed <= node_end
            else None
        )

    # ---- stock-equivalence hooks -------------------------------------------
    def _match_post_processor(self, params, value, *args, **kwargs):
        visited = kwargs.get("last_visited_node_id")
        if visited is not None:
            node = self._node_arena.get(visited)
            if node is not None:
                self.harden_below(node)
        return super()._match_post_processor(params, value, *args, **kwargs)

    def match_full_device_prefix(self, key):
        matched, node_id, pinned = super().match_full_device_prefix(key)
        # Stock's deepest node also holds this node's soft continuation.
        node = self._node_arena[node_id]
        while len(node.children) == 1:
            (c,) = node.children.values()
            if not c.spec.soft or c.component_data[BASE_COMPONENT_TYPE].value is None:
                break
            pinned += len(c.key)
            node = c
        return matched, node_id, pinned

    # ---- eviction ---------------------------------------------------------------
    def _demote(self, node, tracker, device_frees, host_frees, cache_actions):
        super()._demote(node, tracker, device_frees, host_frees, cache_actions)
        if self.krul is not None:
            self.krul.compress(node)  # a write-back policy's copy: complete only now

    def finish_write_through(self, node_ids, ack_id) -> None:
        super().finish_write_through(node_ids, ack_id)
        if self.krul is not None:  # Krul: host copies are compressed once complete
            for node_id in node_ids:
                node = self.node_by_id(node_id)
                if node.write_through_pending_id is None:
                    self.krul.compress(node)

    def evict_device_start(self, component_type, request_cnt):
        if self.turn_eviction and component_type == BASE_COMPONENT_TYPE:
            self.eviction_strategy.prepare()
        self._write_back_units.clear()  # a failed backup's victim is never demoted
        super().evict_device_start(component_type, request_cnt)

    def evict_device_leaf(self, node_id, is_write_back):
        """Evict a leaf, then, in the same step, the nodes it forms one unit with:
        under LRU the soft chain above it (stock's coarser node); under turn
        eviction the rest of a dead reasoning branch. Doing it in one step keeps
        the unit whole even when the allocator's target is reached mid-way."""
        node = self.node_by_id(node_id)
        rule = self.rule_of(node)
        result = super().evict_device_leaf(node_id, is_write_back)
        if result.backup_kv is not None:
            # Write-back: the cache backs the victim up, then calls ``demote``. Back up
            # the whole unit (ancestors first, as BackupKV chains go) so that ``demote``
            # can release it in this step, as stock releases its one coarser node.
            unit = self._unit_above(node, rule)
            ids = [p.id for p in reversed(unit) if not p.backuped]
            result.backup_kv = BackupKV([*ids, *result.backup_kv.node_ids])
            self._write_back_units[node.id] = (rule, [p.id for p in unit])
            return result
        self.freed_by_rule[rule] += result.tracker.get(BASE_COMPONENT_TYPE, 0)
        top = node
        while True:
            parent = top.parent
            if parent is self.root_node or parent not in self.evictable_device_leaves:
                break
            if not self._same_unit(top, parent, rule):
                break
            step = super().evict_device_leaf(parent.id, is_write_back)
            if step.backup_kv is not None:  # cannot merge a pending backup
                self._merge(result, step)
                result.backup_kv = None
                break
            self.freed_by_rule[rule] += step.tracker.get(BASE_COMPONENT_TYPE, 0)
            self._merge(result, step)
            top = parent
        full = self.components_by_type[BASE_COMPONENT_TYPE]
        if top is not node and getattr(full, "is_evict_device_ongoing", False):
            full._evict_device_last_node = top  # the walk resumes above the unit
        return result

    def demote(self, node_id):
        """Stock's demote of a backed-up write-back victim, then of the unit above it
        (``evict_device_leaf`` had it backed up too), in the same step."""
        result = super().demote(node_id)
        pending = self._write_back_units.pop(node_id, None)
        if pending is None:
            return result
        rule, unit = pending
        self.freed_by_rule[rule] += result.tracker.get(BASE_COMPONENT_TYPE, 0)
        top = self.node_by_id(node_id)
        for parent_id in unit:
            parent = self._node_arena.get(parent_id)
            if (parent is None or parent is not top.parent or not parent.backuped
                    or parent not in self.evictable_device_leaves):
                break
            step = super().demote(parent_id)
            self.freed_by_rule[rule] += step.tracker.get(BASE_COMPONENT_TYPE, 0)
            self._merge(result, step)
            top = parent
        full = self.components_by_type[BASE_COMPONENT_TYPE]
        if top.id != node_id and getattr(full, "is_evict_device_ongoing", False):
            full._evict_device_last_node = top  # the walk resumes above the unit
        return result

    def _same_unit(self, node, parent, rule: str) -> bool:
        """``parent`` goes with ``node``: under LRU when ``node`` is a soft piece of
        stock's coarser node; under turn eviction when both are one dead branch."""
        return self._continues_dead(node, parent, rule) if self.turn_eviction else node.spec.soft

    def _unit_above(self, node, rule: str) -> list:
        """The ancestors (bottom-up) that would leave the device with ``node`` in one
        step: each the only child's parent, unlocked, on the device, same unit."""
        unit, top = [], node
        while True:
            parent = top.parent
            if (parent is self.root_node or len(parent.children) != 1 or parent.evicted
                    or any(cd.lock_ref > 0 for cd in parent.component_data)
                    or not self._same_unit(top, parent, rule)):
                return unit
            unit.append(parent)
            top = parent

    @staticmethod
    def _merge(into, step) -> None:
        """Move a step's frees, actions and counts into ``into`` (drains ``step``)."""
        for name in ("device_frees", "host_frees"):
            src, dst = getattr(step, name), getattr(into, name)
            for ct, values in src.items():
                dst.setdefault(ct, []).extend(values)
            src.clear()
        for ct, n in step.tracker.items():
            into.tracker[ct] = into.tracker.get(ct, 0) + n
        into.cache_actions.extend(step.cache_actions)
        step.cache_actions.clear()
        if hasattr(into, "unbacked_tokens"):
            into.unbacked_tokens += step.unbacked_tokens

    @staticmethod
    def _continues_dead(node, parent, rule: str) -> bool:
        """Under turn eviction, a dead branch is freed whole: from the leaf up to
        the first node of its reasoning span, and no further."""
        tag, ptag = node.spec.tag, parent.spec.tag
        return (
            rule == "dead_reasoning"
            and tag is not None
            and ptag is not None
            and ptag.turn == tag.turn
            and (ptag.reasoning or not tag.reasoning)
        )

    def dead_tokens(self, leaf) -> int:
        """Tokens the dead-reasoning rule frees with ``leaf``: up to its span's start."""
        node, n = leaf, len(leaf.key)
        while (node.parent is not self.root_node and len(node.parent.children) == 1
               and self._continues_dead(node, node.parent, "dead_reasoning")):
            node = node.parent
            n += len(node.key)
        return n

    def rule_of(self, node) -> str:
        if not self.turn_eviction:
            return "lru"
        return "dead_reasoning" if self.eviction_strategy.is_dead(node) else (
            "inactive_conversation"
        )

