"""Exact mode against stock torch_native on the same KV pool (no server): extend and
decode through sgl_spec's plan/run core, and the integration's choice of layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_spec.attention import build_core
from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.extend import offset_causal_mask
from sgl_spec.config import SpecConfig
from sgl_spec.integration.attention import SpecAttnBackend
from sgl_spec.sparse.policy import AttnShape
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

HEADS, KV_HEADS, DIM = 6, 2, 32


def _pool(seq_lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = sum(seq_lens) + 5
    k_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
    perm = torch.randperm(pool, generator=gen)  # scattered slots, as in a real pool
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens) + 2, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        req_to_token[i + 1, :s] = perm[used : used + s].to(torch.int32)
        used += s
    return gen, k_cache, v_cache, req_to_token


def _view(mode, seq_lens, req_to_token, extend_lens=()):
    rows = tuple(range(1, len(seq_lens) + 1))
    return BatchView(mode, tuple(f"r{i}" for i in rows), tuple(seq_lens), rows, tuple(extend_lens),
                     req_to_token=req_to_token, rows=torch.tensor(rows),
                     seq_lens_t=torch.tensor(seq_lens))


def _core():
    return build_core(SpecConfig(), AttnShape(2, HEADS, KV_HEADS, DIM), "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "prefix_lens, new_lens",
    [([0], [17]), ([0, 0, 0], [5, 33, 1]), ([12], [7]), ([40, 0, 3], [1, 9, 20]),
     ([64], [1]), ([100, 0, 30], [300, 260, 5])],
    ids=["one-no-prefix", "batch-no-prefix", "prefix", "ragged-mixed", "prefix-one-token",
         "long-over-prefix"],
)
def test_extend_matches_torch_native(prefix_lens, new_lens, dtype):
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    gen, k_cache, v_cache, r2t = _pool(seq_lens, dtype, sum(seq_lens) * 31 + len(new_lens))
    q = torch.randn(sum(new_lens), HEADS, DIM, generator=gen).to(dtype)
    core = _core()
    plan = core.plan(_view("extend", seq_lens, r2t, new_lens))
    got = torch.full_like(q, float("nan"))  # poisoned: all must be written
    core.run(plan, 0, q, k_cache, v_cache, got, 0.25)
    want = torch.full_like(q, float("nan"))
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        object.__new__(TorchNativeAttnBackend), q, want, k_cache, v_cache, r2t,
        torch.arange(1, len(seq_lens) + 1), torch.tensor(seq_lens), torch.tensor(prefix_lens),
        torch.tensor(new_lens), None, scaling=0.25, enable_gqa=True, causal=True)
    assert not torch.isnan(got).any()
    if not any(prefix_lens):
        assert torch.equal(got, want)  # no prefix: the very same SDPA call
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_lens", [[1], [300], [7, 513, 64]], ids=["one-token", "one", "ragged"])
def test_decode_matches_torch_native(seq_lens, dtype):
    """Exact mode decodes every row with the fused dense kernel: the same softmax as
    torch_native's per-request SDPA, other rounding."""
    gen, k_cache, v_cache, r2t = _pool(seq_lens, dtype, sum(seq_lens))
    q = torch.randn(len(seq_lens), HEADS, DIM, generator=gen).to(dtype)
    core = _core()
    plan = core.plan(_view("decode", seq_lens, r2t))
    got = torch.full_like(q, float("nan"))
    core.run(plan, 0, q, k_cache, v_cache, got, DIM**-0.5)
    want = torch.empty_like(q)
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        object.__new__(TorchNativeAttnBackend), q, want, k_cache, v_cache, r2t,
        torch.arange(1, len(seq_lens) + 1), torch.tensor(seq_lens), scaling=DIM**-0.5,
        enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert core.decoder.stats.exact_steps == len(seq_lens)


def test_layers_torch_native_handles_keep_its_code():
    """Cross-attention, encoder-only, sliding-window layers and SWA pools go to
    torch_native's own extend/decode; ordinary causal layers to sgl_spec's core."""
    from sglang.srt.layers.radix_attention import AttentionType

    backend = object.__new__(SpecAttnBackend)
    backend.use_sliding_window_kv_pool = False

    def layer(**kw):
        base = dict(is_cross_attention=False, attn_type=AttentionType.DECODER,
                    sliding_window_size=-1)
        return SimpleNamespace(**{**base, **kw})

    assert backend._own(layer())
    assert backend._own(layer(sliding_window_size=None))
    assert not backend._own(layer(is_cross_attention=True))
    assert not backend._own(layer(attn_type=AttentionType.ENCODER_ONLY))
    assert not backend._own(layer(sliding_window_size=4))
    backend.use_sliding_window_kv_pool = True
    assert not backend._own(layer())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_calls_agree_with_the_masked_reference(monkeypatch, dtype):
    """Each of exact_extend's three calls is the offset-causal attention: padded over a
    short prefix (torch_native's call), the fused split from SPLIT_MIN_QUERIES new queries
    over a longer one, the masked call for fewer; without a prefix one causal call."""
    from sgl_spec.attention import extend

    calls = []
    split = extend.dense_attention_torch
    monkeypatch.setattr(extend, "dense_attention_torch",
                        lambda q, *a: calls.append(q.shape[0]) or split(q, *a))
    gen = torch.Generator().manual_seed(3)
    n = extend.SPLIT_MIN_QUERIES
    cases = ((40, n, "padded"), (n // 4, n, "padded"), (n // 4 + 1, n, "split"),
             (300, n - 1, "masked"), (0, n, "padded"), (0, 3, "padded"), (1, 3, "masked"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for prefix, new, call in cases:
        q = torch.randn(new, HEADS, DIM, generator=gen).to(dtype)
        k = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).to(dtype)
        assert extend.extend_call(q, k, v, prefix) == call, (prefix, new)
        got = extend.exact_extend(q, k, v, prefix, 0.25)
        assert got.dtype == dtype and got.shape == q.shape
        mask = offset_causal_mask(prefix, new, q.device)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.movedim(0, 1)[None].double(), k.movedim(0, 1)[None].double(),
            v.movedim(0, 1)[None].double(), attn_mask=mask, scale=0.25,
            enable_gqa=True)[0].movedim(1, 0)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert calls == [n]


def test_padded_extend_is_torch_natives_call_bit_for_bit():
    """Over a short prefix exact mode makes stock's own call: same bits as torch_native's
    padded query (its prefix rows hold anything; they are never read)."""
    from sgl_spec.attention.extend import exact_extend

    gen = torch.Generator().manual_seed(5)
    prefix, new = 24, 200
    q = torch.randn(new, HEADS, DIM, generator=gen).bfloat16()
    k = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).bfloat16()
    v = torch.randn(prefix + new, KV_HEADS, DIM, generator=gen).bfloat16()
    stock_q = torch.randn(prefix + new, HEADS, DIM, generator=gen).bfloat16()
    stock_q[prefix:] = q
    stock = torch.nn.functional.scaled_dot_product_attention(
        stock_q.movedim(0, 1)[None], k.movedim(0, 1)[None], v.movedim(0, 1)[None],
        is_causal=True, enable_gqa=True, scale=0.25)[0].movedim(1, 0)[prefix:]
    assert torch.equal(exact_extend(q, k, v, prefix, 0.25), stock)


def test_offset_causal_mask():
    mask = offset_causal_mask(prefix_len=3, q_len=2, device=torch.device("cpu"))
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]
