"""pytest plugin that points SGLang's own cache unit tests at one cache configuration.

The upstream test files stay byte-for-byte as SGLang ships them; this plugin swaps
the classes they build caches from, after collection and before any test runs
(tests look their module globals up at call time):

* ``RadixCache`` -> a stand-in whose ``create_simulated`` (the only constructor the
  RadixCache tests use) builds the configuration's UnifiedRadixCache over the same
  pool-less ``CacheInitParams`` stock's ``create_simulated`` builds;
* ``UnifiedRadixCache`` -> a subclass that builds the configuration's cache from the
  ``params`` the test passes.

The configuration comes from ``SGLSPEC_UPSTREAM_CONFIG`` (set by
``sgl_spec.integration.upstream_tests``), so one pytest process runs one configuration.
"""

from __future__ import annotations

import os

from sgl_spec.cache.turn_format import TurnFormat

ENV = "SGLSPEC_UPSTREAM_CONFIG"
# name -> (cache kind, stock tree core backend, --spec-cache-eviction)
CONFIGS: dict[str, tuple[str, str | None, str | None]] = {
    "radix": ("radix", None, None),  # the tests as shipped: stock's RadixCache
    "stock-python": ("stock", "python", None),
    "stock-rust": ("stock", "rust", None),
    "spec-lru": ("spec", None, "lru"),  # default flags: sglang's compiled core
    "tagged-lru": ("tagged", None, "lru"),  # the turn-tagged core, LRU
    "tagged-turn": ("tagged", None, "turn"),  # --spec-cache-eviction turn
}

# ChatML-like special ids 1..9 (as tests/_turns.py): the upstream tests' small token
# ids then contain turn openers and ends, so sgl_spec's turn cuts are exercised.
_IM_START, _IM_END, _SYSTEM, _USER, _ASSISTANT, _TOOL, _NL, _THINK, _END_THINK = range(1, 10)
FMT = TurnFormat(
    openers=(("system", (_IM_START, _SYSTEM)), ("user", (_IM_START, _USER)),
             ("assistant", (_IM_START, _ASSISTANT)), ("tool", (_IM_START, _TOOL))),
    end=(_IM_END,),
    think=((_THINK,), (_END_THINK,)),
    drops_reasoning=True,
)


def config_name() -> str:
    name = os.environ.get(ENV, "")
    if name not in CONFIGS:
        raise ValueError(f"{ENV}={name!r} is invalid; valid values: {', '.join(CONFIGS)}")
    return name


def cache_classes(name: str):
    """(UnifiedRadixCache stand-in, RadixCache stand-in) for configuration ``name``;
    (None, None) for "radix" (nothing swapped)."""
    kind, backend, eviction = CONFIGS[name]
    if kind == "radix":
        return None, None
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sgl_spec.config import CacheConfig, SpecConfig

    from .radix import SpecRadixCache, TaggedRadixCache

    if kind == "stock":
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = backend
        base = UnifiedRadixCache
    else:
        cfg = SpecConfig(cache=CacheConfig(eviction=eviction))
        spec_cls = TaggedRadixCache if kind == "tagged" else SpecRadixCache

        class base(spec_cls):  # noqa: N801  (stands in for a class name)
            def __init__(self, params):
                super().__init__(params, FMT, cfg)

    class Simulated:
        """RadixCache's ``create_simulated`` contract, answered by ``base``."""

        @staticmethod
        def create_simulated(disable=False, mock_allocator=None, page_size=1,
                             enable_kv_cache_events=False, dynamo_kv_event_format=False,
                             kv_event_lora_names=None):
            params = CacheInitParams(
                disable=disable, req_to_token_pool=None,
                token_to_kv_pool_allocator=mock_allocator, page_size=page_size,
                enable_kv_cache_events=enable_kv_cache_events,
                dynamo_kv_event_format=dynamo_kv_event_format,
                kv_event_lora_names=kv_event_lora_names,
                tree_components=(ComponentType.FULL,))
            return base(params)

    return base, Simulated


def pytest_collection_modifyitems(session, config, items):
    unified, radix = cache_classes(config_name())
    if unified is None:
        return
    seen = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        if hasattr(module, "RadixCache"):
            module.RadixCache = radix
        if hasattr(module, "UnifiedRadixCache"):
            module.UnifiedRadixCache = unified
