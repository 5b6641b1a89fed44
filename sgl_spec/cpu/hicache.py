"""HiCache (--enable-hierarchical-cache) on CPU hosts. Filled in below."""

from __future__ import annotations


def patch_pool_host_common(module) -> None:
    pass


def patch_pool_host_mha(module) -> None:
    pass


def patch_cache_controller(module) -> None:
    pass
