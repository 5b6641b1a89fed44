"""Which earlier rounds a new question attends past the watershed (Round Attention,
Sec. 3.3), from qAtt at layer L_w (Eq. 1) normalised over the earlier rounds.

``piece_peak`` and ``round_scores`` compute qAtt from the question's queries and the
history's keys at L_w; the strategies below pick from it.

A registry of strategies (``--spec-round-strategy``):

* ``topk``: the top 10% of the rounds by attention (at least one), the paper's
  Strategy 2 (the top 10% hold over 80% of the mass);
* ``fixed``: the rounds whose share exceeds a fixed threshold (0.1), Strategy 1;
* ``adaptive``: the rounds whose share exceeds mean + 3 std of the shares (the outliers),
  Strategy 3, sigma-clipped: the outliers found are set aside and mean + 3 std is taken
  again over the rest until no new one exceeds it, so that one dominant round's weight in
  the std does not hide a second (the masking effect of a single pass).

Whatever a strategy picks, ``select`` also keeps the ``recent`` rounds just before the
question (a follow-up usually refers to them) and at least the most attended round; the
system prompt's round (0) and the question's own round are not candidates: the server
always keeps both.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class RoundStrategy(ABC):
    """Picks rounds from ``share`` [R] fp32 (qAtt over the R earlier rounds, sums to 1);
    returns a [R] bool mask. Stateless."""

    name: ClassVar[str]

    @abstractmethod
    def pick(self, share: torch.Tensor) -> torch.Tensor: ...


class TopK(RoundStrategy):
    name = "topk"
    fraction = 0.10

    def pick(self, share):
        k = max(1, math.ceil(self.fraction * share.numel()))
        mask = torch.zeros_like(share, dtype=torch.bool)
        mask[torch.topk(share, k).indices] = True
        return mask


class Fixed(RoundStrategy):
    name = "fixed"
    threshold = 0.1

    def pick(self, share):
        return share > self.threshold


class Adaptive(RoundStrategy):
    name = "adaptive"
    sigmas = 3.0

    def pick(self, share):
        mask = torch.zeros_like(share, dtype=torch.bool)
        while (~mask).sum() > 1:
            rest = share[~mask]
            new = ~mask & (share > rest.mean() + self.sigmas * rest.std(unbiased=False))
            if not new.any():
                break
            mask |= new
        return mask


STRATEGIES: dict[str, type[RoundStrategy]] = {c.name: c for c in (TopK, Fixed, Adaptive)}


def strategy(name: str) -> RoundStrategy:
    """The strategy registered as ``name``; ValueError lists the valid ones."""
    if name not in STRATEGIES:
        raise ValueError(f"round strategy {name!r} is invalid; valid: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]()


def select(share: torch.Tensor, how: RoundStrategy, recent: int = 1) -> list[int]:
    """Indices (ascending, into ``share``'s R earlier rounds) of the rounds a question
    attends past L_w: ``how``'s pick, the last ``recent`` rounds and the most attended
    one."""
    if share.dim() != 1 or share.numel() == 0:
        raise ValueError(f"share must be a non-empty [R] vector, got shape {tuple(share.shape)}")
    mask = how.pick(share.float())
    if recent > 0:
        mask[-recent:] = True
    mask[int(torch.argmax(share))] = True
    return torch.nonzero(mask).flatten().tolist()


def piece_peak(q: torch.Tensor, keys: torch.Tensor, spans: list[tuple[int, int]],
               scale: float) -> torch.Tensor:
    """The largest softmax attention probability of each query of ``q`` ([n, Hq, D], the
    last n queries of a sequence) on one key in [start, end) of ``keys`` ([S, Hkv, D], the
    sequence's), per head and query; causal. [Hq, n, len(spans)] float32."""
    n, hq, _ = q.shape
    total, hkv = keys.shape[0], keys.shape[1]
    qh = q.float().transpose(0, 1)  # [Hq, n, D]
    kh = keys.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, S, D]
    logits = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [Hq, n, S]
    qpos = torch.arange(total - n, total)[:, None]
    logits.masked_fill_(torch.arange(total)[None, :] > qpos, float("-inf"))
    if not spans:
        return logits.new_zeros(hq, n, 0)
    p = torch.softmax(logits, dim=-1)
    return torch.stack([p[..., a:b].amax(-1) for a, b in spans], dim=-1)


def round_scores(peak: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """qAtt of each group of pieces (a round's turns) from ``piece_peak``'s [Hq, n, P]:
    per head and query the group's peak (its largest probability on one key), the largest
    over the question's queries, summed over the heads. [len(groups)] float32.

    The paper's Eq. 1 sums each query's mass on a round over the queries. Two changes:
    the largest over the queries keeps the one query that looks a fact up from being
    outweighed by the rest of a short question attending near itself, and the peak
    instead of the mass keeps a long round's diffuse share from outweighing the few keys
    a fact lookup lands on; the thresholds of ``fixed`` and ``adaptive`` then separate the
    looked-up round (docs/design/round-attention.md, "Selection")."""
    per = torch.stack([peak[..., g].amax(-1) for g in groups], dim=-1)  # [Hq, n, G]
    return per.amax(dim=1).sum(0)
