"""Krul's quantized host rows written back into the KV pool in one pass.

``dequant_scatter(codes, scale, bits, rows, out, dst)``: ``out[dst] = codes[rows] x
scale[rows]`` in ``out``'s dtype, for the codecs of ``sgl_spec.krul.quant`` (int8 rows, or
4-bit rows packed two to a byte, a bf16 scale per token and head). A restore calls it per
layer for K and V. The torch path gathers the codes, unpacks and scales them in float32
temporaries and then scatters, four to five passes over the rows; the C++ kernel
(``csrc/dequant_cpu.cpp``, built on first use by ``kernels.cpu_build``) reads each row's
codes once and writes its pool row once. Reference: ``reference.dequant_scatter_reference``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cpu_build import load_cpu_kernel
from .reference import dequant_scatter_reference

SOURCE = Path(__file__).with_name("csrc") / "dequant_cpu.cpp"
IMPLS = ("cpu", "torch")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["IMPLS", "dequant_scatter", "dequant_scatter_reference"]


def _check(codes, scale, bits, rows, out, dst) -> None:
    if bits not in (8, 4):
        raise ValueError(f"{bits}-bit rows are not supported; valid: 8, 4")
    if out.dim() != 3 or out.dtype not in _OUT_DTYPES:
        raise ValueError(f"out must be [slots, H, D] of {_OUT_DTYPES}, not "
                         f"{tuple(out.shape)} {out.dtype}")
    _, h, d = out.shape
    want = (torch.int8, d) if bits == 8 else (torch.uint8, d // 2)
    if codes.dtype != want[0] or codes.dim() != 3 or tuple(codes.shape[1:]) != (h, want[1]):
        raise ValueError(f"{bits}-bit codes must be {want[0]} [rows, {h}, {want[1]}], not "
                         f"{codes.dtype} {tuple(codes.shape)}")
    if scale.dtype != torch.bfloat16 or tuple(scale.shape) != (codes.shape[0], h):
        raise ValueError(f"scale must be bf16 [{codes.shape[0]}, {h}], not "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if rows.shape != dst.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and dst {tuple(dst.shape)} must be "
                         "equal-length vectors")


def _kernel_takes(codes, scale, out) -> bool:
    return (all(t.device.type == "cpu" and t.is_contiguous() for t in (codes, scale, out))
            and out.shape[2] <= 1024)


def dequant_scatter(codes: torch.Tensor, scale: torch.Tensor, bits: int, rows: torch.Tensor,
                    out: torch.Tensor, dst: torch.Tensor, impl: str | None = None) -> None:
    """``out[dst] = dequantize(codes[rows], scale[rows])`` (module doc). ``impl``: ``cpu``
    (the C++ kernel; the torch path where it is off or cannot take the call), ``torch``,
    or None (``cpu``). Row and slot indices must be in range (not checked per row)."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"dequant impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
    _check(codes, scale, bits, rows, out, dst)
    if impl != "torch" and _kernel_takes(codes, scale, out):
        mod = load_cpu_kernel("dequant_cpu", SOURCE)
        if mod is not None:
            mod.dequant_scatter(codes, scale, bits, rows.long().contiguous(), out,
                                dst.long().contiguous())
            return
    dequant_scatter_reference(codes, scale, bits, rows, out, dst)
