"""sglang components without a server, for tests and benchmarks.

* ``build_cache``: radix caches over identical CPU pools: stock sglang's
  UnifiedRadixCache (its default compiled tree core, or ``tree_core``), and sgl_spec's
  cache with default flags or a turn-tagged core (``SpecConfig``);
* ``build_swa_cache``: the same over a sliding-window (FULL + SWA) configuration,
  pools built by sglang's own unified-radix-cache unit-test kit;
* ``radix_key``, ``InsertParams``, ``MatchPrefixParams``, ``EvictParams``: what to
  drive them with;
* ``torch_native_decode``: stock torch_native's decode call, the baseline of the
  decode-kernel benchmark.
"""

from __future__ import annotations

from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: F401  (re-exported)
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import SpecConfig

__all__ = ["EvictParams", "InsertParams", "MatchPrefixParams", "KINDS", "build_cache",
           "build_swa_cache", "radix_key", "torch_native_decode"]

KINDS = ("stock", "spec", "tagged")


def _server_args():
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))


def build_cache(kind: str, size: int, fmt: TurnFormat | None = None,
                cfg: SpecConfig | None = None, tree_core: str | None = None,
                eviction_policy: str = "lru"):
    """(cache, allocator) over a ``size``-token pool. kind: "stock" (sglang's
    UnifiedRadixCache with its default tree core, or ``tree_core``), "spec" (sgl_spec's
    for ``cfg``: the compiled core, or the tagged one where a feature reads tags) or
    "tagged" (sgl_spec's turn-tagged core whatever ``cfg`` says). ``eviction_policy``:
    sglang's ``--radix-eviction-policy``."""
    if kind not in KINDS:
        raise ValueError(f"cache kind {kind!r} is invalid; valid values: {', '.join(KINDS)}")
    _server_args()
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from .radix import SpecRadixCache, TaggedRadixCache

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
                             tree_core_backend=tree_core, eviction_policy=eviction_policy)
    if kind == "stock":
        return UnifiedRadixCache(params), alloc
    cfg = cfg or SpecConfig()
    cls = TaggedRadixCache if cfg.tagged_cache or kind == "tagged" else SpecRadixCache
    return cls(params, fmt, cfg), alloc


def build_swa_cache(kind: str, size: int, window: int, fmt: TurnFormat | None = None,
                    cfg: SpecConfig | None = None, eviction_policy: str = "lru"):
    """(cache, allocator) over a FULL + SWA ``size``-token pool (page size 1) with a
    ``window``-token sliding window, as ``build_cache``. Pools and params come from
    sglang's unit-test kit (``sglang.test.kits.unified_radix_cache``); stock runs on
    the kit's Python tree core (its inspector subclass)."""
    if kind not in KINDS:
        raise ValueError(f"cache kind {kind!r} is invalid; valid values: {', '.join(KINDS)}")
    import dataclasses

    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig as KitConfig
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture

    from .radix import SpecRadixCache, TaggedRadixCache

    kit = KitConfig(page_size=1, components=(ComponentType.FULL, ComponentType.SWA),
                    sliding_window_size=window, kv_size=size, max_context_len=max(512, size),
                    eviction_policy=eviction_policy)
    stock, alloc, _ = build_fixture(kit, tree_core_backend="python")
    if kind == "stock":
        return stock, alloc
    # The kit builds a stock cache over the pools; sgl_spec's takes its params.
    params = dataclasses.replace(stock.cache_init_params, tree_core_backend=None)
    cfg = cfg or SpecConfig()
    cls = TaggedRadixCache if cfg.tagged_cache or kind == "tagged" else SpecRadixCache
    return cls(params, fmt, cfg), alloc


def radix_key(tokens) -> RadixKey:
    return RadixKey(array("q", tokens))


def torch_native_decode(
    q: torch.Tensor,  # [B, Hq, D]
    out: torch.Tensor,  # [B, Hq, Dv], written
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    rows: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:
    """One layer of stock torch_native's decode: SDPA per request, ``enable_gqa``."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q, out, k_buf, v_buf, req_to_token, rows, seq_lens, scaling=scale,
        enable_gqa=q.shape[1] != k_buf.shape[1])
