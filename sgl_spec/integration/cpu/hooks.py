"""A meta-path finder that supplies ``sgl_kernel`` and patches modules on import.

Installed by ``sgl_spec.boot``'s gate the first time sglang, sgl_kernel or
torchvision is imported:

* ``sgl_kernel``: when no real distribution provides it (the PyPI sglang-kernel is
  CUDA-only), :mod:`.sgl_kernel_shim` is loaded under that name.
* before ``torchvision`` executes: :func:`.torchvision_ops.ensure_ops`.
* after the sglang host-pool modules execute: :mod:`.hicache` patches.
* after sglang's DP controller module executes: its event loop waits for requests
  instead of spinning on a core (:mod:`.dp_controller`); on every host, its round-robin
  dispatch becomes cache-aware (``sgl_spec.integration.dp_dispatch``).
* after ``sglang.lang.chat_template`` executes (every host): a matcher that gives
  the default model's directory the ChatML template in the frontend language.
* after sglang's scheduler ``internal_state`` module executes (every host): the
  turn-aware cache summary joins the internal state (``GET /sgl_spec/cache``).
* after sglang's scheduler ``invariant_checker`` module executes (every host), with
  ``--spec-check-invariants``: sgl_spec's KV-slot and per-request checks join
  sglang's (:mod:`sgl_spec.integration.invariants`).
* after ``mem_cache.kv_cache_configurator`` executes (every host): with a retrieval
  head (``--spec-mode specontext``) its MHA pool gets the head's layer
  (:mod:`sgl_spec.integration.head`).
* after ``mem_cache.hybrid_cache.hybrid_pool_assembler`` executes (every host): with
  ``--spec-krul`` the MHA host pool is Krul's (:mod:`sgl_spec.integration.tiers.krul`).

Hooks run only when the named module is imported, so processes that never touch
sglang pay nothing but this finder's dictionary look-ups.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable

_Hook = Callable[[object], None]


def _lazy(target: str) -> _Hook:
    """A hook calling ``module:function`` with the hooked module, imported when it runs
    (so the finder itself stays cheap)."""
    module_name, fn_name = target.split(":")

    def hook(module) -> None:
        getattr(importlib.import_module(module_name), fn_name)(module)

    hook.__name__ = fn_name
    return hook


def _both(first: _Hook, second: _Hook) -> _Hook:
    def hook(module) -> None:
        first(module)
        second(module)

    hook.__name__ = f"{first.__name__}+{second.__name__}"
    return hook


# Hooks active on every host: hooked module -> "patching module:function".
BEFORE: dict[str, _Hook] = {}
AFTER: dict[str, _Hook] = {
    "sglang.lang.chat_template": _lazy("sgl_spec.chat_templates:register_frontend_matchers"),
    "sglang.srt.managers.scheduler_components.internal_state":
        _lazy("sgl_spec.integration.endpoint:patch_internal_state"),
    "sglang.srt.mem_cache.kv_cache_configurator":
        _lazy("sgl_spec.integration.head:patch_kv_pool"),
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler":
        _lazy("sgl_spec.integration.tiers.krul:patch_host_pool"),
    "sglang.srt.managers.data_parallel_controller":
        _lazy("sgl_spec.integration.dp_dispatch:patch_controller"),
    "sglang.srt.managers.scheduler_components.invariant_checker":
        _lazy("sgl_spec.integration.invariants:patch_checker"),
}
# Hooks active only on hosts without CUDA.
_HICACHE = "sgl_spec.integration.tiers.hicache_cpu"
_CPU_BEFORE: dict[str, _Hook] = {
    "torchvision": _lazy("sgl_spec.integration.cpu.torchvision_ops:ensure_ops"),
}
_CPU_AFTER: dict[str, _Hook] = {
    "sglang.srt.mem_cache.pool_host.common": _lazy(f"{_HICACHE}:patch_pool_host_common"),
    "sglang.srt.mem_cache.pool_host.base": _lazy(f"{_HICACHE}:patch_pool_host_base"),
    "sglang.srt.mem_cache.pool_host.mha": _lazy(f"{_HICACHE}:patch_pool_host_mha"),
    "sglang.srt.managers.cache_controller": _lazy(f"{_HICACHE}:patch_cache_controller"),
    "sglang.srt.arg_groups.resolution_hooks":
        _lazy(f"{_HICACHE}:register_cpu_hicache_defaults"),
    "sglang.srt.managers.data_parallel_controller":
        _lazy("sgl_spec.integration.cpu.dp_controller:patch_event_loop"),
}
SHIM_NAME = "sgl_kernel"
_shim_enabled = False


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        if self._name in BEFORE:
            BEFORE[self._name](module)
        self._inner.exec_module(module)
        if self._name in AFTER:
            AFTER[self._name](module)

    def __getattr__(self, item):  # get_code, get_source, is_package, ...
        return getattr(self._inner, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == SHIM_NAME and _shim_enabled:
            if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None  # a real sgl_kernel is installed: use it
            shim = os.path.join(os.path.dirname(__file__), "sgl_kernel_shim.py")
            return importlib.util.spec_from_file_location(fullname, shim)
        if fullname not in BEFORE and fullname not in AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


def install(cpu: bool) -> _Finder:
    """Put the finder first on sys.meta_path (idempotent); returns it.

    ``cpu``: also supply ``sgl_kernel`` and apply the CPU-only patches.
    """
    global _shim_enabled
    if cpu and not _shim_enabled:
        _shim_enabled = True
        for hooks, cpu_hooks in ((BEFORE, _CPU_BEFORE), (AFTER, _CPU_AFTER)):
            for name, hook in cpu_hooks.items():
                if hooks.get(name) not in (None, hook):
                    hook = _both(hooks[name], hook)
                hooks[name] = hook
    for f in sys.meta_path:
        if isinstance(f, _Finder):
            return f
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    return finder
