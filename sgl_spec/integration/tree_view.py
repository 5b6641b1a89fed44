"""The radix tree as ``sgl_spec.cache.summary.Segment``s, read on demand.

Two readers, one per kind of tree core:

* ``node_segments``: sglang's Python tree core (and sgl_spec's turn-tagged one): a
  segment per node, with its key's token ids, its tier and (tagged core) its wall-clock
  access time;
* ``SlotTokens``: sglang's compiled (Rust) core, whose nodes Python cannot walk. The
  core flattens its device slots into (slot, position, previous slot) rows
  (``walk_for_kv_canary``); the token id of each slot comes from the cache's recent
  inserts, which it records by reference (a deque append: the insert path pays about
  a microsecond) and replays when the tree is read. Chains of slots between branch
  points become segments. Host-tier tokens of this
  core are not visible here (the summary then reports device tokens only).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch
from sglang.srt.mem_cache.unified_cache.unified_tree_core import BASE_COMPONENT_TYPE

from sgl_spec.cache.summary import Segment

from .tiers.krul import KRUL


def _tier(node) -> str | None:
    if node.component_data[BASE_COMPONENT_TYPE].value is not None:
        return "device"
    if getattr(node, "backuped", False):
        return "host"
    return None


def node_segments(core) -> list[Segment]:
    """A segment per node of a Python tree core (``core.root_node`` walkable)."""
    out, root = [], core.root_node
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        spec = getattr(node, "spec", None)
        # Krul's record on a compressed node (integration.krul.KrulMeta)
        krul = ((spec.payloads or {}).get(KRUL) if spec is not None else None)
        meta = krul[1] if krul is not None else None
        out.append(Segment(
            node.id, None if node.parent is root else node.parent.id,
            np.frombuffer(node.key.raw_token_ids(), dtype=np.int64), _tier(node),
            spec.atime if spec is not None else float("nan"),
            getattr(meta, "stored_bytes", 0), getattr(meta, "full_bytes", 0),
        ))
        stack.extend(node.children.values())
    return out


class SlotTokens:
    """The token ids of the compiled core's KV slots, from the cache's recent inserts.

    An insert records references to its key (the token array is private to the insert)
    and its slots, O(1): nothing is copied or scattered on the insert path. When the
    tree is read, the inserts are replayed newest first, each slot taking the token of
    the newest insert that wrote it, until every cached slot is known. Every insert
    records its whole key (the prefix it matched too), so the newest inserts cover the
    prefixes in use, HiCache's loaded-back ones included; the oldest are dropped once
    the recorded inserts hold more than ``budget`` tokens (a slot no recorded insert
    reaches reads -1: "unknown").
    """

    def __init__(self, budget: int):
        self.budget = max(budget, 1)
        self._inserts: deque[tuple] = deque()  # (token array, slots, wall time)
        self._held = 0  # tokens the recorded arrays hold (their full lengths)

    def record(self, ids, value: torch.Tensor) -> None:
        """An insert of the tokens ``ids[:len(value)]`` (an array private to the insert:
        RadixKey.token_ids) with KV slots ``value`` [n] int64. Kept cheap: it runs on
        every insert."""
        self._inserts.append((ids, value, time.time()))
        self._held += len(ids)
        if self._held > self.budget:
            while self._held > self.budget and len(self._inserts) > 1:
                self._held -= len(self._inserts.popleft()[0])

    def reset(self) -> None:
        self._inserts.clear()
        self._held = 0

    def lookup(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token id, last insert time) of each of ``slots`` [n] int64 (-1, nan: unknown)."""
        size = int(slots.max()) + 1 if len(slots) else 1
        tokens = np.full(size, -1, dtype=np.int64)
        atime = np.full(size, np.nan)
        todo = np.zeros(size, dtype=bool)
        todo[slots] = True
        left = int(todo.sum())
        for ids, value, t in reversed(self._inserts):
            v = value.cpu().numpy()
            k = np.frombuffer(ids, dtype=np.int64)[: len(v)]
            if int(v.max()) >= size:  # slots no longer cached: beyond every cached one
                keep = v < size
                v, k = v[keep], k[keep]
            mask = todo[v]
            if not mask.any():
                continue
            hit = v[mask]  # an insert's slots are distinct
            tokens[hit] = k[mask]
            atime[hit] = t
            todo[hit] = False
            left -= len(hit)
            if left <= 0:
                break
        return tokens[slots], atime[slots]

    def segments(self, core) -> list[Segment]:
        """Chains of device slots between branch points, as segments."""
        walk = core.walk_for_kv_canary(False, False)
        slot = walk.slot_indices.cpu().numpy().astype(np.int64)
        pos = walk.positions.cpu().numpy().astype(np.int64)
        prev = walk.prev_slot_indices.cpu().numpy().astype(np.int64)
        n = len(slot)
        if n == 0:
            return []
        tokens, atime = self.lookup(slot)
        row_of = np.full(int(max(slot.max(), prev.max())) + 1, -1, dtype=np.int64)
        row_of[slot] = np.arange(n)
        parent = np.where(prev >= 0, row_of[np.maximum(prev, 0)], -1)
        children = np.bincount(parent[parent >= 0], minlength=n)
        start = (parent < 0) | (children[np.maximum(parent, 0)] != 1)
        # Each row's chain head, by pointer doubling: a head points to itself.
        head = np.where(start, np.arange(n), parent)
        while not start[head].all():
            head = np.where(start[head], head, head[head])
        order = np.lexsort((pos, head))
        bounds = np.flatnonzero(np.diff(head[order])) + 1
        segs = []
        for rows in np.split(order, bounds):
            up = parent[rows[0]]
            times = atime[rows]
            t = float(np.nanmax(times)) if not np.isnan(times).all() else float("nan")
            segs.append(Segment(int(slot[rows[0]]), None if up < 0 else int(slot[head[up]]),
                                tokens[rows], "device", t))
        return segs
