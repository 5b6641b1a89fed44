"""Standalone radix caches over identical CPU pools, for cache-level tests and
the cache micro-benchmark: stock sglang's UnifiedRadixCache and sgl_spec's
SpecRadixCache, driven without a server."""

from __future__ import annotations

from array import array

import torch

from sgl_spec.cache.turn_format import TurnFormat


def _server_args():
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


def build(kind: str, size: int, fmt: TurnFormat | None = None, eviction: str = "lru",
          tree_core: str | None = None):
    """(cache, allocator) over a ``size``-token pool. kind: "stock" (sglang's
    UnifiedRadixCache with its default tree core, or ``tree_core``) or "spec"
    (SpecRadixCache with ``fmt`` and ``eviction``)."""
    if kind not in ("stock", "spec"):
        raise ValueError(f"cache kind {kind!r} is invalid; valid values: stock, spec")
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
