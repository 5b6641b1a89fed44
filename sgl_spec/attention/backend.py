"""sgl_spec's attention backend (``--attention-backend sgl_spec``), exact mode.

Exact mode is the path every sparse mode falls back to:

* extend: only the new queries attend, against prefix + new keys, under a causal
  mask offset by the prefix length. sglang's torch_native backend instead pads the
  query to the whole sequence, so a cached prefix still costs full quadratic
  attention (a 4k prompt with 3999 cached tokens: 3.56 s there vs 0.14 s here).
  Without a prefix the call is the one torch_native makes, bit for bit.
* decode: torch_native's, unchanged, so greedy outputs match stock sglang.

On CUDA hosts the factory delegates to sglang's FlashInfer (or Triton) backend.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_spec.sglang_compat import check_version

check_version()

from sglang.srt.layers.attention.torch_native_backend import (  # noqa: E402
    TorchNativeAttnBackend,
)

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def offset_causal_mask(
    prefix_len: int,
    q_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Bool mask [q_len, prefix_len + q_len]: query i sees keys 0..prefix_len+i.

    With ``sliding_window`` w it also hides keys older than w positions, as
    torch_native's sliding-window mask does.
    """
    q_pos = torch.arange(prefix_len, prefix_len + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(prefix_len + q_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None and sliding_window > -1:
        mask &= k_pos >= q_pos - sliding_window
    return mask


class SpecAttnBackend(TorchNativeAttnBackend):
    """torch_native with an extend that attends only the new queries."""

    def _run_sdpa_forward_extend(
        self,
        query: torch.Tensor,  # [num_new_tokens, num_heads, head_dim]
        output: torch.Tensor,  # [num_new_tokens, num_heads, v_head_dim], written
        k_cache: torch.Tensor,  # [pool_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [pool_size, num_kv_heads, v_head_dim]
        req_to_token: torch.Tensor,  # [max_reqs, max_context_len] int32
        req_pool_indices: torch.Tensor,  # [bs]
        seq_lens: torch.Tensor,  # [bs] prefix + new
        extend_prefix_lens: torch.Tensor,  # [bs]
        extend_seq_lens: torch.Tensor,  # [bs]
        encoder_lens: torch.Tensor | None = None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size: int | None = None,
    ):
        if encoder_lens is not None or is_cross_attn or not causal:
            # Encoder-decoder and bidirectional layers: torch_native's path.
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens,
                scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size,
            )
        query = query.movedim(0, 1)  # [num_heads, num_new_tokens, head_dim]
        seq_lens_l = seq_lens.tolist()
        prefix_l = extend_prefix_lens.tolist()
        windowed = sliding_window_size is not None and sliding_window_size > -1
        start_q = 0
        for i, (seq_len, prefix) in enumerate(zip(seq_lens_l, prefix_l)):
            q_len = seq_len - prefix
            end_q = start_q + q_len
            tokens = req_to_token[req_pool_indices[i], :seq_len]
            key = k_cache[tokens].movedim(0, 1)  # [num_kv_heads, seq_len, head_dim]
            value = v_cache[tokens].movedim(0, 1)
            q = query[:, start_q:end_q, :].contiguous()
            if not (q.dtype == key.dtype == value.dtype):
                key, value = key.to(q.dtype), value.to(q.dtype)
            if prefix == 0 and not windowed:
                mask, is_causal = None, True  # exactly torch_native's call
            else:
                mask = offset_causal_mask(prefix, q_len, q.device, sliding_window_size)
                is_causal = False
            out = scaled_dot_product_attention(
                q.unsqueeze(0),
                key.unsqueeze(0),
                value.unsqueeze(0),
                attn_mask=mask,
                enable_gqa=enable_gqa,
                scale=scaling,
                is_causal=is_causal,
            )
            output[start_q:end_q] = out.squeeze(0).movedim(1, 0)
            start_q = end_q
        return output


def create_backend(runner: "ModelRunner"):
    """Factory registered under ``--attention-backend sgl_spec``."""
    from sgl_spec.config import current

    # Runs in the scheduler process: the --spec-* flags arrive through the env.
    logger.info("sgl_spec attention backend, config %s", current().to_json())
    device = torch.device(runner.device)
    if device.type == "cuda":
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        try:
            import flashinfer  # noqa: F401

            name = "flashinfer"
        except ImportError:
            name = "triton"
        logger.info("sgl_spec exact mode on CUDA: delegating to sglang's %s backend", name)
        return ATTENTION_BACKENDS[name](runner)
    return SpecAttnBackend(runner)
