"""Attention-mass scoring of history positions and top-B selection, batched over rows.

Shared by SnapKV (prompt-window queries, once) and LoopServe (ring of the last n_d
decoded queries, every n_d steps). On a CPU ``score_history`` and ``select`` run the C++
kernel (``sgl_spec.kernels.sparse_decode.history_mass`` and ``select_top``: each key read
once, the softmax kept per chunk of keys, no logits matrix written out); elsewhere, and as
the kernel's reference (``impl="torch"``), one batched matmul per layer over all rows,
queries and heads, then torch's softmax, sums and top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sgl_spec.kernels.sparse_decode import history_mass, select_top

POOL_KINDS = ("avg", "max", "none")
IMPLS = ("auto", "torch")  # auto: the C++ kernel where it takes the call


class Scratch:
    """Reusable buffers for one caller (a policy, on the scheduler thread): scoring takes
    its multi-MB temporaries (the keys in head-major fp32, the queries' probabilities) from
    here rather than allocating them per layer. A fresh tensor that large is fresh pages
    from the kernel, and faulting them in can cost more than the scoring itself on a CPU
    (docs/results/). Each buffer keeps the largest size asked of it."""

    def __init__(self):
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised), valid until the next ``take(name)``."""
        n = math.prod(shape)
        key = (name, dtype, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


@torch.no_grad()
def score_history(
    q: torch.Tensor,  # [R, n, Hq, D] observation queries (any float dtype)
    k: torch.Tensor,  # [R, N, Hkv, D] one layer's keys of each row's history (padded)
    scale: float,
    q_pos: torch.Tensor | None = None,  # [R, n] int64 positions of the queries; -1: unused
    k_len: torch.Tensor | None = None,  # [R] int64 keys per row (padding after); None: N
    scratch: Scratch | None = None,  # reused buffers of the torch path (None: per call)
    impl: str = "auto",
) -> torch.Tensor:  # [R, Hkv, N] fp32, on k's device
    """Attention each history position receives from the observation queries.

    Per query and query head: softmax over the history (positions <= the query's own
    position when ``q_pos`` is given, and < ``k_len``). Summed over the queries and
    over the query heads of each KV head's group (sum, not max: the total mass the
    group pays a position). Eq. 7 of LoopServe (Sec 5.3) per KV head. A query with
    position -1 (an unfilled ring entry) contributes nothing; padded keys score 0.
    """
    if impl not in IMPLS:
        raise ValueError(f"scoring impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    if impl == "auto":
        out = history_mass(q, k, scale, q_pos, k_len)
        if out is not None:
            return out
    rows, n, hq, d = q.shape
    _, big_n, hkv, dk = k.shape
    if dk != d or hq % hkv or k.shape[0] != rows:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    g, dev = hq // hkv, k.device
    scratch = scratch if scratch is not None else Scratch()
    # The logits' matmul: fp32 on a CPU (the keys converted once, as they are copied
    # head-major; as fast there as a bf16 bmm, and exact), the keys' 16-bit dtype on a
    # GPU (fp32 accumulation; a logit rounded to 8 mantissa bits moves a softmax weight
    # by < 0.5% of itself, far below what top-B ranking resolves). The softmax and the
    # sums are fp32.
    mm = k.dtype if dev.type != "cpu" and k.dtype in (torch.bfloat16, torch.float16) \
        else torch.float32
    # Rows of one KV head's group: (query, head in group); scale folded into q.
    qg = (q.float() * scale).reshape(rows, n, hkv, g, d).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(rows * hkv, n * g, d).to(mm)
    kh = scratch.take("keys", (rows, hkv, big_n, d), mm, dev)
    kh.copy_(k.permute(0, 2, 1, 3))  # head-major: the matmul reads each head's keys in order
    x = scratch.take("probs", (rows * hkv, n * g, big_n), torch.float32, dev)
    if mm == torch.float32:
        torch.bmm(qg, kh.view(rows * hkv, big_n, d).transpose(1, 2), out=x)
    else:
        x.copy_(torch.bmm(qg, kh.view(rows * hkv, big_n, d).transpose(1, 2)))
    x4 = x.view(rows, hkv, n * g, big_n)
    # Only columns after the earliest query, or past the shortest row, can be hidden
    # from some query: mask that tail alone (LoopServe's ring: the last n_d columns).
    unused = None
    start = big_n
    if q_pos is not None:
        q_pos = q_pos.to(dev)
        used = q_pos >= 0
        if not bool(used.all()):
            unused = ~used
        if bool(used.any()):
            start = min(start, int(q_pos[used].min()) + 1)
    if k_len is not None:
        k_len = k_len.to(dev)
        start = min(start, int(k_len.min()))
    if start < big_n:
        cols = torch.arange(start, big_n, device=dev)
        hide = torch.zeros(rows, n, big_n - start, dtype=torch.bool, device=dev)
        if q_pos is not None:
            hide |= cols[None, None, :] > q_pos[:, :, None]  # a query's future
        if k_len is not None:
            hide |= (cols[None, :] >= k_len[:, None])[:, None, :]  # padding
        x4[..., start:].masked_fill_(hide.repeat_interleave(g, dim=1)[:, None], float("-inf"))
    # Softmax in place; each row's 1/sum weights it in one matmul that also sums the
    # group's queries and heads: mass[h, j] = sum_q exp(x[h, q, j] - max_q) / sum_q.
    top = x.amax(dim=-1, keepdim=True)
    top.masked_fill_(top == float("-inf"), 0.0)  # a row hiding every key adds nothing
    x.sub_(top).exp_()
    w = x.sum(dim=-1, keepdim=True).reciprocal_()  # [rows * hkv, n * g, 1]
    w.masked_fill_(torch.isinf(w), 0.0)
    if unused is not None:  # unfilled ring entries: their rows add nothing
        w.view(rows, hkv, n * g).masked_fill_(unused.repeat_interleave(g, dim=1)[:, None], 0.0)
    return torch.bmm(w.transpose(1, 2), x).view(rows, hkv, big_n)


def pool_scores(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's 1-D pooling along positions (stride 1, same length). [..., M] -> [..., M]."""
    if kind not in POOL_KINDS:
        raise ValueError(f"pool kind {kind!r} is invalid; valid: {', '.join(POOL_KINDS)}")
    if kind == "none" or kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores.reshape(-1, 1, scores.shape[-1])
    fn = F.avg_pool1d if kind == "avg" else F.max_pool1d
    return fn(x, kernel, stride=1, padding=kernel // 2).view(scores.shape)


def look_ahead(
    scores: torch.Tensor,  # [R, Hkv, N] fp32, a history's attention mass
    width: int,
    lo: torch.Tensor,  # [R] int64: the sink's end (its mass is not passed on)
) -> torch.Tensor:  # [R, Hkv, N]: scores[n] + max(scores[n - width .. n])
    """Each position scored by its own mass plus the largest mass among itself and the
    ``width`` positions before it, outside the sink (issue 47). A decode that restates
    what it attended, a subject say, reads next what follows it (the value), which its
    queries have not yet paid attention to: the top-B of these scores keeps spans that
    start at attended tokens. An attended token itself scores twice its mass, so the
    tokens attended at over half the peak still come before the peak's followers (a
    small budget is not spent on one span). The sink's positions pass nothing on (their
    mass is large and says nothing about what follows them). ``width`` 0: the scores as
    they are."""
    if width <= 0 or scores.shape[-1] == 0:
        return scores
    cols = torch.arange(scores.shape[-1], device=scores.device)
    x = scores.masked_fill((cols[None, :] < lo.to(scores.device)[:, None])[:, None, :], 0.0)
    x = x.reshape(-1, 1, x.shape[-1])
    x = F.max_pool1d(F.pad(x, (width, 0), value=0.0), width + 1, stride=1)
    return scores + x.view(scores.shape)


def select(
    scores: torch.Tensor,  # [R, Hkv, N] fp32, a history's attention mass
    budget: int,
    lo: torch.Tensor,  # [R] int64: the sink's end
    hi: torch.Tensor,  # [R] int64: the recent window's start
    width: int = 0,  # look_ahead's
    impl: str = "auto",
) -> torch.Tensor:  # [R, Hkv, budget] int64 positions, ascending
    """``look_ahead(scores, width, lo)`` then ``select_topk(..., first_of_ties=True)``:
    one C++ call on a CPU (``impl="auto"``), those two elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"scoring impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
    if impl == "auto" and bool(((hi - lo) >= budget).all()):
        out = select_top(scores, lo, hi, budget, max(width, 0))
        if out is not None:
            return out.to(scores.device)
    return select_topk(look_ahead(scores, width, lo), budget, lo, hi, first_of_ties=True)


def select_topk(
    scores: torch.Tensor,  # [R, Hkv, >= max(hi)] fp32
    budget: int,
    lo: torch.Tensor,  # [R] int64: first candidate position (the sink's end)
    hi: torch.Tensor,  # [R] int64: one past the last candidate (the recent window's start)
    first_of_ties: bool = False,
) -> torch.Tensor:  # [R, Hkv, budget] int64 positions, ascending
    """Top-``budget`` positions of ``[lo, hi)`` per row and KV head: unique, outside sink
    and window. Every row needs ``hi - lo >= budget`` (a sparse row always has it:
    ``DecodeConfig.use_exact`` keeps shorter histories dense).

    ``first_of_ties``: among equal scores the earlier positions win (a stable sort), so a
    row selects the same whatever its batch. ``topk`` breaks ties as its kernel likes,
    which scores with plateaus (``look_ahead``'s) make visible."""
    if bool(((hi - lo) < budget).any()):
        raise ValueError(f"select_topk: every row needs >= {budget} candidates, got "
                         f"{(hi - lo).tolist()}")
    cols = torch.arange(scores.shape[-1], device=scores.device)
    outside = (cols[None, :] < lo.to(scores.device)[:, None]) | (
        cols[None, :] >= hi.to(scores.device)[:, None])
    masked = scores.masked_fill(outside[:, None, :], float("-inf"))
    if not first_of_ties:
        return masked.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values
    # Everything above the budget-th score, then the earliest of those equal to it (a
    # stable sort of the whole history costs ~3x this).
    thr = masked.topk(budget, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = masked > thr
    tied = masked == thr
    keep = above | (tied & (tied.cumsum(dim=-1) <= budget - above.sum(dim=-1, keepdim=True)))
    return keep.nonzero()[:, -1].view(*scores.shape[:-1], budget)  # row-major: ascending
