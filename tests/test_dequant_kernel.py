"""Krul's restore kernel: quantized host rows written into pool slots in one pass."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.kernels.dequant import SOURCE, dequant_scatter, dequant_scatter_reference
from sgl_spec.krul.quant import QuantRows, dequantize, quantize

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case(bits, n=70, h=3, d=64, slots=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.rand(n, h, 1, generator=g) * 4
    x[5] = 0  # an all-zero vector: scale 0
    r = quantize(x, bits)
    rows = torch.randperm(n, generator=g)[:50]
    dst = torch.randperm(slots, generator=g)[:50]
    return r, rows, dst


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_pool_rows_equal_the_codec_dequantize_and_others_are_untouched(bits, dtype, impl):
    r, rows, dst = _case(bits)
    out = torch.full((160, 3, 64), float("nan"), dtype=dtype)
    dequant_scatter(r.q, r.scale, bits, rows, out, dst, impl=impl)
    want = dequantize(QuantRows(r.q[rows], r.scale[rows], bits), dtype)
    assert torch.equal(out[dst], want)  # the same float32 products, rounded alike
    untouched = torch.ones(160, dtype=torch.bool)
    untouched[dst] = False
    assert out[untouched].isnan().all()


def test_the_kernel_is_built_here():
    """CI builds it (g++ is installed), so the one-pass path is what the tests exercise."""
    from sgl_spec.kernels.cpu_build import load_cpu_kernel as load

    assert load("dequant_cpu", SOURCE) is not None


def test_reference_equals_the_codec_on_odd_shapes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 6, generator=g)
    for bits in (8, 4):
        r = quantize(x, bits)
        out = torch.zeros(12, 2, 6)
        dst = torch.tensor([11, 0, 3])
        dequant_scatter_reference(r.q, r.scale, bits, torch.tensor([8, 0, 4]), out, dst)
        want = dequantize(QuantRows(r.q[[8, 0, 4]], r.scale[[8, 0, 4]], bits), torch.float32)
        assert torch.equal(out[dst], want)


@pytest.mark.parametrize("bad, message", [
    (dict(bits=2), "2-bit rows are not supported; valid: 8, 4"),
    (dict(impl="cuda"), "dequant impl 'cuda' is invalid; valid: cpu, torch"),
    (dict(codes_dtype=torch.uint8), "8-bit codes must be torch.int8"),
    (dict(out_dtype=torch.int32), "out must be"),
    (dict(scale_dtype=torch.float32), "scale must be bf16"),
    (dict(short_dst=True), "must be equal-length vectors"),
])
def test_bad_calls_name_what_is_valid(bad, message):
    r, rows, dst = _case(8)
    codes = r.q.to(bad.get("codes_dtype", torch.int8))
    scale = r.scale.to(bad.get("scale_dtype", torch.bfloat16))
    out = torch.zeros(160, 3, 64, dtype=bad.get("out_dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=message):
        dequant_scatter(codes, scale, bad.get("bits", 8), rows,
                        out, dst[:-1] if bad.get("short_dst") else dst, impl=bad.get("impl"))
