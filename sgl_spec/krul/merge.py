"""The MiniCache merge of a shared layer pair (Krul Sec 6.1, after MiniCache Sec 4).

Each token's K (and, separately, V) vector of layers i and j is split into a
magnitude and a direction; the pair keeps one direction, the SLERP of the two at
``t`` (towards the deeper layer j), and each layer keeps its own magnitude per head.
Tokens whose directions differ most are retained unmerged: MiniCache keeps "highly
distinct" tokens; its exact threshold is not in the shared papers, so here the
``retain`` share of tokens with the largest angular distance (max over heads, K or V)
is kept, which also bounds what retention costs. Reference: ``merge_ref``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

_EPS = 1e-6


@dataclass(frozen=True)
class MergeParams:
    t: float = 0.6          # SLERP weight of the deeper layer (MiniCache's default)
    retain: float = 0.05    # share of tokens kept unmerged
    max_error: float = 1.0  # a pair erring more than this (relative L2) is not merged

    def __post_init__(self):
        if not 0.0 <= self.t <= 1.0:
            raise ValueError(f"t must be in [0, 1], got {self.t}")
        if not 0.0 <= self.retain <= 1.0:
            raise ValueError(f"retain must be in [0, 1], got {self.retain}")
        if not self.max_error > 0:
            raise ValueError(f"max_error must be > 0, got {self.max_error}")


class Merged(NamedTuple):
    """A merged pair of one tensor kind (K or V) over n tokens.

    direction: [n, H, D], unit vectors, the input dtype (rows of ``retained`` tokens
        hold layer i's vector unnormalised, so they reconstruct exactly).
    mag_i, mag_j: [n, H], the input dtype; layers i and j's norms.
    retained: [n] bool; those tokens also keep layer j's vector (``kept_j``).
    kept_j: [r, H, D], layer j's vectors of the retained tokens, in token order.
    """

    direction: torch.Tensor
    mag_i: torch.Tensor
    mag_j: torch.Tensor
    retained: torch.Tensor
    kept_j: torch.Tensor


def angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., D] x2 -> [...] float32, the angle between the vectors (0 for a zero vector)."""
    a, b = a.float(), b.float()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=_EPS)
    return torch.arccos(cos.clamp(-1.0, 1.0))


def slerp(u: torch.Tensor, v: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of unit vectors u -> v at t, float32 [..., D]; close to
    parallel (sin omega ~ 0) it falls back to the normalised linear interpolation."""
    u, v = u.float(), v.float()
    omega = torch.arccos((u * v).sum(-1, keepdim=True).clamp(-1.0, 1.0))
    so = torch.sin(omega)
    near = so < 1e-4
    safe = torch.where(near, torch.ones_like(so), so)
    a = torch.where(near, 1.0 - t, torch.sin((1.0 - t) * omega) / safe)
    b = torch.where(near, torch.full_like(so, t), torch.sin(t * omega) / safe)
    e = a * u + b * v
    return e / e.norm(dim=-1, keepdim=True).clamp(min=_EPS)


def _most_distinct(score: torch.Tensor, share: float) -> torch.Tensor:
    """[n] bool: the ceil(share * n) highest scores."""
    n = score.shape[0]
    k = min(n, math.ceil(share * n))
    out = torch.zeros(n, dtype=torch.bool, device=score.device)
    if k:
        out[torch.topk(score, k, sorted=False).indices] = True
    return out


def retained_tokens(xi: torch.Tensor, xj: torch.Tensor, share: float) -> torch.Tensor:
    """[n] bool: the ceil(share * n) tokens whose vectors differ most (max angle over
    heads). xi, xj: [n, H, D]."""
    return _most_distinct(angle(xi, xj).amax(dim=-1), share)


def merge(xi: torch.Tensor, xj: torch.Tensor, params: MergeParams = MergeParams(),
          retained: torch.Tensor | None = None) -> Merged:
    """Merge layer i's and j's vectors of one kind. xi, xj: [n, H, D], same dtype.
    ``retained`` ([n] bool) overrides the choice (K and V of a pair share one set)."""
    if xi.shape != xj.shape or xi.dtype != xj.dtype:
        raise ValueError(f"pair tensors differ: {list(xi.shape)} {xi.dtype} vs "
                         f"{list(xj.shape)} {xj.dtype}")
    if retained is None:
        retained = retained_tokens(xi, xj, params.retain)
    mi = xi.float().norm(dim=-1)                                        # [n, H]
    mj = xj.float().norm(dim=-1)
    e = slerp(xi.float() / mi[..., None].clamp(min=_EPS),
              xj.float() / mj[..., None].clamp(min=_EPS), params.t)
    e[retained] = xi[retained].float()
    return Merged(e.to(xi.dtype), mi.to(xi.dtype), mj.to(xi.dtype), retained,
                  xj[retained].clone())


def pair_retained(ki: torch.Tensor, kj: torch.Tensor, vi: torch.Tensor, vj: torch.Tensor,
                  share: float) -> torch.Tensor:
    """One retained set for K and V of a pair: the union of each kind's most distinct
    tokens would double the cost, so rank tokens by the larger of their K and V angles."""
    return _most_distinct(torch.maximum(angle(ki, kj).amax(-1), angle(vi, vj).amax(-1)), share)


def restore(m: Merged) -> tuple[torch.Tensor, torch.Tensor]:
    """Layers i and j's vectors back from a merge: magnitude x direction, retained
    tokens exact. Returns ([n, H, D], [n, H, D]) in the stored dtype."""
    e = m.direction.float()
    xi = e * m.mag_i.float()[..., None]
    xj = e * m.mag_j.float()[..., None]
    xi[m.retained] = e[m.retained]
    xj[m.retained] = m.kept_j.float()
    return xi.to(m.direction.dtype), xj.to(m.direction.dtype)


def reconstruction_error(m: Merged, xi: torch.Tensor, xj: torch.Tensor) -> float:
    """Relative L2 error of both layers' vectors restored from ``m``."""
    oi, oj = restore(m)
    num = (oi.float() - xi.float()).norm() + (oj.float() - xj.float()).norm()
    return float(num / (xi.float().norm() + xj.float().norm()).clamp(min=1e-12))
