"""Attention-mass scoring of history positions and top-B selection.

Shared by SnapKV (prompt-window queries, once) and LoopServe (ring of the last n_d
decoded queries, every n_d steps). Scoring is one batched matmul per layer over
all queries and heads at once: each layer's keys are read once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOL_KINDS = ("avg", "max", "none")


@torch.no_grad()
def score_history(
    q: torch.Tensor,  # [n, Hq, D] observation queries (any float dtype)
    k: torch.Tensor,  # [N, Hkv, D] one layer's keys of the whole history
    scale: float,
    q_pos: torch.Tensor | None = None,  # [n] int64 positions of the queries
) -> torch.Tensor:  # [Hkv, N] fp32, on k's device
    """Attention each history position receives from the observation queries.

    Per query and query head: softmax over the history (positions <= the query's
    own position when ``q_pos`` is given, else all N). Summed over the queries and
    over the query heads of each KV head's GQA group (sum, not max: the total mass
    the group pays a position). Eq. 7 of LoopServe (Sec 5.3) per KV head.
    """
    n, hq, d = q.shape
    big_n, hkv, dk = k.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    g = hq // hkv
    # The logits' matmul runs in the keys' dtype when that is 16-bit (fp32
    # accumulation): on CPUs with AVX512-BF16 a bf16 bmm is ~4x faster than
    # converting the history to fp32 first, and rounding a logit to 8 mantissa
    # bits moves a softmax weight by < 0.5% of itself, far below what top-B
    # ranking resolves. The softmax and the sums are fp32.
    mm = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
    # Rows of one KV head's group: (query, head in group); scale folded into q.
    qg = (q.float() * scale).reshape(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
    kh = k.to(mm).transpose(0, 1).contiguous()  # [Hkv, N, D]: one pass over the keys
    logits = torch.bmm(qg.to(mm), kh.transpose(1, 2))  # [Hkv, n * G, N]
    if q_pos is not None and n:
        # Only columns after the earliest query can be in some query's future.
        lo = int(q_pos.min()) + 1
        if lo < big_n:
            cols = torch.arange(lo, big_n, device=k.device)
            future = cols[None, :] > q_pos.to(k.device)[:, None]  # [n, N - lo]
            logits[:, :, lo:].masked_fill_(
                future.repeat_interleave(g, dim=0)[None], float("-inf")
            )
    return torch.softmax(logits, dim=-1, dtype=torch.float32).sum(dim=1)


def pool_scores(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's 1-D pooling along positions (stride 1, same length). [Hkv, M] -> [Hkv, M]."""
    if kind not in POOL_KINDS:
        raise ValueError(f"pool kind {kind!r} is invalid; valid: {', '.join(POOL_KINDS)}")
    if kind == "none" or kernel <= 1 or scores.shape[1] == 0:
        return scores
    x = scores[None]  # [1, Hkv, M]
    if kind == "avg":
        return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)[0]
    return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)[0]


def select_topk(
    scores: torch.Tensor,  # [Hkv, >= hi] fp32
    budget: int,
    lo: int,  # first candidate position (the sink's end)
    hi: int,  # one past the last candidate (the recent window's start)
) -> torch.Tensor:  # [Hkv, min(budget, hi - lo)] int64 positions, ascending
    """Top-``budget`` positions of ``[lo, hi)`` per KV head: unique, outside sink and window."""
    n = max(0, min(budget, hi - lo))
    if n == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.int64, device=scores.device)
    idx = scores[:, lo:hi].topk(n, dim=-1, sorted=False).indices + lo
    return idx.sort(dim=-1).values
