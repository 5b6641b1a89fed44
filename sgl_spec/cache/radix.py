"""sgl_spec's radix-cache backend (``--radix-cache-backend sgl_spec``).

A subclass of sglang's UnifiedRadixCache, built through sglang's own
``create_unified_radix_cache`` so HiCache attachment keeps working. For now it
behaves exactly like stock; the turn/round-aware cache extends this class.
"""

from __future__ import annotations

from sgl_spec.sglang_compat import check_version

check_version()

from sglang.srt.mem_cache.registry import (  # noqa: E402
    TreeCacheBuildContext,
    create_unified_radix_cache,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402


class SpecRadixCache(UnifiedRadixCache):
    """UnifiedRadixCache under sgl_spec's name (behaviour: stock)."""


def create_cache(ctx: TreeCacheBuildContext):
    """Factory registered with sglang's radix-cache registry."""
    return create_unified_radix_cache(ctx, cache_class=SpecRadixCache)
