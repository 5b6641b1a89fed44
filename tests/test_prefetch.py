"""The prefetchers of a pass's elastic loads give the staging buffers inline copies give.

The CUDA side stream (``stream``) runs where a GPU is (marker ``gpu``): its copies are
ordered after the plan's indices and before each layer's reads by events alone, so the
test queues work on the compute stream between the layers, as a forward pass does.
"""

from __future__ import annotations

import pytest
import torch

from sgl_spec.attention.prefetch import get_prefetcher
from sgl_spec.sparse.elastic import Loads

CUDA = torch.cuda.is_available()
LAYERS, SLOTS, HKV, D, ROWS = 4, 512, 2, 16, 96


def _pass(device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pools = [(torch.randn(SLOTS, HKV, D, generator=g), torch.randn(SLOTS, HKV, D, generator=g))
             for _ in range(LAYERS)]
    pools = [(k.to(device), v.to(device)) for k, v in pools]
    stages = [(torch.full((ROWS, HKV, D), -1.0, device=device),
               torch.full((ROWS, HKV, D), -1.0, device=device)) for _ in range(LAYERS)]
    n = 40
    dst = torch.randperm(ROWS * HKV, generator=g)[:n].to(device)
    src = torch.randint(0, SLOTS * HKV, (n,), generator=g).to(device)
    return Loads(dst, src), pools, stages


def _run(name: str, device: str, seed: int = 0) -> list[torch.Tensor]:
    loads, pools, stages = _pass(device, seed)

    def bufs(layer):
        return (*stages[layer], *pools[layer])

    pf = get_prefetcher(name, device)
    pf.start(loads, LAYERS, bufs if pf.needs_buffers else None)
    seen = []
    x = torch.randn(1024, 1024, device=device)
    for layer in range(LAYERS):
        x = x @ x.T / 1024  # the layers' compute on the current stream
        pf.wait(layer, bufs(layer))
        seen.append(torch.cat([stages[layer][0], stages[layer][1]]).clone())
    return [t.cpu() for t in seen]


def _expected(device: str, seed: int = 0) -> list[torch.Tensor]:
    loads, pools, stages = _pass("cpu", seed)
    out = []
    for (sk, sv), (pk, pv) in zip(stages, pools):
        sk.view(-1, D)[loads.dst] = pk.view(-1, D)[loads.src]
        sv.view(-1, D)[loads.dst] = pv.view(-1, D)[loads.src]
        out.append(torch.cat([sk, sv]))
    return out


@pytest.mark.parametrize("name", ["inline", "thread"])
def test_cpu_prefetchers_copy_the_planned_rows(name):
    for got, want in zip(_run(name, "cpu", seed=1), _expected("cpu", seed=1)):
        assert torch.equal(got, want)


def test_auto_is_inline_on_cpu_and_stream_is_refused():
    assert get_prefetcher("auto", "cpu").name == "inline"
    with pytest.raises(ValueError, match="valid on CPU: auto, inline, thread"):
        get_prefetcher("stream", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["auto", "stream", "thread", "inline"])
def test_cuda_prefetchers_copy_the_planned_rows(name):
    for seed in range(3):
        for got, want in zip(_run(name, "cuda", seed), _expected("cuda", seed)):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_auto_is_the_side_stream_on_cuda():
    assert get_prefetcher("auto", "cuda").name == "stream"


@pytest.mark.parametrize("name", ["inline", "thread"])
def test_load_clock_times_the_counted_layers(name):
    """The clock counts only its layers' loads (with --spec-offload, the host layers');
    inline hides none of them, the thread's share hidden is a fraction."""
    loads, pools, stages = _pass("cpu")

    def bufs(layer):
        return (*stages[layer], *pools[layer])

    pf = get_prefetcher(name, "cpu")
    pf.clock.layers = frozenset({LAYERS - 1})
    pf.start(loads, LAYERS, bufs if pf.needs_buffers else None)
    for layer in range(LAYERS):
        pf.wait(layer, bufs(layer))
    t = pf.clock.totals()
    assert t["passes"] == 1 and t["copy_seconds"] > 0
    assert 0.0 <= t["hidden_share"] <= 1.0
    if name == "inline":
        assert t["hidden_share"] == 0.0 and t["blocked_seconds"] == t["copy_seconds"]
    pf.clock.layers = frozenset()  # no layer counted: nothing timed
    before = pf.clock.totals()["copy_seconds"]
    pf.start(loads, LAYERS, bufs if pf.needs_buffers else None)
    for layer in range(LAYERS):
        pf.wait(layer, bufs(layer))
    assert pf.clock.totals()["copy_seconds"] == before
