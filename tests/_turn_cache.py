"""Builders for cache-level tests: a stock UnifiedRadixCache and a SpecRadixCache
over identical pools, a synthetic chat format, and a request flow that drives
either cache the way sglang's scheduler does (match, lock, evict, insert, unlock).
"""

from __future__ import annotations

import torch

from sgl_spec.bench import cache_fixtures
from sgl_spec.bench.cache_fixtures import key
from sgl_spec.cache.turn_format import TurnFormat

# Synthetic vocabulary: ChatML-like specials and plain content tokens >= 20.
IM_START, IM_END, SYSTEM, USER, ASSISTANT, TOOL, NL, THINK, END_THINK = range(1, 10)
ROLE_TOKEN = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
FMT = TurnFormat(
    openers=tuple((r, (IM_START, t)) for r, t in ROLE_TOKEN.items()),
    end=(IM_END,),
    think=((THINK,), (END_THINK,)),
    drops_reasoning=True,
)


def turn(role: str, content: list[int], reasoning: list[int] | None = None) -> list[int]:
    body = list(content)
    if reasoning is not None:
        body = [THINK, *reasoning, END_THINK, *body]
    return [IM_START, ROLE_TOKEN[role], NL, *body, IM_END, NL]


def build(kind: str, size: int, fmt: TurnFormat | None = FMT, eviction: str = "lru",
          tree_core: str | None = None):
    return cache_fixtures.build(kind, size, fmt, eviction, tree_core)


def match(cache, tokens) -> tuple[int, object]:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    m = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    return m.device_prefix_len, m


def evict(cache, n: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

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
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

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
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        full = self.prompt + self.output
        # As sglang's checkpoint_into_tree: the locked prefix is protected; the
        # insert frees this request's duplicates of anything cached since.
        r = self.cache.insert(InsertParams(key=key(full), value=self.value,
                                           prev_prefix_len=self.matched))
        self.cache.unlock(self.lock)
        self.lock = None
        return r.prefix_len
