"""The tree summary behind ``GET /sgl_spec/cache``, derived on demand from token ids.

The integration hands over the tree as ``Segment``s (a node of the tagged tree core,
or a run of KV slots between branch points of sglang's compiled core, with the
token ids kept beside it) and this module does the rest: per conversation branch (a
root-to-leaf path) it segments the branch's tokens into turns and rounds with the
model's ``TurnFormat`` (so nothing is tagged at insert time) and reports, per round,
its turns with role and token counts, how many tokens sit on device and on host, and
when the round was last accessed. Totals by role and tier feed the Prometheus gauges.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .segment import segment
from .turn_format import TurnFormat

MAX_BRANCHES = 64
TIERS = ("device", "host")


class Segment(NamedTuple):
    """A run of cached tokens with one parent, one tier and one access time."""

    id: int
    parent: int | None  # the segment above it; None: a child of the root
    tokens: np.ndarray  # [n] int64 token ids
    tier: str | None  # "device", "host", or None (neither: a tombstone)
    atime: float  # last access, seconds since the epoch (nan: unknown)
    # Krul: what the host tier stores for it, and what a full copy would (0: not compressed)
    stored_bytes: int = 0
    full_bytes: int = 0


class _Tree:
    def __init__(self, segments: Sequence[Segment]):
        self.by_id = {s.id: s for s in segments}
        self.children: dict[int | None, list[int]] = {}
        for s in segments:
            self.children.setdefault(s.parent, []).append(s.id)
        order, stack = [], list(self.children.get(None, []))
        while stack:
            sid = stack.pop()
            order.append(sid)
            stack.extend(self.children.get(sid, []))
        # Effective access time: the newest access in the subtree.
        self.eff: dict[int, float] = {}
        for sid in reversed(order):
            t = self.by_id[sid].atime
            for c in self.children.get(sid, []):
                t = _newer(t, self.eff[c])
            self.eff[sid] = t
        self.leaves = [sid for sid in order if not self.children.get(sid)]

    def path(self, leaf: int) -> list[Segment]:  # root to leaf
        out, sid = [], leaf
        while sid is not None:
            seg = self.by_id[sid]
            out.append(seg)
            sid = seg.parent
        return out[::-1]

    def exclusive(self, leaf: int) -> int:
        """Tokens below the branch point: what evicting the branch frees."""
        n, sid = 0, leaf
        while sid is not None:
            seg = self.by_id[sid]
            n += len(seg.tokens)
            if len(self.children.get(seg.parent, [])) > 1:
                break
            sid = seg.parent
        return n


def _newer(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def _spans(tokens: np.ndarray, fmt: TurnFormat | None):
    if fmt is None or not len(tokens):
        from .segment import UNTAGGED, Span

        return [Span(0, len(tokens), UNTAGGED, None)] if len(tokens) else []
    return segment(tokens, fmt)


def _branch_rounds(path: list[Segment], fmt: TurnFormat | None, now: float) -> list[dict]:
    tokens = np.concatenate([s.tokens for s in path]) if path else np.zeros(0, np.int64)
    bounds = np.cumsum([0] + [len(s.tokens) for s in path])
    rounds: list[dict] = []
    for span in _spans(tokens, fmt):
        # The segments the span overlaps, and how many of its tokens each holds.
        first = int(np.searchsorted(bounds, span.start, side="right")) - 1
        tiers = {"device": 0, "host": 0}
        atime = float("nan")
        for i in range(first, len(path)):
            lo, hi = max(span.start, bounds[i]), min(span.end, bounds[i + 1])
            if lo >= hi:
                break
            if path[i].tier in tiers:
                tiers[path[i].tier] += int(hi - lo)
            atime = _newer(atime, path[i].atime)
        tag, n = span.tag, span.end - span.start
        if not rounds or rounds[-1]["round"] != tag.round:
            rounds.append({"round": tag.round, "tokens": 0, "device_tokens": 0,
                           "host_tokens": 0, "last_access": float("nan"), "turns": []})
        r = rounds[-1]
        r["tokens"] += n
        r["device_tokens"] += tiers["device"]
        r["host_tokens"] += tiers["host"]
        r["last_access"] = _newer(r["last_access"], atime)
        turns = r["turns"]
        if not turns or turns[-1]["turn"] != tag.turn:
            turns.append({"turn": tag.turn, "role": tag.role, "tokens": 0,
                          "reasoning_tokens": 0})
        t = turns[-1]
        t["tokens"] += n
        if tag.role is not None:
            t["role"] = tag.role
        if tag.reasoning:
            t["reasoning_tokens"] += n
    for r in rounds:
        dev, host = r["device_tokens"], r["host_tokens"]
        r["tier"] = "device" if host == 0 else ("host" if dev == 0 else "mixed")
        r["last_access_s_ago"] = _ago(now, r.pop("last_access"))
    return rounds


def _ago(now: float, t: float) -> float | None:
    return None if math.isnan(t) else round(now - t, 3)


def totals(segments: Sequence[Segment], fmt: TurnFormat | None) -> dict:
    """Cached tokens by role (segmenting each branch once) and by tier, and the count
    of segments. Every token is counted once, in the first branch that holds it."""
    tree = _Tree(segments)
    by_role: dict[str, int] = {}
    by_tier = dict.fromkeys(TIERS, 0)
    counted: set[int] = set()
    for leaf in tree.leaves:
        path = tree.path(leaf)
        todo = [i for i, s in enumerate(path) if s.id not in counted and s.tier in by_tier]
        if not todo:
            continue
        tokens = np.concatenate([s.tokens for s in path])
        bounds = np.cumsum([0] + [len(s.tokens) for s in path])
        spans = _spans(tokens, fmt)
        for i in todo:
            seg = path[i]
            counted.add(seg.id)
            by_tier[seg.tier] += len(seg.tokens)
            for span in spans:
                n = min(span.end, bounds[i + 1]) - max(span.start, bounds[i])
                if n > 0:
                    role = "reasoning" if span.tag.reasoning else span.tag.role or "untagged"
                    by_role[role] = by_role.get(role, 0) + int(n)
    return {"by_role": by_role, "by_tier": by_tier, "segments": len(segments)}


def summary(
    segments: Sequence[Segment],
    fmt: TurnFormat | None,
    *,
    tree_core: str,  # "compiled" (sglang's) or "tagged" (sgl_spec's)
    eviction: str,
    freed_by_rule: dict[str, int],
    dead: dict[int, int] | None = None,  # leaf id -> tokens the dead-reasoning rule frees
    now: float | None = None,
) -> dict:
    """JSON-ready tree summary; the newest ``MAX_BRANCHES`` branches in full."""
    now = time.time() if now is None else now
    dead = dead or {}
    tree = _Tree(segments)
    leaves = sorted(tree.leaves, key=lambda sid: _key(tree.eff[sid]), reverse=True)
    branches = []
    for leaf in leaves[:MAX_BRANCHES]:
        path = tree.path(leaf)
        rounds = _branch_rounds(path, fmt, now)
        krul = [s for s in path if s.full_bytes and s.tier == "host"]
        extra = {"krul_stored_bytes": sum(s.stored_bytes for s in krul),
                 "krul_full_bytes": sum(s.full_bytes for s in krul)} if krul else {}
        branches.append({
            "leaf_node": leaf,
            "tokens": sum(r["tokens"] for r in rounds),
            "exclusive_tokens": tree.exclusive(leaf),
            "last_access_s_ago": _ago(now, tree.eff[leaf]),
            "dead_reasoning": leaf in dead,
            "dead_tokens": dead.get(leaf, 0),
            "rounds": rounds,
            **extra,
        })
    return {
        "tree_core": tree_core,
        "eviction_policy": eviction,
        "turn_format": fmt.describe() if fmt else None,
        "totals": totals(segments, fmt),
        "freed_tokens_by_rule": dict(freed_by_rule),
        "num_branches": len(leaves),
        "branches": branches,
    }


def _key(t: float) -> float:
    return float("-inf") if math.isnan(t) else t
