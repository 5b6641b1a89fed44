"""SpeContext's layer offload on sglang's own KV pool and allocator
(``sgl_spec.integration.tiers.offload.PoolOffload``): Algorithm 2 moves whole layers
between the tiers and sglang's reads and writes follow them."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sgl_spec.attention.prefetch import get_prefetcher
from sgl_spec.integration.tiers.offload import PoolOffload


def _sglang_pool(slots: int, model_layers: int):
    """sglang's own MHA pool and allocator on CPU (one extra layer: the head's)."""
    pool = MHATokenToKVPool(size=slots, page_size=1, dtype=torch.float32, head_num=2,
                            head_dim=4, layer_num=model_layers + 1, device="cpu",
                            enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=slots, dtype=torch.float32, device="cpu",
                                   kvcache=pool, need_sort=False)
    return pool, alloc


def test_pool_offload_moves_the_last_layers_and_keeps_their_kv():
    """Algorithm 2 on sglang's pool: past the thresholds the last layers' buffers move to
    host copies that sglang's get/set then use; the head's layer stays; the bytes are the
    pool's; everything comes back unchanged when the pool drains."""
    pool, alloc = _sglang_pool(64, 4)
    row = 2 * 2 * 4 * 4  # K and V x 2 heads x dim 4 x fp32: 64 bytes per token and layer
    for j in range(5):
        pool.k_buffer[j].copy_(torch.randn_like(pool.k_buffer[j]))
        pool.v_buffer[j].copy_(torch.randn_like(pool.v_buffer[j]))
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k_buffer, pool.v_buffer)]
    objs = [id(k) for k in pool.k_buffer]
    pf = get_prefetcher("inline", "cpu")
    # S_i = 6400 // ((4 - i + 1) * 64) = 20, 25, 33, 50: at 30 slots layers 3 and 2 leave
    off = PoolOffload(pool, alloc, None, pf, 4, 6400)
    slots = alloc.alloc(30)
    assert off.update(1).offload == [3, 2]
    assert off.host_layers() == [2, 3] and pf.clock.layers == {2, 3}
    # each request's decode row names the layers it reads from the host
    assert off.annotate({"r1": {"path": "sparse"}}) == {
        "r1": {"path": "sparse", "host_layers": [2, 3]}}
    assert [id(k) == o for k, o in zip(pool.k_buffer, objs)] == [True, True, False, False,
                                                                  True]
    for j in range(5):
        assert torch.equal(pool.get_key_buffer(j), before[j][0])
        assert torch.equal(pool.get_value_buffer(j), before[j][1])
    # sglang's write path lands in the host copy
    k_new, v_new = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)
    pool.set_kv_buffer(None, slots[:1], k_new, v_new, layer_id_override=3)
    assert torch.equal(pool.get_key_buffer(3)[slots[0]], k_new[0])
    rep = off.report()
    assert rep["used_slots"] == 30 and rep["host_layers"] == [2, 3]
    assert rep["device_bytes"] == {"layers": 30 * 3 * row, "staging": 0}
    assert rep["host_bytes"] == 30 * 2 * row and not rep["over_budget"]
    assert off.update(1).offload == []  # no new threshold passed
    alloc.free(slots)
    assert off.update(0).reload == [2, 3] and off.host_layers() == []
    assert torch.equal(pool.get_key_buffer(3)[slots[0]], k_new[0])
    assert torch.equal(pool.get_value_buffer(2), before[2][1])
    assert off.report()["moves"] == {"offloaded": 2, "reloaded": 2}
