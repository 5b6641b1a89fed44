"""The tree summary behind ``GET /sgl_spec/cache``: one DFS over the turn tree.

Per conversation branch (a root-to-leaf path), its rounds in order; per round,
its turns with role and token counts, how many tokens sit on device and on host,
and when the round was last accessed. Totals by role and tier feed the
Prometheus gauges.
"""

from __future__ import annotations

import time

from sglang.srt.mem_cache.unified_cache.unified_tree_core import BASE_COMPONENT_TYPE

MAX_BRANCHES = 64


def _tier(node) -> str | None:
    if node.component_data[BASE_COMPONENT_TYPE].value is not None:
        return "device"
    if getattr(node, "backuped", False):
        return "host"
    return None


def totals(core) -> dict:
    """Cached tokens by role and by tier, and the node count."""
    by_role: dict[str, int] = {}
    by_tier = {"device": 0, "host": 0}
    nodes = 0
    stack = list(core.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes += 1
        tier = _tier(node)
        if tier is not None:
            n = len(node.key)
            by_tier[tier] += n
            tag = node.spec.tag
            role = "untagged" if tag is None or tag.role is None else tag.role
            if tag is not None and tag.reasoning:
                role = "reasoning"
            by_role[role] = by_role.get(role, 0) + n
        stack.extend(node.children.values())
    return {"by_role": by_role, "by_tier": by_tier, "nodes": nodes}


def _round_entry(rounds: list[dict], tag, n: int, tier: str | None, atime: float):
    rnd = tag.round if tag is not None else 0
    turn = tag.turn if tag is not None else 0
    role = tag.role if tag is not None else None
    if not rounds or rounds[-1]["round"] != rnd:
        rounds.append({"round": rnd, "tokens": 0, "device_tokens": 0,
                       "host_tokens": 0, "last_access": 0.0, "turns": []})
    r = rounds[-1]
    r["tokens"] += n
    if tier is not None:
        r[f"{tier}_tokens"] += n
    r["last_access"] = max(r["last_access"], atime)
    turns = r["turns"]
    if not turns or turns[-1]["turn"] != turn:
        turns.append({"turn": turn, "role": role, "tokens": 0, "reasoning_tokens": 0})
    t = turns[-1]
    t["tokens"] += n
    if role is not None:
        t["role"] = role
    if tag is not None and tag.reasoning:
        t["reasoning_tokens"] += n


def summary(core, now: float | None = None) -> dict:
    """JSON-ready tree summary; the newest ``MAX_BRANCHES`` branches in full."""
    now = time.time() if now is None else now
    # Effective access time of a node: the newest access in its subtree.
    order, stack = [], [core.root_node]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    eff = {}
    for node in reversed(order):
        t = node.spec.atime
        for c in node.children.values():
            t = max(t, eff[c.id])
        eff[node.id] = t
    leaves = [n for n in order if not n.children and n is not core.root_node]
    leaves.sort(key=lambda n: eff[n.id], reverse=True)
    branches = []
    for leaf in leaves[:MAX_BRANCHES]:
        path = []
        node = leaf
        while node is not core.root_node:
            path.append(node)
            node = node.parent
        exclusive = 0  # tokens below the branch point: what evicting it frees
        for node in path:
            exclusive += len(node.key)
            if len(node.parent.children) > 1:
                break
        dead = core.turn_eviction and core.eviction_strategy.is_dead(leaf)
        dead_tokens = 0  # what the dead-reasoning rule frees: leaf up to the span start
        if dead:
            node = leaf
            dead_tokens = len(node.key)
            while (node.parent is not core.root_node and len(node.parent.children) == 1
                   and core._continues_dead(node, node.parent, "dead_reasoning")):
                node = node.parent
                dead_tokens += len(node.key)
        rounds: list[dict] = []
        for node in reversed(path):
            _round_entry(rounds, node.spec.tag, len(node.key), _tier(node), eff[node.id])
        for r in rounds:
            dev, host = r["device_tokens"], r["host_tokens"]
            r["tier"] = "device" if host == 0 else ("host" if dev == 0 else "mixed")
            r["last_access_s_ago"] = round(now - r.pop("last_access"), 3)
        branches.append({
            "leaf_node": leaf.id,
            "tokens": sum(r["tokens"] for r in rounds),
            "exclusive_tokens": exclusive,
            "last_access_s_ago": round(now - eff[leaf.id], 3),
            "dead_reasoning": dead,
            "dead_tokens": dead_tokens,
            "rounds": rounds,
        })
    return {
        "eviction_policy": "turn" if core.turn_eviction else "lru",
        "turn_format": core.fmt.describe() if core.fmt else None,
        "totals": totals(core),
        "freed_tokens_by_rule": dict(core.freed_by_rule),
        "num_branches": len(leaves),
        "branches": branches,
    }
