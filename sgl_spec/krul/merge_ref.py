"""Plain reference of ``merge``: one token and head at a time, float64, no batching.
Slow; for tests only."""

from __future__ import annotations

import math

import torch


def merge_restore_ref(xi: torch.Tensor, xj: torch.Tensor, t: float,
                      retained: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``restore(merge(xi, xj))`` should give: [n, H, D] x2, float64."""
    n, h, _ = xi.shape
    oi = torch.empty(xi.shape, dtype=torch.float64)
    oj = torch.empty(xj.shape, dtype=torch.float64)
    for p in range(n):
        for hh in range(h):
            a, b = xi[p, hh].double(), xj[p, hh].double()
            if retained[p]:
                oi[p, hh], oj[p, hh] = a, b
                continue
            ma, mb = a.norm().item(), b.norm().item()
            u, v = a / max(ma, 1e-6), b / max(mb, 1e-6)
            omega = math.acos(max(-1.0, min(1.0, float(u @ v))))
            if math.sin(omega) < 1e-4:
                e = (1 - t) * u + t * v
            else:
                e = (math.sin((1 - t) * omega) * u + math.sin(t * omega) * v) / math.sin(omega)
            e = e / e.norm()
            oi[p, hh], oj[p, hh] = ma * e, mb * e
    return oi, oj
