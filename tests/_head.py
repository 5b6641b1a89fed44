"""Shared pieces of the retrieval-head tests: a random head, a dense float64
reference of its selection, and a fake pool for its extra layer."""

from __future__ import annotations

import math

import torch

from sgl_spec.attention.batch import BatchView
from sgl_spec.head.config import HeadConfig
from sgl_spec.head.model import HeadWeights, RetrievalHead
from sgl_spec.head.runtime import HeadRuntime, HeadStore

HCFG = HeadConfig(hidden_size=24, num_q_heads=6, num_kv_heads=2, head_dim=32, vocab_size=50,
                  target_hidden_size=16, rope_theta=1000.0, aux_layers=(1, 2, 3))


def random_weights(cfg: HeadConfig = HCFG, seed: int = 0, embed: bool = True) -> HeadWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h = cfg.hidden_size
    return HeadWeights(
        fc=r(h, 3 * cfg.target_hidden_size) / 4, hidden_norm=1 + r(h) / 10,
        input_norm=1 + r(h) / 10, q_proj=r(cfg.num_q_heads * cfg.head_dim, 2 * h) / 3,
        k_proj=r(cfg.num_kv_heads * cfg.head_dim, 2 * h) / 3,
        embed=r(cfg.vocab_size, h) if embed else None)


def reference_select(cfg: HeadConfig, w: HeadWeights, ids, aux, t: int, budget: int,
                     sink: int, window: int) -> torch.Tensor:
    """[Hkv, budget] sorted: SpeContext's selection for the token at position t,
    written out in float64 loops from the module docstring's formulas."""
    w = w.to("cpu", torch.float64)
    h, d, g = cfg.hidden_size, cfg.head_dim, cfg.group
    eps = cfg.rms_norm_eps

    def rms(x, wt):
        return x / torch.sqrt((x * x).mean() + eps) * wt

    def rope(v, pos):  # [n, D]
        out = torch.empty_like(v)
        for i in range(d // 2):
            ang = pos * cfg.rope_theta ** (-2 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            out[:, i] = v[:, i] * c - v[:, i + d // 2] * s
            out[:, i + d // 2] = v[:, i + d // 2] * c + v[:, i] * s
        return out

    def ctx(j):
        if j < 0:
            return torch.zeros(h, dtype=torch.float64)
        return rms(w.fc @ aux[j].double().flatten(), w.hidden_norm)

    def inp(j):
        return torch.cat([rms(w.embed[ids[j]], w.input_norm), ctx(j - 1)])

    keys = [rope((w.k_proj @ inp(j)).view(cfg.num_kv_heads, d), j) for j in range(t)]
    q = rope((w.q_proj @ inp(t)).view(cfg.num_q_heads, d), t)
    out = []
    for kv in range(cfg.num_kv_heads):
        k = torch.stack([kj[kv] for kj in keys])  # [t, D]
        probs = torch.stack([torch.softmax(k @ q[kv * g + i] * d ** -0.5, 0) for i in range(g)])
        score = probs.max(0).values
        cand = list(range(sink, t + 1 - window))
        top = sorted(cand, key=lambda j: -float(score[j]))[:budget]
        out.append(sorted(top))
    return torch.tensor(out)


class HeadPool:
    """The pool's head layer and req_to_token for a few requests (fp32, NaN-poisoned)."""

    def __init__(self, slots: int = 1024, rows: int = 4, ctx: int = 512, seed: int = 0,
                 device: str = "cpu"):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        shape = (slots, HCFG.num_kv_heads, HCFG.head_dim)
        self.keys = torch.full(shape, float("nan"), device=device)
        self.kh = torch.full(shape, float("nan"), device=device)
        self.req_to_token = torch.zeros(rows, ctx, dtype=torch.int32, device=device)
        self.free = torch.randperm(slots, generator=self.gen).tolist()

    def store(self, embed=None) -> HeadStore:
        return HeadStore(lambda: (self.keys, self.kh), embed)

    def take(self, row: int, start: int, n: int) -> torch.Tensor:
        slots = torch.tensor([self.free.pop() for _ in range(n)], device=self.device)
        self.req_to_token[row, start : start + n] = slots.int()
        return slots


def runtime(w: HeadWeights, pool: HeadPool) -> HeadRuntime:
    dev = pool.device
    return HeadRuntime(RetrievalHead(HCFG, w, device=dev), pool.store(), dev)


def pass_view(pool: HeadPool, mode: str, rids, rows, seq_lens, new, ids, loc) -> BatchView:
    dev = pool.device
    return BatchView(mode, tuple(rids), tuple(seq_lens), tuple(rows),
                     tuple(new) if mode == "extend" else (), True, pool.req_to_token,
                     torch.tensor(rows, device=dev), torch.tensor(seq_lens, device=dev),
                     ids.to(dev), loc.to(dev))


def run_pass(rt: HeadRuntime, view: BatchView, aux: torch.Tensor) -> None:
    """One forward pass as the server drives the head: begin, then the three taps."""
    rt.begin_pass(view)
    for i in range(aux.shape[1]):
        rt.capture(i, aux[:, i].to(rt.device))
