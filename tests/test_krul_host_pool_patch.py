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
