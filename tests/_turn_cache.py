"""Builders for cache-level tests: stock UnifiedRadixCaches and sgl_spec's caches
(default flags: sglang's compiled core; tagged: the turn-tagged core) over identical
pools, a synthetic chat format, and a request flow that drives any of them the way
sglang's scheduler does (match, lock, evict, insert, unlock).
"""

from __future__ import annotations

import torch

from _turns import ASSISTANT, END_THINK, FMT, IM_END, IM_START, NL, THINK, turn  # noqa: F401
from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import CacheConfig, SpecConfig
from sgl_spec.integration.standalone import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    build_cache,
)
from sgl_spec.integration.standalone import radix_key as key

def build(kind: str, size: int, fmt: TurnFormat | None = FMT, eviction: str = "lru",
          tree_core: str | None = None, policy: str = "lru"):
    """kind: "stock", "spec" (default flags: the compiled core) or "tagged"; policy:
    sglang's --radix-eviction-policy."""
    cfg = SpecConfig(cache=CacheConfig(eviction=eviction))
    return build_cache(kind, size, fmt, cfg, tree_core, eviction_policy=policy)


def write_back(cache):
    """HiCache's write-back policy without a host pool: the cache's backup step
    commits fresh host slot numbers (what a D->H copy would return), so eviction
    backs victims up and then demotes them, as sglang's cache does."""
    next_slot = [1 << 20]

    def backup(action, write_back: bool = False) -> int:
        written = 0
        for node_id in action.node_ids:
            device, xfers = cache.tree_core.build_backup_spec(node_id)
            if device.numel() == 0 and not xfers:
                continue
            host = torch.arange(next_slot[0], next_slot[0] + len(device), dtype=torch.int64)
            next_slot[0] += len(device)
            cache.tree_core.commit_backup(node_id, host, xfers)
            written = len(host)
        return written

    cache._execute_and_commit_kv_backup = backup
    cache.writing_check = lambda write_back=False: None
    cache.is_write_back = True
    return cache


def match(cache, tokens) -> tuple[int, object]:
    m = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    return m.device_prefix_len, m


def evict(cache, n: int) -> int:
    return cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted


class Request:
    """One request's life in the cache: ``start`` matches and locks the prompt's
    cached prefix and allocates the rest (evicting if short); ``finish`` inserts
    prompt + output and unlocks. Returns what a test compares across caches."""

    def __init__(self, cache, alloc, prompt: list[int], output: list[int]):
        self.cache, self.alloc = cache, alloc
        self.prompt, self.output = prompt, output
        self.lock = None

    def start(self) -> tuple[int, int] | None:
        """(matched, evicted), or None when the pool cannot hold the request."""
        full = self.prompt + self.output
        matched, m = match(self.cache, self.prompt)
        self.lock = self.cache.lock(m.last_device_node)
        need = len(full) - matched
        evicted = 0
        if self.alloc.available_size() < need:
            # What the scheduler does on an allocation shortfall: evict toward
            # an availability target (the walk may stop mid-way).
            evicted = self.cache.evict_for_alloc(
                EvictParams(num_tokens=need - self.alloc.available_size())
            ).num_tokens_evicted
        if self.alloc.available_size() < need:
            self.cache.unlock(self.lock)
            self.lock = None
            return None
        prefix = self.cache.path_device_indices(m.last_device_node)[:matched]
        self.value = torch.cat([prefix.to(torch.int64), self.alloc.alloc(need)])
        self.matched = matched
        return matched, evicted

    def finish(self) -> int:
        full = self.prompt + self.output
        # As sglang's checkpoint_into_tree: the locked prefix is protected; the
        # insert frees this request's duplicates of anything cached since.
        r = self.cache.insert(InsertParams(key=key(full), value=self.value,
                                           prev_prefix_len=self.matched))
        self.cache.unlock(self.lock)
        self.lock = None
        return r.prefix_len
