"""The restore pre-pass (Krul Sec 6) recomputes exactly the KV a full forward made:
a small random Llama in transformers (float32) is the reference; the pre-pass gets its
pieces through ``LayerOps`` and the other rows from the reference's own cache."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.attention.extend import exact_extend
from sgl_spec.krul import prepass
from sgl_spec.krul.hf_ops import HFOps
from sgl_spec.krul.pyramid import pyramid, restore_lengths

transformers = pytest.importorskip("transformers")

LAYERS, HQ, HKV, D = 4, 4, 2, 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    """A small random model of each family the pre-pass binds (Qwen2: biased q/k/v)."""
    torch.manual_seed(0)
    kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
    config, cls = kind[request.param]
    cfg = config(vocab_size=97, hidden_size=HQ * D, intermediate_size=96,
                 num_hidden_layers=LAYERS, num_attention_heads=HQ,
                 num_key_value_heads=HKV, max_position_embeddings=256)
    return cls(cfg).eval()


def _reference_kv(model, ids):
    """K (post-RoPE) and V [L, n, Hkv, D] of a full forward over ``ids``."""
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    k = torch.stack([lyr.keys[0].transpose(0, 1) for lyr in cache.layers])
    v = torch.stack([lyr.values[0].transpose(0, 1) for lyr in cache.layers])
    return k, v


@pytest.mark.parametrize("n,prefix,share", [(40, 0, 0.5), (40, 7, 0.5), (33, 5, 1.0),
                                            (50, 12, 0.2), (24, 24, 0.5)])
def test_prepass_recomputes_the_forward_kv(model, n, prefix, share):
    torch.manual_seed(n + prefix)
    ids = torch.randint(0, 97, (n,))
    ref_k, ref_v = _reference_kv(model, ids)
    unstored = pyramid(n, LAYERS, share)
    R = restore_lengths(unstored, prefix, n)
    # The pool: the device prefix and the stored rows hold the reference; the rest NaN.
    k, v = torch.full_like(ref_k, float("nan")), torch.full_like(ref_v, float("nan"))
    for layer, u in enumerate(unstored):
        keep = torch.ones(n, dtype=torch.bool)
        keep[prefix:max(u, prefix)] = False
        k[layer, keep], v[layer, keep] = ref_k[layer, keep], ref_v[layer, keep]
    ops = HFOps(model)

    def write(layer, start, kk, vv):
        k[layer, start:start + len(kk)], v[layer, start:start + len(vv)] = kk, vv

    def attend(layer, q, end):
        return exact_extend(q, k[layer, :end], v[layer, :end], prefix, ops.scale(layer))

    with torch.no_grad():
        done = prepass.run(ops, ids[prefix:R[0]], prefix, R, write, attend)
    assert done == sum(r - prefix for r in R)
    assert not k.isnan().any() and not v.isnan().any()     # every row is there
    torch.testing.assert_close(k, ref_k, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(v, ref_v, atol=2e-5, rtol=1e-4)


def test_prepass_rejects_bad_lengths(model):
    ops = HFOps(model)
    with pytest.raises(ValueError, match="non-increasing"):
        prepass.run(ops, torch.arange(5), 0, [3, 5, 0, 0], None, None)
    with pytest.raises(ValueError, match="token ids"):
        prepass.run(ops, torch.arange(4), 0, [5, 5, 0, 0], None, None)
    assert prepass.run(ops, torch.arange(0), 3, [3, 3, 3, 3], None, None) == 0


def test_restore_plan_reads_the_unstored_extents_of_the_host_only_nodes():
    """A path of three nodes: the first stays on the device, the other two are host-only,
    compressed with their parts of one pyramid. The plan starts at the device prefix and
    recomputes up to the pyramid at each layer; a fully stored path needs no plan."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sgl_spec.integration.tiers.krul_restore import BASE_COMPONENT_TYPE, plan
    from sgl_spec.tiers.arena import Arena
    from sgl_spec.krul.select import Strategy

    L, lens = 4, (5, 6, 9)
    arena = Arena(64, L, 64 * L, 2, 8, torch.float32)
    U = pyramid(sum(lens), L, 0.6)                      # over the whole history
    root = SimpleNamespace(parent=None)
    node, pos = root, 0
    for i, n in enumerate(lens):
        host = arena.alloc(n)
        for layer in range(L):
            arena.write(layer, host, torch.randn(n, 2, 8), torch.randn(n, 2, 8))
        if i:                                            # the host-only ones
            arena.compress(host, Strategy(L, ()), [min(max(u - pos, 0), n) for u in U])
        data = SimpleNamespace(value=torch.arange(n) if i == 0 else None, host_value=host)
        node = SimpleNamespace(parent=node, key=[0] * n,
                               component_data={BASE_COMPONENT_TYPE: data})
        pos += n
    p = plan(node, root, arena, L)
    assert p.node is node and p.device_prefix == lens[0]
    assert p.lengths == restore_lengths(U, lens[0], sum(lens))
    assert p.lengths[0] == max(U[0], lens[0]) and p.lengths[-1] >= lens[0]
    stored = SimpleNamespace(parent=root, key=[0] * 3, component_data={
        BASE_COMPONENT_TYPE: SimpleNamespace(value=None, host_value=arena.alloc(3))})
    assert plan(stored, root, arena, L) is None
