"""A transformers Llama / Qwen2 model as the restore pre-pass's ``LayerOps``.

The served pre-pass binds sglang's modules (``integration.tiers.krul_restore``); this binds
a transformers model of the same family, for the tests' reference and for
``calibrate restore --pipeline-share``, which times the pre-pass against the load where
sglang cannot run (a GPU machine without it).
"""

from __future__ import annotations

import torch


class HFOps:
    """``prepass.LayerOps`` over a transformers ``LlamaForCausalLM`` /
    ``Qwen2ForCausalLM`` (``model.model`` holds the layers)."""

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.m = model.model
        self.num_layers = len(self.m.layers)
        c = model.config
        self.hq = c.num_attention_heads
        self.hkv = getattr(c, "num_key_value_heads", None) or self.hq
        self.d = getattr(c, "head_dim", None) or c.hidden_size // self.hq
        self._rope = apply_rotary_pos_emb

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m.embed_tokens(ids)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        a = self.m.layers[layer].self_attn
        q = a.q_proj(x).view(-1, self.hq, self.d).transpose(0, 1)[None]
        k = a.k_proj(x).view(-1, self.hkv, self.d).transpose(0, 1)[None]
        v = a.v_proj(x).view(-1, self.hkv, self.d)
        cos, sin = self.m.rotary_emb(x[None], positions[None])
        q, k = self._rope(q, k, cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v

    def attn_out(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        return self.m.layers[layer].self_attn.o_proj(o.reshape(o.shape[0], -1))

    def norm(self, layer: int, which: int, h: torch.Tensor, residual: torch.Tensor | None):
        h = h if residual is None else h + residual
        lyr = self.m.layers[layer]
        return (lyr.input_layernorm if which == 0 else lyr.post_attention_layernorm)(h), h

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.m.layers[layer].mlp(x)

    def scale(self, layer: int) -> float:
        return self.d ** -0.5
