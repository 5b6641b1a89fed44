"""The one seam between sgl_spec and SGLang: the only package that imports sglang.srt.

Upgrading sglang means diffing this folder against the new release. It holds:

* ``plugin``: the ``sglang.srt.plugins`` entry point; registers the backends below;
* ``server``: the launcher's sglang side (argument preparation, help, serving);
* ``attention``: the ``--attention-backend sgl_spec`` backend, which turns each
  ForwardBatch into a ``BatchView`` and hands it to ``sgl_spec.attention``'s
  plan/run core;
* ``radix``, ``tree_core``, ``eviction``, ``tree_view``: the ``--radix-cache-backend
  sgl_spec`` cache (sglang's compiled tree core, or a turn-tagged Python core when a
  feature reads tags), its turn-aware eviction and the on-demand tree view;
* ``tiers``: KV across tiers inside sglang: round mode's layer-tiered MHA pool through
  sglang's platform plugin hook (``tiered_pool``, ``platform``; active only with
  ``--spec-rounds``), Krul's host pool and restore (``krul``, ``krul_restore``) and
  HiCache's transfers on CPU (``hicache_cpu``); their torch side is ``sgl_spec.tiers``;
* ``endpoint``: ``GET /sgl_spec/cache``; ``server_format``: the served model's turns;
* ``cpu``: sglang 0.5.23 on hosts without CUDA (import hooks, the ``sgl_kernel``
  stand-in, torchvision's ops);
* ``standalone``: sglang's components built outside a server, for benchmarks and tests.

Importing this package checks the installed sglang against the pinned version, once;
it imports nothing of sglang itself (submodules do, lazily where they are loaded at
interpreter start).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from sgl_spec import SGLANG_VERSION


def installed_version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError as exc:
        raise RuntimeError(
            f"sglang is not installed; sgl_spec needs sglang=={SGLANG_VERSION}") from exc


def check_version() -> None:
    found = installed_version()
    if found != SGLANG_VERSION:
        raise RuntimeError(f"sgl_spec is built against sglang=={SGLANG_VERSION}, found "
                           f"{found}; install sglang=={SGLANG_VERSION}")


check_version()
