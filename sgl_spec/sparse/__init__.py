"""KV-budget selection policies for sparse decode (streaming, snapkv, loopserve).

A policy turns a request's history into per-layer, per-KV-head selections that
``sgl_spec.kernels.sparse_decode`` attends (with the sink and the recent window),
host-side state per request and device-side rows in a slot table, batched over the
rows of a forward pass (``policy``). Policies are built by name from the registry;
``exact`` is the absence of a policy.

Names are imported on first use (PEP 562), so that importing the registry does not
pay for torch until a policy is built.
"""

from __future__ import annotations

import importlib

# public name -> submodule defining it
_EXPORTS = {
    "AttnShape": "policy",
    "Kind": "policy",
    "ReselectBatch": "policy",
    "RequestState": "policy",
    "RowStep": "policy",
    "SelectionPolicy": "policy",
    "available_policies": "policy",
    "get_policy": "policy",
    "register_policy": "policy",
    "Scratch": "scoring",
    "pool_scores": "scoring",
    "score_history": "scoring",
    "select_topk": "scoring",
    "SlotTable": "slots",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
