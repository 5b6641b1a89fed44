"""Turn-aware eviction order (``--spec-cache-eviction turn``).

Priority of an evictable leaf, smallest evicted first:

1. dead reasoning branches: the leaf lies in a finished assistant turn whose
   reasoning span sits on the same unbranched chain, and the chat template drops
   earlier turns' reasoning from the history it renders. The next request of that
   conversation diverges at the reasoning start, so the branch can never be
   matched again (SGLang issue #22373: 1-1.5 GB per turn on reasoning models);
2. then by conversation: the least recently active conversation first (a
   conversation is the subtree below the node where its first round begins; its
   activity is the newest access anywhere in it, locked requests included);
3. within a conversation, the oldest round first (stale forks of earlier rounds
   before the live tail), then plain LRU.

Under ``--radix-eviction-policy priority`` a request's priority comes first, as in
sglang's PriorityStrategy (lower evicted first), and this order within a priority.

Locked nodes never enter sglang's evictable-leaf set, so they are never chosen.
"""

from __future__ import annotations

from sglang.srt.mem_cache.evict_policy import EvictionStrategy


class TurnAwareStrategy(EvictionStrategy):
    def __init__(self, core, by_priority: bool = False):
        self.core = core
        self.by_priority = by_priority
        self._conv_of: dict[int, int] = {}
        self._conv_time: dict[int, float] = {}

    def prepare(self) -> None:
        """Recompute conversation activity (one DFS) before an eviction walk."""
        core = self.core
        conv_of, conv_time = {}, {}
        stack = [(c, None) for c in core.root_node.children.values()]
        while stack:
            node, anchor = stack.pop()
            tag = node.spec.tag
            if anchor is None and (tag is None or tag.round >= 1 or tag.role is None):
                # First node of a conversation's first round, or raw text.
                anchor = node.id
            key = anchor if anchor is not None else node.id
            conv_of[node.id] = key
            t = node.last_access_time
            if t > conv_time.get(key, float("-inf")):
                conv_time[key] = t
            stack.extend((c, anchor) for c in node.children.values())
        self._conv_of, self._conv_time = conv_of, conv_time

    def is_dead(self, leaf) -> bool:
        fmt = self.core.fmt
        if fmt is None or not fmt.drops_reasoning or fmt.think is None:
            return False
        tag = leaf.spec.tag
        if tag is None or tag.role != "assistant" or leaf.spec.close_off is None:
            return False
        root = self.core.root_node
        node = leaf
        while node is not root:
            t = node.spec.tag
            if t is None or t.turn != tag.turn:
                return False
            if t.reasoning:
                return True
            if len(node.parent.children) > 1:  # reached the branch point
                return False
            node = node.parent
        return False

    def get_priority(self, node):
        first = (node.priority,) if self.by_priority else ()
        if self.is_dead(node):
            return (*first, 0, 0.0, 0, node.last_access_time)
        conv = self._conv_of.get(node.id, node.id)
        tag = node.spec.tag
        return (
            *first,
            1,
            self._conv_time.get(conv, node.last_access_time),
            tag.round if tag is not None else 0,
            node.last_access_time,
        )
