"""Running attention statistics a conversation's strategy is chosen from (Krul Sec 5).

Algorithm 1 needs, per layer, the share of attention on the first and last 10% of the
history, and between layers, the Euclidean distance of their attention maps. Neither
needs the maps: with rows a_l (one query position's attention, all query heads,
flattened), ``||a_i - a_j||^2 = <a_i,a_i> + <a_j,a_j> - 2<a_i,a_j>`` (the paper's
a^2 + b^2 - 2ab), so a Gram matrix G [L, L] summed over observed rows is enough, and
the state is O(L^2) whatever the length. Rows are folded in one layer at a time
(``Step.add``): a layer's rows are dotted with the step's earlier layers' rows and
kept only until the step ends, so at most one step of rows is ever held. The
server's estimator (``sgl_spec.attention.observe``) feeds it a conversation's rows.

Which rows are observed is the caller's choice (a sample of the prefill's query
positions, and every n-th decode step); every layer of a step must see the same
positions, so the rows align.
"""

from __future__ import annotations

import math
import threading

import torch


def attention_rows(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention rows of some query positions.

    q: [m, Hq, D] (any float dtype), the queries at positions ``q_pos``.
    k: [n, Hkv, D], the keys of positions 0..n-1; Hq % Hkv == 0 (GQA: query head h
    reads KV head h // (Hq / Hkv), as sglang's layers do). The keys are not repeated per
    query head (a decode row over 6k keys would copy 14 MB a layer).
    q_pos: [m] int, each row's position (< n); a row sees keys 0..q_pos.
    Returns [m, Hq, n] float32; entries past a row's position are 0.
    """
    m, hq, d = q.shape
    n, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    scale = d ** -0.5 if scale is None else scale
    g = hq // hkv
    qh = q.float().view(m, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m * g, d)
    s = torch.bmm(qh, k.float().permute(1, 2, 0))                     # [Hkv, m*g, n]
    s = s.view(hkv, m, g, n).permute(1, 0, 2, 3).reshape(m, hq, n) * scale
    if bool((q_pos < n - 1).any()):                                   # a decode row sees all
        future = torch.arange(n, device=k.device)[None, :] > q_pos.to(k.device)[:, None]
        s.masked_fill_(future[:, None, :], float("-inf"))
    return torch.softmax(s, dim=-1)


def attention_rows_ref(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """Torch reference of ``attention_rows``: keys repeated per query head, float64."""
    m, hq, d = q.shape
    n, hkv, _ = k.shape
    scale = d ** -0.5 if scale is None else scale
    kk = k.double().repeat_interleave(hq // hkv, dim=1)                # [n, Hq, D]
    s = torch.einsum("mhd,nhd->mhn", q.double(), kk) * scale
    future = torch.arange(n, device=k.device)[None, :] > q_pos.to(k.device)[:, None]
    s.masked_fill_(future[:, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).float()


def ir_mass(rows: torch.Tensor, q_pos: torch.Tensor, edge: float = 0.1) -> torch.Tensor:
    """Per row and head, the attention on the first and last ``edge`` of the keys the
    row sees (ceil(edge * (pos + 1)) keys at each end, counted once if they overlap).

    rows: [m, Hq, n] float; q_pos: [m] int. Returns [m, Hq] float32.
    """
    out = torch.empty(rows.shape[:2], dtype=torch.float32)
    for i, pos in enumerate(q_pos.tolist()):
        seen = pos + 1
        w = math.ceil(seen * edge)
        r = rows[i].float()
        out[i] = r[:, :w].sum(-1)
        if seen - w >= w:
            out[i] += r[:, seen - w : seen].sum(-1)
        elif w < seen:
            out[i] += r[:, w:seen].sum(-1)
    return out


class Similarity:
    """Gram matrix, I-R mass and row counts of the rows observed so far.

    Owned by one conversation (the per-request accumulator, then a payload on its
    cache node); not thread-safe. All state is float64 on the CPU, O(L^2).
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.gram = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.ir = torch.zeros(num_layers, dtype=torch.float64)
        self.rows = torch.zeros(num_layers, dtype=torch.float64)      # (row, head)s per layer
        self.lock = threading.Lock()  # a step's sums go in whole (Step.close)

    def step(self) -> Step:
        """Start folding one set of aligned rows (one per layer)."""
        return Step(self)

    def copy(self) -> Similarity:
        """A snapshot (whole steps only: taken under the lock that ``Step.close`` holds)."""
        s = Similarity(self.num_layers)
        with self.lock:
            s.merge(self)
        return s

    def merge(self, other: Similarity) -> None:
        """Add another accumulator's sums (a child branch, a carried-over turn)."""
        if other.num_layers != self.num_layers:
            raise ValueError(f"layer counts differ: {self.num_layers} vs {other.num_layers}")
        self.gram += other.gram
        self.ir += other.ir
        self.rows += other.rows

    def ir_share(self) -> torch.Tensor:
        """[L] float64: mean over observed (row, head)s of the I-R mass; 0 if unobserved."""
        return self.ir / self.rows.clamp(min=1)

    def distances(self) -> torch.Tensor:
        """[L, L] float64: Euclidean distance of the layers' flattened maps, divided by
        sqrt(rows) so distances of conversations of different lengths compare."""
        g = self.gram
        d2 = (g.diagonal()[:, None] + g.diagonal()[None, :] - 2 * g).clamp(min=0)
        return torch.sqrt(d2 / self.rows.max().clamp(min=1))

    def observed(self) -> int:
        return int(self.rows.min().item())

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "gram": self.gram.flatten().tolist(),
                "ir": self.ir.tolist(), "rows": self.rows.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> Similarity:
        s = cls(d["num_layers"])
        s.gram = torch.tensor(d["gram"], dtype=torch.float64).view(s.num_layers, s.num_layers)
        s.ir = torch.tensor(d["ir"], dtype=torch.float64)
        s.rows = torch.tensor(d["rows"], dtype=torch.float64)
        return s


class Step:
    """One set of aligned rows being folded in, layer by layer (any order).

    ``add(layer, rows, q_pos)`` dots the rows (float32) with those of the layers already
    added in this step, which it keeps until ``close()``; the step's sums go into the
    accumulator at ``close()``, under its lock, so a snapshot (``Similarity.copy``) never
    holds half a step. Not thread-safe itself: one thread at a time adds to a step.
    """

    def __init__(self, sim: Similarity):
        self.sim = sim
        L = sim.num_layers
        self.kept: list[int] = []                                      # layers, in order added
        self._buf: torch.Tensor | None = None                          # [L, m*Hq*n] f32
        self._dots = torch.zeros(L, L, dtype=torch.float64)           # in the order added
        self._ir = torch.zeros(L, dtype=torch.float64)
        self._rows = 0

    def add(self, layer: int, rows: torch.Tensor, q_pos: torch.Tensor) -> None:
        """rows: [m, Hq, n] float, the step's attention rows at ``layer``."""
        if layer in self.kept:
            raise ValueError(f"layer {layer} already added to this step")
        if not 0 <= layer < self.sim.num_layers:
            raise ValueError(f"layer {layer} is out of range; valid: 0..{self.sim.num_layers - 1}")
        flat = rows.detach().to("cpu", torch.float32).reshape(-1)
        if self._buf is None:
            self._buf = torch.empty(self.sim.num_layers, flat.numel())
        elif self._buf.shape[1] != flat.numel():
            raise ValueError(f"layer {layer}'s rows {list(rows.shape)} do not align with "
                             f"the step's ({self._buf.shape[1]} values)")
        c = len(self.kept)
        self._buf[c] = flat
        self._dots[c, : c + 1] = self._buf[: c + 1] @ flat
        self._ir[layer] = float(ir_mass(rows, q_pos).double().sum())
        self._rows = rows.shape[0] * rows.shape[1]
        self.kept.append(layer)

    def close(self) -> None:
        """Add the step's sums to the accumulator and drop its rows (the paper's ``del``
        at the end of a decode step)."""
        if self.kept:
            c = len(self.kept)
            order = torch.tensor(self.kept)
            low = self._dots[:c, :c].tril()
            part = torch.zeros_like(self._dots)
            part[order[:, None], order[None, :]] = low + low.tril(-1).T
            added = torch.zeros(self.sim.num_layers, dtype=torch.float64)
            added[order] = self._rows
            with self.sim.lock:
                self.sim.gram += part
                self.sim.ir += self._ir
                self.sim.rows += added
        self.kept.clear()
        self._buf = None
        self._dots.zero_()
        self._ir.zero_()

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reference_distances(maps: list[torch.Tensor]) -> torch.Tensor:
    """Torch reference of ``Similarity.distances``: maps [L] of [r, Hq, n] attention
    rows (the same r rows per layer); cdist of the flattened maps / sqrt(r * Hq)."""
    flat = torch.stack([m.double().reshape(-1) for m in maps])        # [L, r*Hq*n]
    r = maps[0].shape[0] * maps[0].shape[1]
    return torch.cdist(flat, flat) / math.sqrt(r)
