"""The recompute/load split of a restore (Krul Sec 6).

A demoted conversation of n tokens keeps, at layer l, the rows [U_l, n) in its tier
and leaves [0, U_l) unstored. On its next turn layer l recomputes [0, R_l) (running
the layers on those tokens' hidden states) while [R_l, n) is loaded. Layer l's input
for [0, R_l) is layer l-1's output, which exists only if R_l <= R_{l-1} (Eq. 4-5), so
R must be non-increasing: the pyramid, most recompute at the first layer. The share
of recompute comes from a calibration of this hardware (``choose_share``): the paper's
two pipelines run side by side, so the restore takes max(T_C, T_L) and the best share
makes them equal (Eq. 1). A restore that overlaps them only in part (``overlap`` < 1,
measured: ``calibrate restore --pipeline-share``) or not at all (a serial restore,
``overlap`` 0) takes max + (1 - overlap) x min (``restore_time``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestoreCost:
    """Calibrated costs on one tier (``python -m sgl_spec.calibrate restore``)."""

    recompute_s: float   # seconds to recompute one token at one layer
    load_s: float        # seconds to load one full row (one token, one layer, K and V)

    def __post_init__(self):
        if self.recompute_s <= 0 or self.load_s < 0:
            raise ValueError(f"costs must be recompute_s > 0, load_s >= 0; got "
                             f"{self.recompute_s}, {self.load_s}")


def pyramid(n: int, num_layers: int, share: float) -> tuple[int, ...]:
    """Unstored prefix lengths U [L], non-increasing, with sum(U) ~= share * n * L:
    U_l = min(n, round(h * (L - l) / L)) for the smallest height h that reaches the share
    (a linear pyramid, clipped to a trapezoid past share 0.5)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    L = num_layers
    want = share * n * L

    def shape(h: float) -> tuple[int, ...]:
        return tuple(min(n, int(round(h * (L - l) / L))) for l in range(L))

    lo, hi = 0.0, float(n * L + n)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(shape(mid)) < want:
            lo = mid
        else:
            hi = mid
    return shape(hi) if want > 0 else (0,) * L


def restore_lengths(unstored: Sequence[int], device_prefix: int, n: int) -> tuple[int, ...]:
    """R [L]: layer l recomputes [device_prefix, R_l), the suffix max of the unstored
    prefixes (a path whose nodes were compressed with different U), never below the
    device-resident prefix nor above n."""
    out, run = [], device_prefix
    for u in reversed(unstored):
        run = max(run, min(u, n))
        out.append(run)
    return tuple(reversed(out))


def missing(R: Sequence[int], unstored: Sequence[int], device_prefix: int,
            n: int) -> list[tuple[int, int]]:
    """(layer, first position) of every gap a restore with lengths R would leave:
    a layer whose input hidden states the layer below did not compute (R_l > R_{l-1}),
    or unstored rows [device_prefix, U_l) that R_l does not recompute. Empty: complete."""
    gaps = []
    for l, (r, u) in enumerate(zip(R, unstored)):
        if l and r > R[l - 1]:
            gaps.append((l, R[l - 1]))
        if not device_prefix <= r <= n:
            gaps.append((l, r))
        if min(u, n) > max(r, device_prefix):
            gaps.append((l, max(r, device_prefix)))
    return gaps


def times(cost: RestoreCost, n: int, unstored: Sequence[int],
          load_weight: Sequence[float]) -> tuple[float, float]:
    """(T_C, T_L) in seconds: recomputed token-layers, and stored rows weighted by what a
    row costs to load at each layer (1 for an own row; a merged pair loads its
    direction once, so each of its layers weighs about half, plus magnitudes)."""
    tc = cost.recompute_s * sum(unstored)
    tl = cost.load_s * sum(w * (n - u) for w, u in zip(load_weight, unstored))
    return tc, tl


def restore_time(tc: float, tl: float, overlap: float = 1.0) -> float:
    """A restore's seconds when a share ``overlap`` of the shorter part runs beside the
    longer: max(T_C, T_L) fully overlapped (1), T_C + T_L serially (0)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap {overlap}: valid 0 <= overlap <= 1")
    return max(tc, tl) + (1.0 - overlap) * min(tc, tl)


def choose_share(cost: RestoreCost, n: int, load_weight: Sequence[float],
                 max_share: float = 1.0, steps: int = 64, overlap: float = 1.0) -> float:
    """The recompute share in [0, max_share] (a grid of ``steps``) minimising
    ``restore_time`` (max(T_C, T_L) at the paper's full ``overlap``); the smallest such
    share on ties, so a free load recomputes nothing."""
    L = len(load_weight)
    best, best_t = 0.0, float("inf")
    for s in range(steps + 1):
        share = max_share * s / steps
        t = restore_time(*times(cost, n, pyramid(n, L, share), load_weight), overlap)
        if t < best_t - 1e-12:
            best, best_t = share, t
    return best
