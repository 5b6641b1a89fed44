"""Exact-mode extend against stock torch_native on the same KV pool (no server)."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.attention.backend import SpecAttnBackend, offset_causal_mask
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend


def _bare(cls):
    return object.__new__(cls)  # the extend kernels read no backend state


def _make_batch(prefix_lens, new_lens, heads=6, kv_heads=2, dim=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 31 + sum(new_lens))
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    pool = sum(seq_lens) + 5
    k_cache = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(pool, generator=gen)  # scattered slots, as in a real pool
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens) + 2, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        req_to_token[i + 1, :s] = perm[used : used + s].to(torch.int32)
        used += s
    q = torch.randn(sum(new_lens), heads, dim, generator=gen).to(dtype)
    return dict(
        query=q,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(1, len(seq_lens) + 1),
        seq_lens=torch.tensor(seq_lens),
        extend_prefix_lens=torch.tensor(prefix_lens),
        extend_seq_lens=torch.tensor(new_lens),
    )


def _run(cls, batch, **kw):
    out = torch.full_like(batch["query"], float("nan"))  # poisoned: all must be written
    args = dict(batch)
    q = args.pop("query")
    cls._run_sdpa_forward_extend(
        _bare(cls), q, out, args["k_cache"], args["v_cache"], args["req_to_token"],
        args["req_pool_indices"], args["seq_lens"], args["extend_prefix_lens"],
        args["extend_seq_lens"], None, scaling=0.25, enable_gqa=True, causal=True, **kw,
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "prefix_lens, new_lens",
    [([0], [17]), ([0, 0, 0], [5, 33, 1]), ([12], [7]), ([40, 0, 3], [1, 9, 20]),
     ([64], [1])],
    ids=["one-no-prefix", "batch-no-prefix", "prefix", "ragged-mixed", "prefix-one-token"],
)
def test_extend_matches_torch_native(prefix_lens, new_lens, dtype):
    batch = _make_batch(prefix_lens, new_lens, dtype=dtype)
    got = _run(SpecAttnBackend, batch)
    want = _run(TorchNativeAttnBackend, batch)
    assert not torch.isnan(got).any()
    if not any(prefix_lens):
        assert torch.equal(got, want)  # no prefix: the very same SDPA call
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_extend_with_sliding_window_matches_torch_native():
    batch = _make_batch([10, 0], [6, 12])
    got = _run(SpecAttnBackend, batch, sliding_window_size=4)
    want = _run(TorchNativeAttnBackend, batch, sliding_window_size=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_offset_causal_mask():
    mask = offset_causal_mask(prefix_len=3, q_len=2, device=torch.device("cpu"))
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]
    windowed = offset_causal_mask(3, 2, torch.device("cpu"), sliding_window=1)
    assert windowed.tolist() == [[False, False, True, True, False],
                                 [False, False, False, True, True]]
