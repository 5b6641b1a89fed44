"""Rotary position embedding of the retrieval head (Llama's rotate-half form).

``default``, ``linear`` (position interpolation) and ``yarn`` (YaRN, Peng et al. 2023:
interpolate low frequencies, keep high ones, scale the logits by
``0.1 ln(factor) + 1``) as Hugging Face computes them, so a draft trained at ~2k
tokens can read past its training length (SpeContext Sec 4.3).
"""

from __future__ import annotations

import math

import torch

from .config import HeadConfig


def inv_freq(cfg: HeadConfig) -> tuple[torch.Tensor, float]:
    """``([D/2] fp32 inverse frequencies, attention factor)`` for the head's RoPE."""
    d, base = cfg.head_dim, cfg.rope_theta
    freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    kind, s = cfg.rope_type, cfg.scaling
    if kind == "default":
        return (1.0 / freqs).float(), 1.0
    factor = float(s["factor"])
    if kind == "linear":
        return (1.0 / (freqs * factor)).float(), 1.0
    # yarn
    orig = int(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
    fast, slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def dim_of(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(fast)), 0)
    high = min(math.ceil(dim_of(slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv = (1.0 / (freqs * factor)) * (1 - keep) + (1.0 / freqs) * keep
    attn = float(s.get("attention_factor") or 0.1 * math.log(factor) + 1.0)
    return inv.float(), attn


def apply(
    x: torch.Tensor,  # [T, H, D]
    positions: torch.Tensor,  # [T] int64
    inv: torch.Tensor,  # [D/2] fp32
    attn_factor: float = 1.0,
) -> torch.Tensor:  # [T, H, D] fp32
    ang = positions.to(torch.float32)[:, None] * inv.to(x.device)[None, :]  # [T, D/2]
    cos = (torch.cos(ang) * attn_factor)[:, None, :]
    sin = (torch.sin(ang) * attn_factor)[:, None, :]
    x = x.float()
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
