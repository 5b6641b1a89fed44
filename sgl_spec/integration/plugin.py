"""sglang plugin entry point (group ``sglang.srt.plugins``).

sglang calls :func:`register` in its launcher, scheduler, detokenizer and DP
controller processes, sometimes more than once per process, so registration is
idempotent. It makes the name ``sgl_spec`` valid for ``--attention-backend`` and
``--radix-cache-backend``; selecting them is the launcher's job.
"""

from __future__ import annotations

from sgl_spec import BACKEND_NAME as NAME


def register() -> None:
    _register_radix_cache()
    _register_attention()


def _register_radix_cache() -> None:
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(NAME) is None:
        from .radix import create_cache

        register_radix_cache_backend(NAME, create_cache)


def _register_attention() -> None:
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if NAME not in ATTENTION_BACKENDS:
        from .attention import create_backend

        register_attention_backend(NAME)(create_backend)
