"""The vertical/slash line set every vslash implementation shares, and its checks.

Setting: an extend of ``n`` new queries at absolute positions ``N .. N+n-1`` over
``N = history_len`` cached tokens; keys at positions ``0 .. N+n-1`` (``K = N+n``),
causal. Per line head ``h`` a :class:`LineSet` selects

* vertical lines: key columns ``c`` (absolute key positions, ``0 <= c < K``);
  cell ``(p, c)`` is selected for every query position ``p >= c``;
* slash lines: diagonals ``d = p - c`` (``0 <= d < K``); cell ``(p, p - d)`` is
  selected for every query with ``p - d >= 0``.

A cell on both a selected vertical and a selected slash is one cell: attention over
a line set is softmax over the *union* of the selected cells, each counted once.

Line heads: ``len(lines.vertical)`` is ``H_l``; query head ``qh`` uses line head
``qh // (Hq // H_l)``. ``H_l`` must divide ``Hq`` and be a multiple of ``Hkv`` so
that a line head never spans two KV heads. ``H_l = Hkv`` (one set per KV head, what
``select.select_lines`` returns by default) and ``H_l = Hq`` are the usual cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# float64 for the reference (tests); the Triton path takes the 16/32-bit ones only.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class LineSet(NamedTuple):
    """Selected lines per line head. Tensors live on the CPU (host-side metadata)."""

    vertical: list[torch.Tensor]  # per head: [n_v] int64, sorted unique key positions
    slash: list[torch.Tensor]  # per head: [n_s] int64, sorted unique offsets q_pos - k_pos
    # [H_l] float32: fraction of the *sampled* attention mass the lines cover
    # (set by select.select_lines; None for hand-made sets).
    sampled_coverage: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return len(self.vertical)


class Dims(NamedTuple):
    n: int  # new queries
    history_len: int  # N, cached keys before the first query
    num_keys: int  # K = N + n
    num_q_heads: int
    num_kv_heads: int
    group: int  # query heads per KV head
    line_group: int  # query heads per line head
    head_dim: int


def make_lines(
    vertical: Sequence[Sequence[int] | torch.Tensor],
    slash: Sequence[Sequence[int] | torch.Tensor],
    sampled_coverage: torch.Tensor | None = None,
) -> LineSet:
    """Normalise per-head lists of ints or tensors: int64, CPU, sorted, unique."""
    if len(vertical) != len(slash):
        raise ValueError(
            f"vertical has {len(vertical)} heads, slash has {len(slash)}; they must match"
        )

    def norm(x: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(x, dtype=torch.int64).flatten().cpu()
        return torch.unique(t)  # sorted

    return LineSet([norm(v) for v in vertical], [norm(s) for s in slash], sampled_coverage)


def band_and_sink(num_heads: int, local: int, sink: int, num_keys: int) -> LineSet:
    """The lines every selection keeps: offsets ``0..local-1`` and columns ``0..sink-1``."""
    v = torch.arange(min(sink, num_keys))
    s = torch.arange(min(local, num_keys))
    return LineSet([v.clone() for _ in range(num_heads)], [s.clone() for _ in range(num_heads)])


def check_lines(lines: LineSet, num_keys: int) -> None:
    """Lines are int64 CPU tensors, sorted, unique, inside ``[0, num_keys)``."""
    if len(lines.vertical) != len(lines.slash) or not lines.vertical:
        raise ValueError(
            f"LineSet needs the same nonzero number of heads in vertical "
            f"({len(lines.vertical)}) and slash ({len(lines.slash)})"
        )
    for kind, per_head in (("vertical", lines.vertical), ("slash", lines.slash)):
        for h, t in enumerate(per_head):
            if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
                raise ValueError(
                    f"{kind}[{h}] must be a 1-D int64 CPU tensor, got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device} (use make_lines)"
                )
            if t.numel() and (int(t[0]) < 0 or int(t[-1]) >= num_keys):
                raise ValueError(
                    f"{kind}[{h}] spans [{int(t[0])}, {int(t[-1])}], outside "
                    f"[0, {num_keys}) (num_keys = history_len + n)"
                )
            if t.numel() > 1 and not bool((t[1:] > t[:-1]).all()):
                raise ValueError(f"{kind}[{h}] is not sorted and unique (use make_lines)")


def check_inputs(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [N+n, Hkv, D]
    v: torch.Tensor | None,  # [N+n, Hkv, D]
    lines: LineSet | None,
    history_len: int,
) -> Dims:
    """Shape/dtype/device checks shared by every implementation. Returns the dims."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q, k must be 3-D, got {tuple(q.shape)}, {tuple(k.shape)}")
    n, hq, d = q.shape
    num_keys, hkv, dk = k.shape
    if history_len < 0 or num_keys != history_len + n:
        raise ValueError(
            f"k has {num_keys} positions; need history_len ({history_len}) + n ({n})"
        )
    if dk != d:
        raise ValueError(f"k head_dim {dk} != q head_dim {d}")
    if v is not None and (tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype):
        raise ValueError(
            f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is invalid; valid: {FLOAT_DTYPES}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    line_group = hq
    if lines is not None:
        check_lines(lines, num_keys)
        hl = lines.num_heads
        if hq % hl or hl % hkv:
            raise ValueError(
                f"LineSet has {hl} heads; it must divide num_q_heads {hq} and be a "
                f"multiple of num_kv_heads {hkv} (valid: {hkv} per KV head, {hq} per q head)"
            )
        line_group = hq // hl
    return Dims(n, history_len, num_keys, hq, hkv, hq // hkv, line_group, d)


def line_bitmaps(
    lines: LineSet, num_keys: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(is_vertical [H_l, K] bool, is_slash [H_l, K] bool)`` indexed by column / offset."""
    hl = lines.num_heads
    is_v = torch.zeros(hl, num_keys, dtype=torch.bool)
    is_s = torch.zeros(hl, num_keys, dtype=torch.bool)
    for h in range(hl):
        is_v[h, lines.vertical[h]] = True
        is_s[h, lines.slash[h]] = True
    return is_v.to(device), is_s.to(device)


def causal_cells(n: int, history_len: int) -> int:
    """Cells of the causal ``[n, N+n]`` extend matrix: ``n*N + n(n+1)/2``."""
    return n * history_len + n * (n + 1) // 2


def line_cells(lines: LineSet, n: int, history_len: int) -> torch.Tensor:
    """Exact number of selected causal cells per line head, ``[H_l]`` int64.

    A vertical ``c`` has ``n - max(0, c - N)`` cells, a slash ``d`` has
    ``n - max(0, d - N)``; a (slash d, vertical c) pair shares one cell iff the
    query ``c + d`` is one of the new ones, ``N <= c + d < N + n``.
    """
    out = torch.zeros(lines.num_heads, dtype=torch.int64)
    for h, (vert, sl) in enumerate(zip(lines.vertical, lines.slash)):
        len_v = (n - (vert - history_len).clamp(min=0)).clamp(min=0).sum()
        len_s = (n - (sl - history_len).clamp(min=0)).clamp(min=0).sum()
        lo = torch.searchsorted(vert, history_len - sl)  # first c >= N - d
        hi = torch.searchsorted(vert, history_len + n - sl)  # first c >= N + n - d
        out[h] = len_v + len_s - (hi - lo).sum()
    return out


def density(lines: LineSet, n: int, history_len: int) -> torch.Tensor:
    """Selected fraction of the causal extend matrix per line head, ``[H_l]`` float64."""
    return line_cells(lines, n, history_len).double() / max(causal_cells(n, history_len), 1)
