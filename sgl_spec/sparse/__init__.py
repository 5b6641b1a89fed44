"""KV-budget selection policies for sparse decode (exact, streaming, snapkv, loopserve).

A policy turns a request's history into a per-layer, per-KV-head ``Subset`` that
``sgl_spec.kernels.sparse_decode`` attends to; ``pack_subsets`` batches one layer's
subsets into the kernel's arguments. Policies are built by name from the registry.

Names are imported on first use (PEP 562): ``sgl_spec.config`` validates the
``--spec-*`` flags with ``SparseParams`` in the launcher, which must not pay for
importing torch.
"""

from __future__ import annotations

import importlib

# public name -> submodule defining it
_EXPORTS = {
    "SparseParams": "params",
    "use_exact": "params",
    "AttnShape": "policy",
    "PolicyStates": "policy",
    "RequestState": "policy",
    "SelectionPolicy": "policy",
    "available_policies": "policy",
    "get_policy": "policy",
    "register_policy": "policy",
    "pool_scores": "scoring",
    "score_history": "scoring",
    "select_topk": "scoring",
    "PackedSubsets": "subset",
    "Subset": "subset",
    "dense_subset": "subset",
    "pack_subsets": "subset",
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
