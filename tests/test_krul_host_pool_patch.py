"""``--spec-krul`` off leaves sglang's host pool class as it is; on, the MHA pool is
Krul's (``sgl_spec.integration.tiers.krul.patch_host_pool``)."""

from __future__ import annotations

import types

import pytest

from sgl_spec.config import KrulConfig, SpecConfig


def _assembler():
    """A stand-in for sglang's ``hybrid_pool_assembler``: what it picks for MHA (the
    class the integration package imported from sglang)."""
    from sgl_spec.integration.tiers.krul import MHATokenToKVPoolHost

    stock = lambda info: MHATokenToKVPoolHost  # noqa: E731
    return types.SimpleNamespace(get_mha_host_pool_cls=stock), stock


@pytest.mark.parametrize("cfg", [SpecConfig(), SpecConfig(disable=True)],
                         ids=["default", "disable"])
def test_without_krul_the_host_pool_class_is_stock(monkeypatch, cfg):
    from sgl_spec.integration.tiers import krul

    monkeypatch.setattr(krul, "current", lambda: cfg)
    module, stock = _assembler()
    krul.patch_host_pool(module)
    assert module.get_mha_host_pool_cls is stock
    assert not hasattr(module, "_sgl_spec_krul")


def test_with_krul_the_mha_host_pool_is_krul_s_and_patched_once(monkeypatch):
    from sgl_spec.integration.tiers import krul

    monkeypatch.setattr(krul, "current", lambda: SpecConfig(krul=KrulConfig(enable=True)))
    module, _ = _assembler()
    krul.patch_host_pool(module)
    patched = module.get_mha_host_pool_cls
    assert patched(None) is krul.KrulHostPool
    krul.patch_host_pool(module)                  # a second import hook call: unchanged
    assert module.get_mha_host_pool_cls is patched
    module.get_mha_host_pool_cls = lambda info: object  # another pool class: refused
    module._sgl_spec_krul = False
    krul.patch_host_pool(module)
    with pytest.raises(ValueError, match="valid: drop --spec-krul"):
        module.get_mha_host_pool_cls(None)


def test_under_round_mode_krul_pairs_the_lower_tier_s_layers_only(monkeypatch):
    """With --spec-rounds the host pool holds layers below L_w only (the upper ones are in
    the rounds' blocks): the model's statistics (all its layers) still describe it, and
    Algorithm 1 runs over the held layers, never pairing one the pool does not hold."""
    import torch

    from sgl_spec.config import RoundConfig
    from sgl_spec.integration.tiers import krul

    dist = torch.ones(6, 6)
    for i, j, d in ((3, 4, 0.05), (0, 1, 0.1), (1, 2, 0.2), (2, 5, 0.3)):
        dist[i, j] = dist[j, i] = d
    sim = types.SimpleNamespace(num_layers=6, ir_share=lambda: torch.ones(6),
                                distances=lambda: dist)
    cfg = KrulConfig(enable=True, ratio=1.0)
    monkeypatch.setattr(krul, "current", lambda: SpecConfig(krul=cfg))
    assert krul.holds(6, 6) and not krul.holds(6, 3)  # without round mode: all or nothing
    assert krul.pairs_over(sim, 6, 6, cfg).pairs[0] == (3, 4)
    monkeypatch.setattr(krul, "current", lambda: SpecConfig(
        krul=cfg, rounds=RoundConfig(enable=True, watershed=3)))
    assert krul.holds(6, 3) and not krul.holds(6, 7)
    got = krul.pairs_over(sim, 3, 3, cfg)
    assert got.num_layers == 3 and got.pairs == ((0, 1),)
