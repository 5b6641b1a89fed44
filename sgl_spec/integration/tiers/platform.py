"""sgl_spec's sglang platform plugin (entry point group ``sglang.srt.platforms``).

Active only where ``--spec-rounds`` serves on a CPU host: ``TieredCpuPlatform`` is
sglang's CPU platform whose MHA KV pool is the layer-tiered one
(``tiered_pool.TieredMHAPool``). Everywhere else ``activate`` returns None and sglang
resolves its platform as it would without sgl_spec. sglang resolves the platform while
importing its own modules, so this module imports only sglang's platform package; the
pool is imported when sglang asks for it.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform

from sgl_spec.config import current


def activate() -> str | None:
    from sgl_spec.boot import cuda_host

    rounds = current().rounds
    if not rounds.enable or not rounds.watershed or cuda_host():
        return None
    return f"{__name__}.TieredCpuPlatform"


class TieredCpuPlatform(CpuSRTPlatform):
    def get_kv_pool_cls(self, *, kind):
        if kind != "mha":
            return super().get_kv_pool_cls(kind=kind)
        from .tiered_pool import TieredMHAPool

        return TieredMHAPool
