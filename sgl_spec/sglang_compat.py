"""The one place that checks which sglang is installed.

sgl_spec plugs into sglang internals that move between releases; every module
that touches ``sglang.srt`` calls :func:`check_version` first.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from sgl_spec import SGLANG_VERSION

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError as exc:
        raise RuntimeError(
            f"sglang is not installed; sgl_spec needs sglang=={SGLANG_VERSION}"
        ) from exc


def check_version() -> None:
    found = installed_version()
    if found != SGLANG_VERSION:
        raise RuntimeError(
            f"sgl_spec is built against sglang=={SGLANG_VERSION}, found {found}; "
            f"install sglang=={SGLANG_VERSION}"
        )
