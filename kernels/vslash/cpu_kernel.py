"""The C++ slash-line kernel for CPUs (``csrc/slash_cpu.cpp``): loader and wrapper.

The torch path computes far slash lines with ``sampled_addmm`` + ``embedding_bag``
and near ones as masked rectangles; both cost several times a fused kernel per
selected cell on a CPU, which ate most of the line-sparse saving. ``csrc/slash_cpu.cpp`` computes
every slash cell (the local band included) directly, row by row over a gathered key
list, skipping cells on selected verticals (see the source's header).
``torch_impl.vslash_attention_torch`` then needs only two parts per row block, the
slashes (this kernel) and the verticals (one fused SDPA call), merged by their
log-sum-exps.

Built on first use (``kernels.cpu_build``; ``SGLSPEC_CPU_KERNELS=0`` turns it off).
Where it cannot be built the torch path stays the CPU path.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from ..cpu_build import load_cpu_kernel

HEAD_DIMS = (16, 32, 64, 128)  # the instantiated ones (multiples of 16 lanes)
MAX_LINE_GROUP = 8  # query heads per line head the kernel is instantiated for
SOURCE = Path(__file__).with_name("csrc") / "slash_cpu.cpp"


def load_kernel() -> ModuleType | None:
    """The compiled module, or None where it is off or cannot be built (warned once)."""
    return load_cpu_kernel("slash_cpu", SOURCE)


def supported(q: torch.Tensor, head_dim: int, line_group: int) -> bool:
    """Whether the kernel takes this call (CPU tensors, its head dims and groups)."""
    return (q.device.type == "cpu" and head_dim in HEAD_DIMS
            and 1 <= line_group <= MAX_LINE_GROUP and load_kernel() is not None)


class SlashInputs:
    """One KV head's fp32 K and V rows and its owned-column bytes, shared by row blocks."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, owned: torch.Tensor):
        # k, v [K, D]; owned [K] bool: columns whose cells another part computes
        self.k = k.float().contiguous()
        self.v = v.float().contiguous()
        self.owned = owned.cpu().to(torch.uint8).contiguous()


def slash_attention(
    qb: torch.Tensor,  # [lg, R, D] one line head's query rows
    inputs: SlashInputs,
    slash: torch.Tensor,  # [m] int64 sorted offsets (CPU)
    tail: torch.Tensor,  # [nt] int64 sorted columns > p0 the rows reach causally
    p0: int,  # position of row 0
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [lg, R, D] fp32, lse [lg, R] fp32
    """Attention of each row over its slash cells (owned columns excluded) and the
    ``tail`` columns at or before it, and its lse.

    Rows with no such cell have out 0 and lse -inf.
    """
    mod = load_kernel()
    if mod is None:
        raise RuntimeError("the CPU slash kernel is not available (see load_kernel)")
    q = (qb.float() * scale).contiguous()
    return mod.slash_attention(q, inputs.k, inputs.v, inputs.owned, slash, tail, p0)
