"""Dense decode of one request over its whole history, GQA folded into the query rows.

A sparse policy's rows that attend everything (LoopServe before its first
selection at step 16, while it records the queries it will score with) are exact
attention; the question is only which kernel computes it. torch_native's decode
calls SDPA per request with one query row and ``enable_gqa``, which takes the
unfused math path on a CPU. Here the ``G`` query heads of a KV head become ``G``
query rows of one ``[1, Hkv, G, D]`` SDPA call over the request's gathered K/V,
which runs SDPA's fused flash kernel: 58 ms against 324 ms per 30-layer step at a
7k history on this CPU, one thread, with the same error against float64
(``python -m sgl_spec.kernels.sparse_decode.bench_dense --history 7168 --threads 1``).
Same softmax, other rounding: exact mode keeps torch_native's call, so it stays
bit-identical to stock.

``reference.sparse_decode_reference`` with the full subset is its oracle.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def dense_decode(
    q: torch.Tensor,  # [Hq, D] one request's query
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    token_slots: torch.Tensor,  # [seq_len] int: the request's slots, positions 0..seq_len-1
    *,
    scale: float,
) -> torch.Tensor:  # [Hq, Dv], q.dtype
    """Softmax attention of ``q`` over every position of the history."""
    hq, d = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    slots = token_slots.long()
    k = k_buf.index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = v_buf.index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, L, Dv]
    qg = q.reshape(1, hkv, hq // hkv, d).to(k.dtype)  # [1, Hkv, G, D]
    o = scaled_dot_product_attention(qg, k, v, scale=scale)  # [1, Hkv, G, Dv]
    return o.reshape(hq, -1).to(q.dtype)
