"""The int8 host-row codec against its per-vector reference."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.krul.quant import dequantize, quantize, quantize_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantize_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(17, 3, 64, generator=g) * torch.rand(17, 3, 1, generator=g) * 4).to(dtype)
    x[2, 1] = 0                                           # an all-zero vector
    r = quantize(x)
    q, scale = quantize_ref(x)
    assert torch.equal(r.scale, scale)
    assert (r.q.int() - q.int()).abs().max() <= 1        # rounding at .5 may differ by one
    assert (r.q.int() - q.int()).ne(0).float().mean() < 0.01
    assert torch.equal(dequantize(r, dtype)[2, 1], torch.zeros(64, dtype=dtype))


def test_error_and_bytes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 3, 64, generator=g).bfloat16()
    r = quantize(x)
    err = float((dequantize(r, torch.float32) - x.float()).norm() / x.float().norm())
    assert err < 0.01
    assert r.nbytes() / (x.numel() * 2) == pytest.approx((64 + 2) / 128)
