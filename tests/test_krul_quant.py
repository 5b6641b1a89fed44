"""The int8 / int4 host-row quantizer against its per-vector reference."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.krul.quant import dequantize, pack4, quantize, quantize_ref, unpack4


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantize_matches_the_reference(dtype, bits):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(17, 3, 64, generator=g) * torch.rand(17, 3, 1, generator=g) * 4).to(dtype)
    x[2, 1] = 0                                           # an all-zero vector
    r = quantize(x, bits)
    q, scale = quantize_ref(x, bits)
    assert torch.equal(r.scale, scale)
    codes = unpack4(r.q) if bits == 4 else r.q
    assert r.q.shape[-1] == 64 * bits // 8
    assert (codes.int() - q.int()).abs().max() <= 1        # rounding at .5 may differ by one
    assert (codes.int() - q.int()).ne(0).float().mean() < 0.01
    assert torch.equal(dequantize(r, dtype)[2, 1], torch.zeros(64, dtype=dtype))


@pytest.mark.parametrize("bits,max_err", [(8, 0.01), (4, 0.13)])
def test_error_and_bytes(bits, max_err):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 3, 64, generator=g).bfloat16()
    r = quantize(x, bits)
    err = float((dequantize(r, torch.float32) - x.float()).norm() / x.float().norm())
    assert err < max_err
    assert r.nbytes() / (x.numel() * 2) == pytest.approx((64 * bits / 8 + 2) / 128)


def test_pack4_round_trips_every_code_in_order():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(2)[:30].reshape(1, 1, 30)
    p = pack4(q)
    assert p.dtype == torch.uint8 and p.shape == (1, 1, 15)
    assert int(p[0, 0, 0]) == (-7 + 8) | ((-6 + 8) << 4)    # even element in the low nibble
    assert torch.equal(unpack4(p), q)


def test_unsupported_bits_name_the_valid_ones():
    with pytest.raises(ValueError, match="valid: 8, 4"):
        quantize(torch.zeros(1, 1, 4), 3)
