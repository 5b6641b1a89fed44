"""Builders for cache-level tests: a stock UnifiedRadixCache and a SpecRadixCache
over identical pools, a synthetic chat format, and a request flow that drives
either cache the way sglang's scheduler does (match, lock, evict, insert, unlock).
"""

from __future__ import annotations

from array import array

import torch

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


def _server_args():
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


def build(kind: str, size: int, fmt: TurnFormat | None = FMT, eviction: str = "lru",
          tree_core: str | None = None):
    """(cache, allocator). kind: "stock" (UnifiedRadixCache, sglang's default tree
    core unless ``tree_core``) or "spec" (SpecRadixCache)."""
    _server_args()
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sgl_spec.cache.radix import SpecRadixCache

    r2t = ReqToTokenPool(size=4, max_context_len=8192, device="cpu",
                         enable_memory_saver=False)
    kv = MHATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, head_num=1,
                          head_dim=8, layer_num=1, device="cpu",
                          enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device="cpu",
                                   kvcache=kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t,
                             token_to_kv_pool_allocator=alloc, page_size=1,
                             tree_components=(ComponentType.FULL,),
                             tree_core_backend=tree_core)
    if kind == "stock":
        return UnifiedRadixCache(params), alloc
    params.sgl_spec_turns = (fmt, eviction)
    return SpecRadixCache(params), alloc


def key(tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


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
        r = self.cache.insert(InsertParams(key=key(full), value=self.value))
        if r.prefix_len > self.matched:
            self.alloc.free(self.value[self.matched : r.prefix_len])
        self.cache.unlock(self.lock)
        self.lock = None
        return r.prefix_len
