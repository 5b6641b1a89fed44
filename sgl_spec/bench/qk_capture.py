"""Per-layer queries and keys of a real prompt, after RoPE, from HF transformers on CPU.

The offline measurements of sparse prefill (``prefill_mass``, the crossover and
reuse benchmarks of ``sgl_spec.bench.vslash``) need the attention inputs
the serving backend sees. A custom attention function, registered with
transformers' ``AttentionInterface``, records ``query``/``key`` as the model's own
attention layers hand them over (rotary embedding applied, keys not yet repeated
for GQA), then runs SDPA as usual.

Also builds the prompt: a two-turn ChatML chat over corpus prose, so that the
boundary between the turns (what a second turn would find cached) is known.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_CAPTURE = "sgl_spec_capture"


class LayerQK(NamedTuple):
    q: torch.Tensor  # [T, Hq, D] bf16 CPU
    k: torch.Tensor  # [T, Hkv, D] bf16 CPU
    v: torch.Tensor  # [T, Hkv, D] bf16 CPU


class ChatPrompt(NamedTuple):
    ids: list[int]  # the whole templated chat
    turn_boundary: int  # tokens of turn 1 (system, user, assistant); turn 2 follows


def chat_prompt(tokenizer, n_tokens: int, seed: int = 0) -> ChatPrompt:
    """~``n_tokens`` of a two-turn chat: each user turn is corpus prose plus a question."""
    from sgl_spec import corpus

    half = max(64, n_tokens // 2 - 40)
    docs = corpus.documents(tokenizer, half, 2, seed)
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": corpus.join(docs[0]) + "\n\nSummarise the text above."},
        {"role": "assistant", "content": "The text describes how the system stores "
         "and reuses cached conversation state."},
        {"role": "user", "content": corpus.join(docs[1]) + "\n\nHow does this relate "
         "to the first text?"},
    ]

    def encode(m: list[dict], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(m, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    first = encode(msgs[:3], False)
    ids = encode(msgs, True)[:n_tokens]
    return ChatPrompt(ids, min(len(first), len(ids) - 1))


def load_model(path: str):
    """(model, tokenizer) in float32 on CPU, attention routed through the capture
    (float32: CPUs without AVX512-BF16 run bf16 GEMMs several times slower)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register(_CAPTURE, _capture_attention)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=_CAPTURE
    )
    return model.eval(), AutoTokenizer.from_pretrained(path)


_SINK: list[LayerQK] | None = None


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _SINK is not None:  # [1, H, T, D] -> [T, H, D], bf16 as the served KV pool
        _SINK.append(LayerQK(*(t[0].transpose(0, 1).to(torch.bfloat16).contiguous()
                               for t in (query, key, value))))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def capture(model, ids: list[int]) -> list[LayerQK]:
    """One forward pass over ``ids``; the q/k/v of every layer, in layer order."""
    global _SINK
    _SINK = []
    try:
        # logits_to_keep=1: the LM head over every position would cost more than the layers
        model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        out = _SINK
    finally:
        _SINK = None
    if len(out) != model.config.num_hidden_layers:
        raise RuntimeError(f"captured {len(out)} layers, the model has "
                           f"{model.config.num_hidden_layers} (attention not routed?)")
    return out
