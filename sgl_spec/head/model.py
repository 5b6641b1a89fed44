"""The lightweight retrieval head (SpeContext Sec 4.3): its weights and its math.

For token j at position j, with e_j the (draft's or target's) embedding of the token
and a_{j-1} the target's hidden states at position j - 1 captured at the head's aux
layers (EAGLE-3's draft input)::

    c_j   = hidden_norm(fc(a_j))                                # [H]
    k_j   = RoPE(W_k [input_norm(e_j) ; c_{j-1}], j)            # [Hkv, D]
    q_t   = RoPE(W_q [input_norm(e_t) ; c_{t-1}], t)            # [Hq, D]
    s_h   = max over the query heads g of KV head h's group of softmax_j(q_t,g . k_j,h)

``W_k [x ; y] = W_k,e x + W_k,h y``, so the hidden part of a key, ``kh_j = W_k,h c_j``,
can be computed as soon as the target's pass over token j is done and kept per token
(the serving path keeps it in the KV pool beside the head's K); likewise
``qh_t = W_q,h c_t`` for the next query. Selection takes the top-B positions of
``s_h`` per target KV head (Sec 4.3, GQA: element-wise max over the group), one
selection for every layer of the target.

Weights are fp32 on the head's device; activations are converted on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rope
from .config import HeadConfig

# name -> (shape as a function of the config)
WEIGHT_SHAPES = {
    "fc": lambda c, n: (c.hidden_size, n * c.target_hidden_size),
    "hidden_norm": lambda c, n: (c.hidden_size,),
    "input_norm": lambda c, n: (c.hidden_size,),
    "q_proj": lambda c, n: (c.num_q_heads * c.head_dim, 2 * c.hidden_size),
    "k_proj": lambda c, n: (c.num_kv_heads * c.head_dim, 2 * c.hidden_size),
}


@dataclass(frozen=True)
class HeadWeights:
    """The tensors the head uses; ``embed`` None: the target's input embedding."""

    fc: torch.Tensor  # [H, n_aux * Ht]
    hidden_norm: torch.Tensor  # [H]
    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [Hq * D, 2H]: columns [:H] embedding part, [H:] hidden part
    k_proj: torch.Tensor  # [Hkv * D, 2H]
    embed: torch.Tensor | None = None  # [V, H]

    def check(self, cfg: HeadConfig, n_aux: int = 3) -> None:
        """ValueError naming every tensor whose shape does not fit ``cfg``."""
        bad = [f"{name} {tuple(getattr(self, name).shape)} (expected {fn(cfg, n_aux)})"
               for name, fn in WEIGHT_SHAPES.items()
               if tuple(getattr(self, name).shape) != fn(cfg, n_aux)]
        if self.embed is not None and tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            bad.append(f"embed {tuple(self.embed.shape)} (expected "
                       f"{(cfg.vocab_size, cfg.hidden_size)})")
        if bad:
            raise ValueError("retrieval head weights do not fit the config: " + "; ".join(bad))

    def to(self, device, dtype=torch.float32) -> HeadWeights:
        conv = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return HeadWeights(*(conv(getattr(self, f)) for f in
                             ("fc", "hidden_norm", "input_norm", "q_proj", "k_proj", "embed")))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RetrievalHead:
    """Stateless math over ``HeadWeights``; the per-token state (``kh``, ``qh``, keys)
    lives with the caller. Not a ``torch.nn.Module``: nothing here is trained in place
    (``sgl_spec.head.train`` has its own module)."""

    def __init__(self, cfg: HeadConfig, weights: HeadWeights, n_aux: int = 3,
                 device: torch.device | str = "cpu"):
        weights.check(cfg, n_aux)
        self.cfg = cfg
        self.n_aux = n_aux
        self.w = weights.to(device)
        h = cfg.hidden_size
        self.q_e, self.q_h = self.w.q_proj[:, :h], self.w.q_proj[:, h:]
        self.k_e, self.k_h = self.w.k_proj[:, :h], self.w.k_proj[:, h:]
        self.fc_parts = self.w.fc.split(cfg.target_hidden_size, dim=1)  # n_aux x [H, Ht]
        self.inv_freq, self.attn_factor = rope.inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        self.scale = cfg.head_dim ** -0.5

    # ------------------------------------------------------------ per token

    def aux_part(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """``fc``'s share of aux layer ``i``: [T, Ht] -> [T, H] fp32 (fc is linear, so
        the three captures are summed as they arrive, none kept)."""
        return hidden.float() @ self.fc_parts[i].T

    def context(self, fc_out: torch.Tensor) -> torch.Tensor:
        """``c = hidden_norm(fc(a))``: [T, H] fp32 (``fc_out``: the summed ``aux_part``)."""
        return rms_norm(fc_out, self.w.hidden_norm, self.cfg.rms_norm_eps)

    def key_hidden(self, c: torch.Tensor) -> torch.Tensor:
        """``kh = W_k,h c``: [T, Hkv*D] fp32, the next position's key's hidden part."""
        return c @ self.k_h.T

    def query_hidden(self, c: torch.Tensor) -> torch.Tensor:
        """``qh = W_q,h c``: [T, Hq*D] fp32, the next position's query's hidden part."""
        return c @ self.q_h.T

    def _embedded(self, ids: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        table = self.w.embed if self.w.embed is not None else embed
        if table is None:
            raise ValueError("this retrieval head has no embedding: pass the target's")
        e = table.index_select(0, ids.long().to(table.device)).to(self.inv_freq.device)
        return rms_norm(e, self.w.input_norm, self.cfg.rms_norm_eps)

    def keys(
        self,
        ids: torch.Tensor,  # [T] token ids
        positions: torch.Tensor,  # [T] int64
        kh_prev: torch.Tensor,  # [T, Hkv*D] hidden part of each key (kh of position - 1)
        embed: torch.Tensor | None = None,  # [V, H] the target's, when the head has none
    ) -> torch.Tensor:  # [T, Hkv, D] fp32, roped
        k = self._embedded(ids, embed) @ self.k_e.T + kh_prev.float()
        k = k.view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)
        return rope.apply(k, positions, self.inv_freq, self.attn_factor)

    def queries(
        self,
        ids: torch.Tensor,  # [B] the tokens about to be decoded
        positions: torch.Tensor,  # [B] int64 their positions
        qh_prev: torch.Tensor,  # [B, Hq*D] qh of position - 1
        embed: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [B, Hq, D] fp32, roped
        q = self._embedded(ids, embed) @ self.q_e.T + qh_prev.float()
        q = q.view(-1, self.cfg.num_q_heads, self.cfg.head_dim)
        return rope.apply(q, positions, self.inv_freq, self.attn_factor)

    # ------------------------------------------------------------ selection

    def scores(
        self,
        q: torch.Tensor,  # [R, Hq, D]
        k: torch.Tensor,  # [R, N, Hkv, D] each row's keys (padded past k_len)
        k_len: torch.Tensor,  # [R] int64 valid keys per row
    ) -> torch.Tensor:  # [R, Hkv, N] fp32: group max of the per-head softmax
        rows, n, hkv, d = k.shape
        g = self.cfg.group
        mm = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
        qg = (q.float() * self.scale).view(rows, hkv, g, d).reshape(rows * hkv, g, d).to(mm)
        kt = k.to(mm).permute(0, 2, 3, 1).reshape(rows * hkv, d, n)
        logits = torch.bmm(qg, kt).view(rows, hkv, g, n).float()
        if int(k_len.min()) < n:
            pad = torch.arange(n, device=k.device)[None, :] >= k_len.to(k.device)[:, None]
            logits.masked_fill_(pad[:, None, None, :], float("-inf"))
        return self.group_max(logits)

    @staticmethod
    def group_max(logits: torch.Tensor) -> torch.Tensor:
        """``[R, Hkv, G, N]`` scaled logits -> ``[R, Hkv, N]``: each query head's softmax
        over the keys, then the max over the KV head's group (Sec 4.3)."""
        return torch.softmax(logits, dim=-1).amax(dim=2)

    # ------------------------------------------------------------ offline

    def over_sequence(
        self,
        ids: torch.Tensor,  # [T] a whole sequence's tokens
        aux: torch.Tensor,  # [T, n_aux, Ht] the target's stream entering each aux layer
        embed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [T, Hkv, D], qh_prev [T, Hq*D])`` of every position at once: what the
        serving runtime builds pass by pass (benchmarks, tests). The query of position
        t is ``queries(ids[t:t+1], [t], qh_prev[t:t+1])``."""
        acc = sum(self.aux_part(i, aux[:, i]) for i in range(self.n_aux))
        c = self.context(acc)
        shift = lambda x: torch.cat([x.new_zeros(1, x.shape[1]), x[:-1]])  # noqa: E731
        pos = torch.arange(ids.shape[0], device=c.device)
        return self.keys(ids, pos, shift(self.key_hidden(c)), embed), shift(self.query_hidden(c))
