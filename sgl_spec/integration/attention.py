"""sgl_spec's attention backend (``--attention-backend sgl_spec``): sglang's side.

``SpecAttnBackend`` is torch_native with its attention replaced by
``sgl_spec.attention.AttentionCore``: ``init_forward_metadata`` turns the ForwardBatch
into a ``BatchView`` and builds the pass's plan once (``forward_metadata``); each
layer writes its K/V into the pool and makes one ``decode`` or ``extend`` call on the
plan (``AttentionCore.run``). Exact mode decodes every row with the fused dense kernel (the C++ CPU kernel
where it builds); extends attend only the new queries. Layers torch_native handles
specially (cross-attention, encoder-only, sliding windows, SWA pools) keep its code.

On CUDA hosts the factory delegates to sglang's FlashInfer (or Triton) backend, and
decode and prefill stay exact whatever the mode (the sparse paths are CPU-only so
far; ``sgl_spec.kernels.sparse_decode.flashinfer_impl`` is their GPU kernel).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sgl_spec.attention import AttentionCore, build_core
from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.decode import CUDA_DECODE_IMPL
from sgl_spec.config import current
from sgl_spec.sparse.policy import AttnShape

logger = logging.getLogger(__name__)


class SpecAttnBackend(TorchNativeAttnBackend):
    def __init__(self, runner, core: AttentionCore):
        super().__init__(runner)
        self.core = core

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        super().init_forward_metadata(forward_batch)
        if self.core.offload is not None:  # Algorithm 2, before the layers read the pool
            self.core.offload.update(forward_batch.batch_size)
        self.forward_metadata = self.core.plan(
            batch_view(forward_batch, self.req_to_token_pool.req_to_token))

    def _own(self, layer) -> bool:
        """Whether sgl_spec's core attends this layer (else torch_native's code)."""
        return not (
            layer.is_cross_attention
            or layer.attn_type == AttentionType.ENCODER_ONLY
            or (layer.sliding_window_size is not None and layer.sliding_window_size > -1)
            or self.use_sliding_window_kv_pool
        )

    def _write(self, layer, forward_batch, k, v, save_kv_cache: bool):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        lid = layer.layer_id
        return self.token_to_kv_pool.get_key_buffer(lid), self.token_to_kv_pool.get_value_buffer(lid)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        plan = self.forward_metadata
        if not self._own(layer) or plan is None or plan.extend is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        k_buf, v_buf = self._write(layer, forward_batch, k, v, save_kv_cache)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        self.core.run(plan, layer.layer_id, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                      k_buf, v_buf, o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
                      layer.scaling)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        plan = self.forward_metadata
        if not self._own(layer) or plan is None or plan.decode is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        k_buf, v_buf = self._write(layer, forward_batch, k, v, save_kv_cache)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        self.core.run(plan, layer.layer_id, q, k_buf, v_buf,
                      o.view(-1, layer.tp_q_head_num, layer.v_head_dim), layer.scaling)
        return o


def batch_view(fb: ForwardBatch, req_to_token: torch.Tensor) -> BatchView:
    """The pass as sgl_spec's attention path sees it (one host sync for the lengths)."""
    mode = fb.forward_mode
    if fb.rids is None or not (mode.is_decode() or mode.is_extend_without_speculative()):
        return BatchView("other")  # idle, speculative, dummy passes: torch_native's path
    seq = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.cpu()
    common = dict(
        rids=tuple(fb.rids), seq_lens=tuple(seq.tolist()),
        pool_rows=tuple(fb.req_pool_indices.tolist()), req_to_token=req_to_token,
        rows=fb.req_pool_indices.long(), seq_lens_t=fb.seq_lens.long(),
        input_ids=fb.input_ids, out_cache_loc=fb.out_cache_loc,
    )
    if mode.is_decode():
        return BatchView("decode", **common)
    ext = fb.extend_seq_lens_cpu
    ext = tuple(ext) if ext is not None else tuple(fb.extend_seq_lens.tolist())
    return BatchView("extend", extend_lens=ext,
                     final_chunk=getattr(fb, "contains_last_prefill_chunk", True), **common)


def attn_shape(runner) -> AttnShape:
    from sglang.srt.runtime_context import get_parallel

    mc = runner.model_config
    tp = get_parallel().attn_tp_size
    return AttnShape(num_layers=mc.num_hidden_layers,
                     num_q_heads=mc.get_max_num_attention_heads() // tp,
                     num_kv_heads=mc.get_num_kv_heads(tp), head_dim=mc.head_dim,
                     kv_dtype=runner.token_to_kv_pool.dtype)


def create_backend(runner):
    """Factory registered under ``--attention-backend sgl_spec``."""
    cfg = current()
    # Runs in the scheduler process: the --spec-* flags arrive through the env.
    logger.info("sgl_spec attention backend, config %s", cfg.to_json())
    cuda = torch.device(runner.device).type == "cuda"
    if cuda and not cfg.decode.retrieval_head:
        return _delegate_on_cuda(runner, cfg)
    head, pool_layers = None, None
    if cfg.decode.retrieval_head:
        from .head import build_runtime

        head, pool_layers = build_runtime(runner, runner.device)
    # SpeContext on CUDA: the same plan, the staged rows on the split-K Triton kernel,
    # copies on a side stream; CUDA graphs off (the launcher's --disable-cuda-graph), so
    # each layer's call is eager, which favours Triton over FlashInfer planned per layer
    # (docs/specontext.md, GPU). The decoder on CUDA is tested with both; serving on a
    # GPU is not verified.
    tiers = getattr(runner.token_to_kv_pool, "tiers", None)  # tiered_pool.TieredMHAPool's
    if cfg.rounds.enable and tiers is None:
        logger.warning("--spec-rounds: the KV pool is not layer-tiered (%s): every layer "
                       "keeps every token; serving exact", cfg.rounds.decision or
                       type(runner.token_to_kv_pool).__name__)
    core = build_core(cfg, attn_shape(runner), runner.device,
                      enable_metrics=runner.server_args.enable_metrics, head=head,
                      pool_layers=pool_layers, impl=CUDA_DECODE_IMPL if cuda else None,
                      tiers=tiers)
    if cfg.decode.offload == "auto":
        from .tiers.offload import PoolOffload

        core.offload = PoolOffload(runner.token_to_kv_pool, runner.token_to_kv_pool_allocator,
                                   core.decoder.policy, core.decoder.prefetcher,
                                   runner.model_config.num_hidden_layers,
                                   cfg.decode.offload_kv_bytes)
        core.hub.add_rows_source(lambda: core.offload.annotate(core.decoder.rows()))
    return SpecAttnBackend(runner, core)


def _delegate_on_cuda(runner, cfg):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    try:
        import flashinfer  # noqa: F401

        name = "flashinfer"
    except ImportError:
        name = "triton"
    for what, mode in (("--spec-mode", cfg.decode.mode), ("--spec-prefill", cfg.prefill.mode)):
        if mode != "exact":
            # Unverified on a GPU: the CUDA path would need the decoder's plan made
            # graph-safe for sglang's CUDA-graph decode (FlashInferSparseDecode's
            # plan/run is the kernel side). Attention here is exact whatever the mode.
            logger.warning("%s %s is CPU-only for now: on CUDA sgl_spec delegates to "
                           "sglang's %s backend, which is exact", what, mode, name)
    logger.info("sgl_spec on CUDA: delegating to sglang's %s backend", name)
    return ATTENTION_BACKENDS[name](runner)
