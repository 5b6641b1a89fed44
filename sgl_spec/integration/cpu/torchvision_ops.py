"""Make ``import torchvision`` work with the CUDA torchvision wheel on a CPU torch.

torchvision 0.28.0 on PyPI is a CUDA build: its ``_C`` extension fails to load on a
CPU-only torch, and ``torchvision/_meta_registrations.py`` then fails registering
fake kernels for ``torchvision::nms`` / ``torchvision::qnms``, ops that only ``_C``
defines. Defining the two schemas (no kernels) first lets the import complete;
sglang needs only ``torchvision.transforms`` for text models.
"""

from __future__ import annotations

import glob
import importlib.machinery
import logging
import os

logger = logging.getLogger(__name__)

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # keeps the torch.library.Library (and its schemas) alive


def _extension_loads() -> bool:
    import torch

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for so in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(so)
            return True
        except (OSError, RuntimeError):
            return False
    return False


def ensure_ops(_module=None) -> None:
    """Define the ops torchvision's meta registrations need, if ``_C`` can't."""
    global _library
    if _library is not None:
        return
    import torch

    if _extension_loads():
        _library = False  # the real extension defines them
        return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}"):
            try:
                lib.define(schema)
            except RuntimeError:  # already defined elsewhere
                pass
    _library = lib
    logger.debug("defined torchvision::nms/qnms schemas (no CUDA extension)")
